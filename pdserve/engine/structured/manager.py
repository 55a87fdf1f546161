"""The engine's structured-output bookkeeping: one `GrammarState` per constrained request.

    add_request ─► prepare(req)            compile (cached) + a fresh matcher
    execute     ─► bitmask(chunks, reqs)   [rows, words] int32 for the step's sampled rows
    apply_results ─► advance(req, tokens)  how many tokens stand, and "stop" once the grammar
                                           terminates ("abort" if it refused a token)
    finish      ─► release(rid)

Engine-thread only, except `compiler.compile`, which workers also call from a thread pool to
warm the cache before a request reaches the engine.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.finish import FinishReason
from pdserve.engine.request import Request
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.structured.compiler import GrammarCompiler
from pdserve.engine.structured.state import GrammarState

log = logging.getLogger(__name__)
_WORD_BITS = 32


@dataclass(frozen=True)
class Advance:
    keep: int
    """How many of the step's tokens stand (the rest follow the grammar's end)."""
    reason: FinishReason | None
    """STOP when the grammar terminated, ABORT when it refused a token, else None."""


class StructuredOutputs:
    def __init__(self, make_compiler: Callable[[], GrammarCompiler], vocab_size: int) -> None:
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._states: dict[str, GrammarState] = {}
        self._words = -(-vocab_size // _WORD_BITS)

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on first use (it reads the tokenizer): engines that never constrain an
        output never import xgrammar."""
        with self._lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
            return self._compiler

    def prepare(self, req: Request) -> None:
        """A matcher for a constrained request (raises InvalidConstraint, a ValueError)."""
        spec = req.params.structured
        if spec is not None:
            self._states[req.request_id] = GrammarState(self.compiler.matcher(spec))

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @property
    def num_active(self) -> int:
        return len(self._states)

    def bitmask(self, chunks: Sequence[ScheduledChunk], requests: Mapping[str, Request]
                ) -> tuple[torch.Tensor, list[int]] | None:
        """(bitmask, rows) for the constrained rows of a step (None when there are none).
        Rows are numbered as the step's sampled logits: `num_samples` per chunk, in order."""
        if not self._states:
            return None
        todo: list[tuple[GrammarState, int, list[int]]] = []
        row = 0
        for c in chunks:
            if c.num_samples == 0:
                continue
            state = self._states.get(c.request_id)
            if state is not None:
                state.sync(requests[c.request_id].output_token_ids)  # e.g. P's first token
                todo.append((state, row, c.spec_token_ids))
            row += c.num_samples
        if not todo:
            return None
        rows = [r + j for _, r, drafts in todo for j in range(len(drafts) + 1)]
        mask = torch.full((len(rows), self._words), -1, dtype=torch.int32)
        at = 0
        for state, _, drafts in todo:
            state.fill(mask, at, drafts)
            at += len(drafts) + 1
        return mask, rows

    def advance(self, req: Request, tokens: Sequence[int]) -> Advance:
        """Feed a step's accepted tokens to the request's matcher (no-op if unconstrained)."""
        state = self._states.get(req.request_id)
        if state is None:
            return Advance(len(tokens), None)
        state.sync(req.output_token_ids)
        for i, tok in enumerate(tokens):
            if not state.accept(tok):
                log.error("request %s: token %d is outside its grammar; ending it",
                          req.request_id, tokens[i])
                return Advance(i, FinishReason.ABORT)
            if state.terminated:
                return Advance(i + 1, FinishReason.STOP)
        return Advance(len(tokens), None)
