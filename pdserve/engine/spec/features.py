"""What a learned drafter reads from the target's forward: hidden states of every token.

EAGLE, MTP and Medusa heads draft from the target's final hidden state (after its last
norm); EAGLE-3 fuses the residual stream entering a few target layers (`aux_layers`). The
engine asks the runner for what its drafter's `FeatureSpec` names, and hands the drafter
one `StepFeatures` per forward (rank 0 only: after each layer's all-reduce every rank holds
the full hidden state, so tensor parallelism changes nothing here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FeatureSpec:
    aux_layers: tuple[int, ...] = ()
    """Target layers whose input (the residual stream) is captured; empty: none."""


@dataclass(frozen=True)
class StepFeatures:
    """Target features of one forward's flat batch, rows in the plan's token order."""

    hidden: torch.Tensor
    """[T, hidden]: the final hidden state (after the final norm) of every token."""
    aux: torch.Tensor | None
    """[T, len(aux_layers) * hidden]: the captured layer inputs, concatenated; or None."""
    query_start: tuple[int, ...]
    """Row offsets of the plan's chunks (len = chunks + 1)."""

    def rows(self, chunk_index: int, start: int, end: int) -> StepFeatures:
        """Rows [start, end) of chunk `chunk_index` (token offsets inside the chunk)."""
        base = self.query_start[chunk_index]
        aux = None if self.aux is None else self.aux[base + start:base + end]
        return StepFeatures(self.hidden[base + start:base + end], aux, (0, end - start))
