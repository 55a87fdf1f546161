"""The drafter interface: what every proposer of speculative tokens provides.

A proposer looks at running requests (in decode: their next token is the last one, whose KV
is not yet in the target's cache) and proposes up to k tokens per request. It also says from
which distribution each token was drawn (`Proposal.draft_probs`, the q of rejection sampling),
or that the proposal is deterministic (None: q is one-hot at the proposed token).

Proposers that keep per-request state (a draft model's KV) are told when a request ends or is
preempted; they must also cope with requests they have never seen, at any length (a decode
worker receives requests whose prompt KV was computed elsewhere).

Learned heads (EAGLE, EAGLE-3, MTP, Medusa) also read the target's hidden states: a proposer
with a `feature_spec` gets every step's `StepFeatures` through `extend`, called once per step
after the scheduler applied the step's tokens (so a request's `num_computed_tokens` counts
only verified positions) and before `propose`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pdserve.engine.request import Request
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.spec.features import FeatureSpec, StepFeatures


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]
    """Draft tokens for positions num_tokens, num_tokens + 1, ... of the request (>= 1)."""
    draft_probs: torch.Tensor | None = None
    """[len(token_ids), V] fp32: the distribution each token was drawn from; None = one-hot."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a Proposal needs at least one token")
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.token_ids):
            raise ValueError(f"draft_probs has {self.draft_probs.shape[0]} rows for "
                             f"{len(self.token_ids)} tokens")


class Proposer(ABC):
    """Proposes draft tokens. Calls come from the engine thread only."""

    draft_cost_ratio: float = 0.0
    """Cost of one drafting forward relative to one target forward (0 for model-free drafters);
    the adaptive policy weighs it against the expected acceptance."""
    feature_spec: FeatureSpec | None = None
    """What the drafter reads from each target forward (None: nothing; see `extend`)."""

    def extend(self, chunks: Sequence[ScheduledChunk], features: StepFeatures,  # noqa: B027
               requests: Mapping[str, Request]) -> None:
        """The target's features of one step (`chunks` in plan order) and the live requests,
        after the step's tokens were applied. Only called when `feature_spec` is set."""

    @abstractmethod
    def propose(self, requests: Sequence[Request], k: Mapping[str, int]
                ) -> dict[str, Proposal]:
        """Up to `k[request_id]` tokens for each request (requests missing from `k`, or with
        k <= 0, get nothing). A request may get fewer tokens, or none. May mutate the
        proposer's own state (a draft model's KV), never the requests."""

    def on_finish(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """The request ended: drop its state."""

    def on_preempt(self, request_id: str) -> None:  # noqa: B027 - optional hook
        """The request lost its target KV and will be recomputed: state may be dropped."""

    def is_idle(self) -> bool:
        """True when the proposer holds no per-request resources (tests check this)."""
        return True
