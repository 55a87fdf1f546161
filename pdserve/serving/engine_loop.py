"""Runs an `LLMEngine` on its own thread and connects it to an asyncio server.

The engine is single-threaded by design. gRPC handlers never touch it directly: they `call()`
a function that runs on the engine thread between two steps, and read their request's outputs
from an asyncio queue that the engine thread feeds through `call_soon_threadsafe`.

    handler ──call(fn)──► command queue ──(between steps)──► fn(engine) ──► future result
    engine thread: loop { run commands; if work: step(); push outputs to per-request queues }

When it has no work, the engine thread spends the pause on `engine.idle_tick()` (KV blocks
next in line for eviction are copied to the host tier ahead of time) until that reports
nothing left, and only then blocks waiting for commands.

Every step is timed into `meter` (the worker's speed model, `step_meter`), from the end of the
previous step while the loop stays busy (so the time between steps counts too), which
`start()` first calibrates with a few dummy steps unless told not to.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pdserve.engine.engine import IO_STALL_WAIT_S, LLMEngine
from pdserve.engine.finish import FinishReason
from pdserve.engine.outputs import StepOutput
from pdserve.serving import step_meter

log = logging.getLogger(__name__)
T = TypeVar("T")
StepFn = Callable[[LLMEngine], list[StepOutput]]


class EngineLoop:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop,
                 step_fn: StepFn | None = None, name: str = "engine",
                 calibrate: bool = True) -> None:
        self.engine = engine
        self.meter = step_meter.StepMeter()
        self._calibrate = calibrate
        self._loop = loop
        self._step_fn = step_fn or (lambda e: e.step())
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._streams: dict[str, asyncio.Queue[StepOutput]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.steps = 0
        self.failure: BaseException | None = None
        # Engine statistics as of the last step or command batch. Readers (health polls,
        # metrics scrapes) take this reference instead of waiting for a long prefill step.
        self.stats: dict[str, float] = engine.stats()

    def set_step_fn(self, step_fn: StepFn) -> None:
        """Replace the step (e.g. the prefill worker's step with KV streaming); before start."""
        self._step_fn = step_fn

    def start(self) -> None:
        if self._calibrate:  # before the thread: nothing else touches the engine yet
            step_meter.calibrate(self.engine, self.meter)
            self.stats = self.engine.stats()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None

    # -- called from the asyncio side ----------------------------------------------------
    def call(self, fn: Callable[[LLMEngine], T]) -> asyncio.Future[T]:
        """Run `fn(engine)` on the engine thread; the future resolves with its result."""
        fut: asyncio.Future[T] = self._loop.create_future()

        def run() -> None:
            try:
                result: Any = fn(self.engine)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                self._loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                self._loop.call_soon_threadsafe(_set_result, fut, result)

        self._commands.put(run)
        return fut

    def post(self, fn: Callable[[LLMEngine], None]) -> None:
        """Fire-and-forget variant of `call`, usable from any thread."""
        self._commands.put(lambda: fn(self.engine))

    def open_stream(self, request_id: str, *also: str) -> asyncio.Queue[StepOutput]:
        """One queue for the outputs of `request_id` and of the requests in `also` (the
        choices forked from it)."""
        q: asyncio.Queue[StepOutput] = asyncio.Queue()
        for rid in (request_id, *also):
            self._streams[rid] = q
        return q

    def close_stream(self, request_id: str, *also: str) -> None:
        for rid in (request_id, *also):
            self._streams.pop(rid, None)

    # -- engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        last_end = None  # end of the previous step, while the loop stays busy
        try:
            while not self._stop.is_set():
                idle = not self.engine.has_unfinished()
                worked = idle and self.engine.idle_tick() > 0
                stalled = not idle and self.engine.stalled_on_io
                if idle or stalled:
                    last_end = None  # a pause is not a step's cost
                # Stalled: every waiting request waits for its SSD reads; poll, do not spin.
                self._drain_commands(block=(idle and not worked) or stalled,
                                     timeout_s=IO_STALL_WAIT_S if stalled else 0.5)
                self.stats = self.engine.stats()
                if self._stop.is_set() or not self.engine.has_unfinished():
                    continue
                queued = self.stats["queued_prefill_tokens"]
                t0 = time.perf_counter()
                outputs = self._step_fn(self.engine)
                end = time.perf_counter()
                # What a request waits per step: the step and, while busy, the commands and
                # bookkeeping between steps (GIL shared with the server's threads).
                elapsed, last_end = end - (last_end if last_end is not None else t0), end
                self.steps += 1
                self.stats = self.engine.stats()
                # Tokens computed: prefill progress plus the tokens sampled (decode).
                prefilled = max(queued - self.stats["queued_prefill_tokens"], 0)
                self.meter.observe(int(prefilled) + sum(len(o.new_token_ids) for o in outputs),
                                   elapsed)
                if outputs:
                    self._loop.call_soon_threadsafe(self._dispatch, outputs)
        except BaseException as exc:  # noqa: BLE001 - reported through health checks
            log.exception("engine loop died")
            self.failure = exc
            self._loop.call_soon_threadsafe(self._fail_all)
            # Never step again, but keep answering calls (they fail or finish fast), so no
            # caller waits forever on a future.
            while not self._stop.is_set():
                self._drain_commands(block=True)

    def _drain_commands(self, block: bool, timeout_s: float = 0.5) -> None:
        try:
            cmd = self._commands.get(timeout=timeout_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            cmd()
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _fail_all(self) -> None:
        for rid in list(self._streams):
            self.push_finished(rid, FinishReason.ABORT)

    def push_finished(self, request_id: str, reason: FinishReason) -> None:
        """Tell a request's stream it ended outside a step (asyncio thread only)."""
        q = self._streams.get(request_id)
        if q is not None:
            q.put_nowait(StepOutput(request_id, [], [], reason, 0, 0, 0))

    def emit(self, outputs: list[StepOutput]) -> None:
        """Deliver outputs produced outside `step()` (callable from the engine thread)."""
        self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
