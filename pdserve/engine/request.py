"""A request inside the engine, and its lifecycle.

    WAITING ──admit──► RUNNING ──stop/length──► FINISHED_STOPPED | FINISHED_LENGTH
     ▲   ▲                │  └──abort──────────► FINISHED_ABORTED (from any state)
     │   └──preempt (recompute)┘
     │  WAITING_FOR_KV ──all KV arrived (activate)──► RUNNING   (KV computed by a prefill worker)
     └─ PULLING ──pull settled──┘                               (prefix copied from a holder)
    RUNNING with `forks`, prompt KV in ──fork──► each choice: RUNNING  (shares the prompt's KV)

The two waiting-for-KV states belong to the scheduler (`pdserve.engine.remote_kv` describes
them). A request with `n` > 1 outputs carries its other choices in `forks`: once its prompt's
KV is in (computed here, or landed from a prefill worker), each is forked from it as a RUNNING
request of its own that shares the prompt's full blocks and a copy of its last partial block
(`Scheduler.fork_ready`), and computes only the last prompt token itself.
`num_computed_tokens` counts tokens whose KV is in the cache; everything the scheduler and the
runner need is derived from it and the token lists. `output_token_ids` may start
non-empty: a request continued on another worker (migration) brings the tokens it already
generated, and sampling, penalties and stop rules see them as output, not prompt.
`block_ids` is append-only while the request runs (a preemption releases them all at once);
before admission it holds the blocks a pull pinned or filled, released once admitted.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.engine.finish import FinishReason
from pdserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    PULLING = "pulling"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> FinishReason | None:
        return FinishReason(self.value) if self.is_finished else None

    @classmethod
    def finished(cls, reason: FinishReason) -> RequestStatus:
        return cls(reason.value)


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
             RequestStatus.FINISHED_ABORTED}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, in order
    num_published_blocks: int = 0  # leading blocks already registered in the prefix cache
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    num_preemptions: int = 0
    # SSD reads this request waits for before its prefix is matched (None: not staged yet).
    tier_wait: frozenset[bytes] | None = None
    # Speculative tokens proposed for the next step (verified, then dropped or kept).
    spec_token_ids: list[int] = field(default_factory=list)
    # With params.prompt_logprobs: TokenLogprobs of prompt tokens 1.. computed so far (the
    # first prompt token has none); complete once the prompt's prefill is.
    prompt_logprobs: list = field(default_factory=list)
    # Choices to fork from this request once its prompt's KV is in: (request id, seed).
    forks: list[tuple[str, int]] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids [start, end) over prompt + output, without building the full list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished
