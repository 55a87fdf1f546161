"""Compiles `StructuredOutput`s for one tokenizer; thread-safe, with an LRU cache.

Workers call `compile` on a thread pool before a request enters the engine, so the engine
thread (and the event loop) never waits for a compile; the engine's own call then hits the
cache. Concurrent compiles of the same spec run once (the others wait for it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from pdserve.engine.structured.grammar import InvalidConstraint, build_grammar, clean_error
from pdserve.engine.structured.spec import StructuredOutput
from pdserve.engine.structured.tokenizer_info import tokenizer_info
from pdserve.tokenizer import Tokenizer

CACHE_ENTRIES = 256


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Iterable[int],
                 max_threads: int = 2, cache_entries: int = CACHE_ENTRIES) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self._xgr = xgr
        self._info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        # xgrammar's own cache is keyed by grammar text; ours by spec, so a hit skips parsing.
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=max_threads,
                                             cache_enabled=False)
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutput, Future] = OrderedDict()
        self._entries = cache_entries
        self.compiles = 0
        """Grammars actually compiled (cache misses), for tests and stats."""

    def compile(self, spec: StructuredOutput) -> Any:
        """The CompiledGrammar for `spec`; raises InvalidConstraint (a client error)."""
        with self._lock:
            fut = self._cache.get(spec)
            owner = fut is None
            if owner:
                fut = self._cache[spec] = Future()
                while len(self._cache) > self._entries:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(spec)
        if not owner:
            return fut.result()
        try:
            compiled = self._compile(spec)
        except BaseException as exc:
            with self._lock:
                self._cache.pop(spec, None)  # errors are not cached: a retry recompiles
            fut.set_exception(exc)
            raise
        fut.set_result(compiled)
        return compiled

    def matcher(self, spec: StructuredOutput) -> Any:
        """A fresh GrammarMatcher at the start of `spec`'s grammar."""
        return self._xgr.GrammarMatcher(self.compile(spec))

    def _compile(self, spec: StructuredOutput) -> Any:
        grammar = build_grammar(spec)
        self.compiles += 1
        try:
            return self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as exc:
            raise InvalidConstraint(f"invalid {spec.kind.value}: {clean_error(exc)}") from None
