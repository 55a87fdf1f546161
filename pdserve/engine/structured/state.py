"""One request's grammar matcher, following the request's output tokens.

    new ─► sync(output tokens) ─► fill bitmask rows (+ tentative drafts, rolled back) ─► ...
             └─ a token the grammar refuses: `failed` (the request cannot stay valid)

`sync` accepts only the tokens it has not seen (`num_accepted` of them so far), so the state
can be rebuilt anywhere from the spec and the tokens (a decode worker gets the prefill
worker's first token that way), and catches up after tokens appended outside a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class GrammarState:
    def __init__(self, matcher: Any) -> None:
        self._m = matcher
        self.num_accepted = 0
        self.failed = False

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing may follow."""
        return self._m.is_terminated()

    def sync(self, tokens: Sequence[int]) -> bool:
        """Accept `tokens[num_accepted:]`; False (and `failed`) if the grammar refuses one."""
        for tok in tokens[self.num_accepted:]:
            if not self.accept(tok):
                return False
        return not self.failed

    def accept(self, token: int) -> bool:
        """Accept one more token; False (and `failed`) if the grammar refuses it."""
        if self.failed or self._m.is_terminated() or not self._m.accept_token(int(token)):
            self.failed = True
            return False
        self.num_accepted += 1
        return True

    def fill(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int] = ()) -> None:
        """Rows row .. row + len(drafts) of `bitmask`: the allowed tokens now, and after each
        draft token in turn. A draft the grammar refuses is excluded by the row before it, so
        verification rejects it there; the rows after it are never read (left unmasked)."""
        self._fill_row(bitmask, row)
        advanced = 0
        for j, tok in enumerate(drafts, 1):
            if self._m.is_terminated() or not self._m.accept_token(int(tok)):
                bitmask[row + j:row + len(drafts) + 1] = -1
                break
            advanced += 1
            self._fill_row(bitmask, row + j)
        if advanced:
            self._m.rollback(advanced)

    def _fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        if self._m.is_terminated():
            bitmask[row] = -1  # a finished request is ended by the engine, never sampled
        else:
            self._m.fill_next_token_bitmask(bitmask, row)
