"""GPTQ and AWQ checkpoints in Hugging Face format -> `Int4Weight`, exactly (integer unpacking).

Both store, per quantised linear layer `<p>`, int32 tensors that pack eight 4-bit values, and
float16 scales; `quantization_config` in config.json says which layout:

    GPTQ  <p>.qweight int32 [K/8, N]  value k = 8i + j of column n: bits 4j..4j+3 of [i, n]
          <p>.qzeros  int32 [G, N/8]  zero of output n = 8i + j: bits 4j.. of [g, i]; the classic
                                      format ("gptq", AutoGPTQ) stores zero - 1, "gptq_v2" zero
          <p>.scales  fp16  [G, N]
          <p>.g_idx   int32 [K]       group of each input feature; not k // group_size when the
                                      checkpoint was quantised in act order (desc_act)
          w[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])
    AWQ   <p>.qweight int32 [K, N/8]  packed along N in the interleaved order [0,2,4,6,1,3,5,7]:
                                      nibble j of [k, i] is column 8i + order[j]
          <p>.qzeros  int32 [G, N/8]  the same packing; zeros stored as they are
          <p>.scales  fp16  [G, N]    w[n, k] = scales[k // g, n] * (q[k, n] - zero[k // g, n])

so scale = s and offset = -zero * s in the `Int4Weight` form. group_size -1 means one group per
row; groups that are not a power of two (the row) are split into equal power-of-two groups
with the scale repeated. An act-order `g_idx` becomes a column permutation (`column_order`):
sorting the input features by group makes every group contiguous and keeps the numbers exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

from pdserve.engine.quant.int4_weight import Int4Weight

QUANT_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_REQUIRED_PARTS = ("qweight", "qzeros", "scales")
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_UNDO = tuple(_AWQ_ORDER.index(c) for c in range(8))  # nibble that holds column c
_MAX_SPLIT_GROUP = 128  # a whole-row group becomes groups of at most this many features


@dataclass(frozen=True)
class HfInt4Format:
    method: str
    """"gptq" or "awq"."""
    group_size: int
    """Input features per group; -1: one group per row."""
    zero_offset: int = 0
    """Added to each stored zero point (1 for classic GPTQ, which stores zero - 1)."""

    @classmethod
    def from_config(cls, qc: Mapping) -> HfInt4Format:
        method = qc.get("quant_method")
        bits = qc.get("bits", qc.get("w_bit"))
        if bits != 4:
            raise ValueError(f"{method} checkpoints with bits={bits!r} are not supported "
                             "(only 4-bit)")
        group = qc.get("group_size", qc.get("q_group_size"))
        if not isinstance(group, int) or not (group == -1 or group >= 16 and group % 8 == 0):
            raise ValueError(f"{method} group_size {group!r} is not supported (-1 or a "
                             "multiple of 8 of at least 16)")
        if method == "gptq":
            return cls._gptq(qc, group)
        if method == "awq":
            return cls._awq(qc, group)
        raise ValueError(f"quant_method {method!r} is not a 4-bit Hugging Face format")

    @classmethod
    def _gptq(cls, qc: Mapping, group: int) -> HfInt4Format:
        fmt = qc.get("checkpoint_format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported ('gptq' or "
                             "'gptq_v2')")
        if qc.get("lm_head"):
            raise ValueError("GPTQ lm_head: true (a quantised LM head) is not supported")
        if qc.get("dynamic"):
            raise ValueError("GPTQ dynamic (per-module bits / group sizes) is not supported")
        return cls("gptq", group, zero_offset=1 if fmt == "gptq" else 0)

    @classmethod
    def _awq(cls, qc: Mapping, group: int) -> HfInt4Format:
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ version {version!r} is not supported (only 'gemm')")
        if qc.get("zero_point") is False:
            raise ValueError("AWQ zero_point: false is not supported")
        if qc.get("modules_to_not_convert"):
            raise ValueError(f"AWQ modules_to_not_convert {qc['modules_to_not_convert']!r}: "
                             "mixed-precision checkpoints are not supported")
        return cls("awq", group)

    def to_int4(self, parts: Mapping[str, torch.Tensor]) -> Int4Weight:
        if self.method == "gptq":
            return gptq_to_int4(parts["qweight"], parts["qzeros"], parts["scales"],
                                parts.get("g_idx"), self.group_size, self.zero_offset)
        return awq_to_int4(parts["qweight"], parts["qzeros"], parts["scales"], self.group_size)


def unpack_int32(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 tensor -> uint8 values, eight per int32 (lowest nibble first) along `dim`."""
    if packed.dtype != torch.int32:
        raise ValueError(f"packed 4-bit tensors must be int32, got {packed.dtype}")
    nib = (packed.unsqueeze(dim + 1) >> _SHIFTS.view([8] + [1] * (packed.dim() - dim - 1)))
    shape = list(packed.shape)
    shape[dim] *= 8
    return (nib & 0xF).to(torch.uint8).reshape(shape)


def gptq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 g_idx: torch.Tensor | None, group_size: int, zero_offset: int) -> Int4Weight:
    q = unpack_int32(qweight, 0)  # [K, N]
    k, n = q.shape
    g = k if group_size == -1 else group_size
    zeros = unpack_int32(qzeros, 1)[:, :n].to(torch.int32) + zero_offset  # [G, N]
    _check_groups(scales, zeros, k, n, g, "GPTQ")
    plain = torch.arange(k) // g
    order = None
    if g_idx is not None and not torch.equal(g_idx.long(), plain):
        order = _act_order(g_idx.long(), k, g)
        q = q.index_select(0, order)
    return _int4(q.t(), scales, zeros, g, order)


def awq_to_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                group_size: int) -> Int4Weight:
    undo = (torch.arange(qweight.shape[1] * 8).view(-1, 8)[:, list(_AWQ_UNDO)]).flatten()
    q = unpack_int32(qweight, 1)[:, undo]  # [K, N]
    k, n = q.shape
    g = k if group_size == -1 else group_size
    zeros = unpack_int32(qzeros, 1)[:, undo].to(torch.int32)
    _check_groups(scales, zeros, k, n, g, "AWQ")
    return _int4(q.t(), scales, zeros, g, None)


def _check_groups(scales: torch.Tensor, zeros: torch.Tensor, k: int, n: int, g: int,
                  what: str) -> None:
    if k % g:
        raise ValueError(f"{what}: {k} input features are not a whole number of groups of {g}")
    if tuple(scales.shape) != (k // g, n) or tuple(zeros.shape) != (k // g, n):
        raise ValueError(f"{what}: scales {list(scales.shape)} / qzeros {list(zeros.shape)} do "
                         f"not match {k // g} groups of {n} outputs")


def _act_order(g_idx: torch.Tensor, k: int, g: int) -> torch.Tensor:
    """The column permutation that makes every group contiguous (stable: order kept inside)."""
    if g_idx.numel() != k or g_idx.min() < 0 or g_idx.max() >= k // g:
        raise ValueError(f"g_idx must hold {k} group numbers in [0, {k // g})")
    if not torch.equal(torch.bincount(g_idx, minlength=k // g), torch.full((k // g,), g)):
        raise ValueError(f"g_idx does not give every group exactly {g} input features")
    return torch.argsort(g_idx, stable=True)


def _int4(q_nk: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g: int,
          order: torch.Tensor | None) -> Int4Weight:
    scale = scales.t().float()
    offset = -zeros.t().float() * scale
    split = g
    while split & (split - 1) or split > _MAX_SPLIT_GROUP:  # e.g. a whole row of 576 -> 64
        if split % 2:
            raise ValueError(f"groups of {g} cannot be split into power-of-two groups")
        split //= 2
    if split < 16:
        raise ValueError(f"groups of {g} cannot be split into power-of-two groups of >= 16")
    if split != g:
        scale = scale.repeat_interleave(g // split, dim=1)
        offset = offset.repeat_interleave(g // split, dim=1)
    return Int4Weight(q_nk.contiguous(), scale.contiguous(), offset.contiguous(), split, order)


def adapt_hf_int4_checkpoint(weights: Iterable[tuple[str, torch.Tensor]],
                             names: Iterable[str], fmt: HfInt4Format
                             ) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
    """Checkpoint tensors with each layer's packed tensors replaced by `<p>.weight` as an
    `Int4Weight`, yielded as soon as all of that layer's parts have been read."""
    expected = _expected_parts(names)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in QUANT_PARTS or prefix not in expected:
            yield name, tensor
            continue
        got = pending.setdefault(prefix, {})
        got[part] = tensor
        if set(got) == expected[prefix]:
            del pending[prefix]
            yield f"{prefix}.weight", fmt.to_int4(got)
    if pending:
        prefix = sorted(pending)[0]
        raise ValueError(f"{fmt.method} tensors of {prefix} are incomplete: read "
                         f"{sorted(pending[prefix])} of {sorted(expected[prefix])}")


def _expected_parts(names: Iterable[str]) -> dict[str, set[str]]:
    parts: dict[str, set[str]] = {}
    for name in names:
        prefix, _, part = name.rpartition(".")
        if part in QUANT_PARTS:
            parts.setdefault(prefix, set()).add(part)
    for prefix, have in parts.items():
        missing = [p for p in _REQUIRED_PARTS if p not in have]
        if missing:
            raise ValueError(f"4-bit layer {prefix} has no {', '.join(missing)} in the checkpoint")
    return parts
