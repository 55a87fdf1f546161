"""Tokenising off the router's event loop.

A prompt's text is bounded by bytes before it gets here (`validation.check_text`), so each job
is bounded work; this module keeps it off the loop and bounds how much of it may wait:

    encode(text) ── short text ──► inline (a thread hop would cost more than the work)
                 └─ else ──► pending < max_pending ? thread pool (the tokenizer releases the
                                                     GIL while it works) : TokenizerBusy

Chat prompts render their template on the pool too (jinja2 holds the GIL, but in slices the
interpreter switches between, so the loop keeps turning).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pdserve.tokenizer import Tokenizer

T = TypeVar("T")

INLINE_CHARS = 2048
"""Texts up to this many characters are tokenised on the loop: microseconds of work."""


class TokenizerBusy(Exception):
    """Too many prompts are waiting to be tokenised (the router answers RESOURCE_EXHAUSTED)."""

    def __init__(self, pending: int, retry_after_s: float) -> None:
        super().__init__(f"{pending} prompts are waiting to be tokenised")
        self.retry_after_s = retry_after_s


class TokenizerPool:
    def __init__(self, tokenizer: Tokenizer, threads: int = 2, max_pending: int = 64) -> None:
        self.tokenizer = tokenizer
        self.max_pending = max_pending
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")
        self.pending = 0

    async def encode(self, text: str) -> list[int]:
        if len(text) <= INLINE_CHARS:
            return self.tokenizer.encode(text)
        return await self.run(self.tokenizer.encode, text)

    async def run(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on the pool: tokenizer work whose size was bounded before (a chat
        template's rendering, bounded by `validation.check_chat`)."""
        if self.pending >= self.max_pending:
            raise TokenizerBusy(self.pending, retry_after_s=0.5)
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, functools.partial(fn, *args))
        finally:
            self.pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
