"""Which quantisation scheme a model runs: the checkpoint's own, else the requested one.

    quantization_config.quant_method (config.json)   scheme
    "fp8"                                            Fp8Scheme(serialized=True)
    "gptq", "awq"                                    Int4Scheme(checkpoint=HfInt4Format)
    (none) + requested "fp8" / "int4"                quantised at load from the fp weights
                                                     (fp8: minus its full_precision layers)
    a GGUF of 4-bit blocks (native "int4")           Int4Scheme: the blocks as stored
    requested "none"                                 dense weights (a GGUF's blocks dequantised)

A request that contradicts the checkpoint (fp8 for a GPTQ file, int4 for an FP8 one) is
refused; any other quant_method is refused by name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from pdserve.engine.quant.fp8_scheme import Fp8Scheme
from pdserve.engine.quant.int4_scheme import Int4Scheme
from pdserve.engine.quant.scheme import QuantScheme

REQUESTABLE = (None, "none", "fp8", "int4")
_AT_LOAD = {"fp8": Fp8Scheme, "int4": Int4Scheme}
_FROM_CHECKPOINT = {"fp8": Fp8Scheme.from_config, "gptq": Int4Scheme.from_config,
                    "awq": Int4Scheme.from_config}


def resolve_quantization(requested: str | None, model_dir: str | Path,
                         fp8_full_precision: Sequence[str] | None = None,
                         int4_kernel: str = "auto", native: str | None = None
                         ) -> QuantScheme | None:
    """The scheme to run: the checkpoint's own, else the requested one, else None.
    `fp8_full_precision` (None: the scheme's default) applies to "fp8" quantised at load;
    `int4_kernel` to any int4 scheme; `native` is what the file's own blocks are
    (`Checkpoint.native_quantization`), run as stored when nothing else is requested."""
    if requested is None and native == "int4":
        requested = "int4"
    scheme = _resolve(None if requested == "none" else requested, Path(model_dir),
                      fp8_full_precision)
    if requested == "none" and scheme is not None:
        raise ValueError(f"quantization='none' was requested but the checkpoint is stored as "
                         f"{scheme.key}: it has no dense weights to load")
    if isinstance(scheme, Int4Scheme) and int4_kernel != "auto":
        scheme = dataclasses.replace(scheme, kernel=int4_kernel)
    return scheme


def _resolve(requested: str | None, model_dir: Path,
             fp8_full_precision: Sequence[str] | None) -> QuantScheme | None:
    if requested not in REQUESTABLE:
        raise ValueError(f"quantization must be None, 'none', 'fp8' or 'int4', got "
                         f"{requested!r}")
    if fp8_full_precision is not None and requested != "fp8":
        raise ValueError("fp8_full_precision_layers needs quantization='fp8'")
    qc = _checkpoint_quant_config(Path(model_dir))
    if qc is None:
        if requested == "fp8" and fp8_full_precision is not None:
            return Fp8Scheme(full_precision=tuple(fp8_full_precision))
        return None if requested is None else _AT_LOAD[requested]()
    method = qc.get("quant_method")
    if method not in _FROM_CHECKPOINT:
        raise ValueError(f"config.json quantization_config.quant_method {method!r} is not "
                         f"supported (supported: {', '.join(sorted(_FROM_CHECKPOINT))})")
    if fp8_full_precision:
        raise ValueError("fp8_full_precision_layers applies to quantising at load; this "
                         f"checkpoint is already {method}")
    scheme = _FROM_CHECKPOINT[method](qc)
    if requested is not None and requested != scheme.family:
        raise ValueError(f"quantization={requested!r} was requested but the checkpoint is "
                         f"{method} ({scheme.family}): drop the option or use another "
                         "checkpoint")
    return scheme


def _checkpoint_quant_config(model_dir: Path) -> dict | None:
    path = model_dir / "config.json"
    if not path.is_file():
        return None
    qc = json.loads(path.read_text()).get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ValueError("config.json quantization_config must be an object")
    return qc
