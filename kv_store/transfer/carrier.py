"""KV payload tensors as the transport moves them: each wire dtype (`wire.DTYPES`) travels as
a tensor of its carrier dtype (fp8 as uint8 bytes, which every backend can move), and is seen
again in its own dtype on arrival, by views, never copies.
"""

from __future__ import annotations

import torch

from kv_store.transfer.wire import DTYPES

_NAMES = {getattr(torch, name): name for name in DTYPES}


def _carrier(name: str) -> torch.dtype:
    return getattr(torch, DTYPES[name][0])


def dtype_name(dtype: torch.dtype) -> str:
    """Wire name of a payload dtype; `ValueError` for dtypes the engine does not move."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"kv dtype {dtype} is not one of {sorted(DTYPES)}") from None


def to_carrier(kv: torch.Tensor) -> torch.Tensor:
    """Contiguous tensor in the dtype the backend moves (a view, or a copy if non-contiguous)."""
    kv = kv.contiguous()
    carrier = _carrier(dtype_name(kv.dtype))
    return kv if kv.dtype == carrier else kv.view(carrier)


def empty_carrier(shape: tuple[int, ...], name: str, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=_carrier(name), device=device)


def carrier_view(raw: torch.Tensor, shape: tuple[int, ...], name: str) -> torch.Tensor:
    """`raw` (contiguous uint8 bytes, exactly `wire.payload_nbytes(shape, name)` of them) seen
    as the payload of a LAYER header, in the header's dtype (a view: no copy)."""
    return from_carrier(raw.view(_carrier(name)).view(shape), name)


def from_carrier(buf: torch.Tensor, name: str) -> torch.Tensor:
    dtype = getattr(torch, name)
    return buf if buf.dtype == dtype else buf.view(dtype)
