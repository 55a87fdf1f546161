"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocab."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.layers.linear import LinearMethod
from pdserve.engine.parallel import SINGLE, ParallelContext


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype = torch.float32,
                 tp: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // tp.size)  # padded so every rank holds the same count
        self.start = tp.rank * self.shard
        self.weight = nn.Parameter(torch.zeros(self.shard, dim, dtype=dtype), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        rows = loaded[self.start:self.start + self.shard]
        param.data[: rows.shape[0]].copy_(rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out = out.masked_fill(mask.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to full-vocabulary logits (gathered across ranks).

    The product goes through `self.method` (a `LinearMethod`, like the linear layers'), so a
    quantisation scheme can give the head its own copy of the weight (e.g. a 4-bit one) while
    a tied embedding keeps the full-precision rows it looks tokens up in.
    """

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype = torch.float32,
                 tp: ParallelContext = SINGLE) -> None:
        super().__init__(vocab_size, dim, dtype, tp)
        self.method = LinearMethod()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = self.method.apply(self, hidden, None)
        return self.tp.all_gather_last_dim(local)[..., : self.vocab_size]
