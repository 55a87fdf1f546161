"""GPTQ and AWQ checkpoints written by the tests' own small quantiser and packer.

Independent of pdserve's readers on purpose: the packing below follows the published layouts
(AutoGPTQ: 8 values along K per int32, zeros minus one in the classic format; AutoAWQ: along N in
the order [0, 2, 4, 6, 1, 3, 5, 7]), so a reader that disagrees with them fails the tests.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

LINEAR_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "w1", "w2", "w3")  # w1/w2/w3: Mixtral's experts
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class Quantised:
    """One layer: integer values [N, K], per-group scale and integer zero [N, G], g_idx [K]."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    g_idx: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        s, z = self.scale[:, self.g_idx], self.zero[:, self.g_idx].float()
        return (self.q.float() - z) * s


def quantize(w: torch.Tensor, group: int, sym: bool = False,
             perm: torch.Tensor | None = None) -> Quantised:
    """Round-to-nearest with integer zero points, as GPTQ / AWQ store them. `perm`: the order
    input features are quantised in (act order); the feature at position p is in group p // g."""
    n, k = w.shape
    g = k if group == -1 else group
    order = torch.arange(k) if perm is None else perm
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // g
    cols = w[:, order].float().view(n, k // g, g)
    lo, hi = cols.amin(-1).clamp(max=0), cols.amax(-1).clamp(min=0)
    if sym:
        scale = (torch.maximum(-lo, hi) * 2 / 15).clamp(min=1e-8)
        zero = torch.full_like(scale, 8)
    else:
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        zero = (-lo / scale).round().clamp(0, 15)
    scale = scale.half().float()  # the checkpoint stores fp16 scales
    q = (w.float() / scale[:, g_idx]).round() + zero[:, g_idx]
    return Quantised(q.clamp(0, 15).to(torch.int64), scale, zero.to(torch.int64), g_idx)


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    x = x & 0xFFFFFFFF
    return torch.where(x >= 2**31, x - 2**32, x).to(torch.int32)


def pack_along_rows(v: torch.Tensor) -> torch.Tensor:
    """int [R, C] -> int32 [R / 8, C]: row 8i + j in bits 4j of row i."""
    v = v.view(v.shape[0] // 8, 8, v.shape[1])
    return _to_int32(sum((v[:, j] & 0xF) << (4 * j) for j in range(8)))


def pack_along_cols(v: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """int [R, C] -> int32 [R, C / 8]: nibble j of column i holds column 8i + order[j]."""
    v = v.view(v.shape[0], v.shape[1] // 8, 8)
    return _to_int32(sum((v[:, :, order[j]] & 0xF) << (4 * j) for j in range(8)))


def gptq_tensors(qz: Quantised, v1: bool = True) -> dict[str, torch.Tensor]:
    stored_zero = (qz.zero - 1) if v1 else qz.zero
    return {"qweight": pack_along_rows(qz.q.t().contiguous()),
            "qzeros": pack_along_cols(stored_zero.t().contiguous()),
            "scales": qz.scale.t().contiguous().half(),
            "g_idx": qz.g_idx.to(torch.int32)}


def awq_tensors(qz: Quantised) -> dict[str, torch.Tensor]:
    return {"qweight": pack_along_cols(qz.q.t().contiguous(), AWQ_ORDER),
            "qzeros": pack_along_cols(qz.zero.t().contiguous(), AWQ_ORDER),
            "scales": qz.scale.t().contiguous().half()}


def write_int4_checkpoint(src: Path, dst: Path, method: str, group: int = 32,
                          sym: bool = False, desc_act: bool = False, v1: bool = True,
                          seed: int = 0) -> dict[str, torch.Tensor]:
    """A GPTQ / AWQ copy of `src` at `dst`; returns the dequantised weight of every quantised
    layer (the numbers a correct loader must reproduce), by checkpoint name."""
    shutil.copytree(src, dst)
    gen = torch.Generator().manual_seed(seed)
    out, reference, perms = {}, {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not (name.endswith(".weight") and any(f".{p}." in name for p in LINEAR_PARTS)):
            out[name] = t
            continue
        # Act order follows the layer input's statistics, so q/k/v (and gate/up), which read
        # the same input, share one order, as in a GPTQ checkpoint.
        shared = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
        shared = shared.replace("up_proj", "gate_proj").replace(".w3.", ".w1.")
        if desc_act and shared not in perms:
            perms[shared] = torch.randperm(t.shape[1], generator=gen)
        perm = perms.get(shared)
        qz = quantize(t, group, sym, perm)
        tensors = gptq_tensors(qz, v1) if method == "gptq" else awq_tensors(qz)
        prefix = name.removesuffix(".weight")
        out.update({f"{prefix}.{k}": v for k, v in tensors.items()})
        reference[name] = qz.dequantize()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    if method == "gptq":
        qc = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym,
              "desc_act": desc_act, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    else:
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm"}
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    return reference


def write_dense_copy(src: Path, dst: Path, weights: dict[str, torch.Tensor]) -> Path:
    """`src` with some weights replaced (e.g. by their dequantised 4-bit values)."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    tensors.update({k: v.to(tensors[k].dtype) for k, v in weights.items()})
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def random_int4(n: int, k: int, group: int, seed: int = 0):
    """A random 4-bit [n, k] weight with small scales and near-symmetric offsets."""
    from pdserve.engine.quant.int4_weight import Int4Weight

    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(n, k // group, generator=gen) * 0.02 + 1e-3
    offset = -8 * scale + torch.randn(n, k // group, generator=gen) * 0.01
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    return Int4Weight(q, scale, offset, group)


def kernel_bound(w) -> torch.Tensor:
    """Per-weight error bound of the CPU int4 kernel (bf16 scales and zeros), with 1% room."""
    s = w.scale.abs().repeat_interleave(w.group_size, 1)
    z = (w.offset + 8 * w.scale).abs().repeat_interleave(w.group_size, 1)
    return (8 * s + z) * 2**-8 * 1.01
