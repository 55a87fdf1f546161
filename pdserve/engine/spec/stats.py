"""Counters of speculative decoding, reported through `LLMEngine.stats()`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecStats:
    verify_steps: int = 0
    """Request-steps that verified at least one draft token."""
    drafts_proposed: int = 0
    drafts_accepted: int = 0
    steps_without_drafts: int = 0
    """Request-steps in decode that ran without drafts (policy said k = 0, or no proposal)."""

    def record(self, proposed: int, accepted: int) -> None:
        self.verify_steps += 1
        self.drafts_proposed += proposed
        self.drafts_accepted += accepted

    def as_dict(self) -> dict[str, float]:
        """`spec_mean_accepted_length` is tokens emitted per verifying request-step: accepted
        drafts plus the correction/bonus token (1.0 = speculation gained nothing)."""
        steps = self.verify_steps
        return {
            "spec_verify_steps": steps,
            "spec_steps_without_drafts": self.steps_without_drafts,
            "spec_drafts_proposed": self.drafts_proposed,
            "spec_drafts_accepted": self.drafts_accepted,
            "spec_acceptance_rate": (self.drafts_accepted / self.drafts_proposed
                                     if self.drafts_proposed else 0.0),
            "spec_mean_accepted_length": (1.0 + self.drafts_accepted / steps) if steps else 0.0,
        }
