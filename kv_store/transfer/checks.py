"""Argument checks of the public sender API: clear `ValueError`s that name the field."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

from kv_store.transfer import carrier, wire
from kv_store.transfer.config import TransferConfig
from kv_store.transfer.rendezvous import parse_address


def check_request_id(request_id: str) -> None:
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")


def check_body(body: bytes) -> None:
    if not isinstance(body, bytes | bytearray):
        raise ValueError(f"body must be bytes, got {type(body).__name__}")
    if len(body) > wire.MAX_BODY_BYTES:
        raise ValueError(f"body has {len(body)} bytes; at most {wire.MAX_BODY_BYTES}")


def check_lease(lease_s: float | None) -> None:
    if lease_s is None:
        return
    if (isinstance(lease_s, bool) or not isinstance(lease_s, int | float)
            or not math.isfinite(lease_s) or lease_s < 0):
        raise ValueError(f"lease_s must be a finite number >= 0, got {lease_s!r}")


def check_layer(
    config: TransferConfig, address: str, request_id: str, layer: int,
    block_ids: Sequence[int], kv: torch.Tensor,
) -> tuple[int, ...]:
    """Validate `send_layer` arguments; return the block ids as a tuple of ints."""
    parse_address(address)
    check_request_id(request_id)
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
        raise ValueError(f"layer must be an int >= 0, got {layer!r}")
    if not isinstance(kv, torch.Tensor):
        raise TypeError(f"kv must be a torch.Tensor, got {type(kv).__name__}")
    carrier.dtype_name(kv.dtype)
    try:
        blocks = tuple(operator.index(b) for b in block_ids)
    except TypeError:
        raise ValueError("block_ids must be a sequence of ints") from None
    if any(b < 0 for b in blocks):
        raise ValueError("block_ids must be >= 0")
    if kv.dim() < 1 or kv.shape[0] != len(blocks):
        raise ValueError(f"kv.shape[0] must equal len(block_ids)={len(blocks)}, "
                         f"got shape {tuple(kv.shape)}")
    if kv.numel() * kv.element_size() > config.max_message_bytes:
        raise ValueError(f"kv is larger than max_message_bytes={config.max_message_bytes}")
    return blocks
