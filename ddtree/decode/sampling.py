"""Token choice at tree nodes: greedy, or temperature / top-k / top-p sampling.

Every decoder picks the target's token at a node with `choose`, so `ar`, `dflash` and `ddtree`
share one rule. Speculative exactness then comes from the walk (ddtree.decode.round): the token
sampled at a node is followed into the child that holds it, else it becomes the bonus.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.errors import DDTreeError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise DDTreeError(f"--temperature {self.temperature} is negative: use 0 for greedy or a positive value")
        if not 0 < self.top_p <= 1:
            raise DDTreeError(f"--top-p {self.top_p} is outside (0, 1]: use e.g. 0.95, or 1 to disable")
        if self.top_k < 0:
            raise DDTreeError(f"--top-k {self.top_k} is negative: use 0 to disable")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def temperature_or_none(self) -> float | None:
        """The temperature the drafter's top-k divides by (None when greedy: plain log-probs)."""
        return None if self.greedy else self.temperature


def processed_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities after temperature, top-k and top-p (fp32)."""
    scores = logits.float() / p.temperature
    if 0 < p.top_k < scores.shape[-1]:
        kth = scores.topk(p.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if p.top_p < 1.0:
        sp, order = probs.sort(dim=-1, descending=True)
        keep = (sp.cumsum(-1) - sp) < p.top_p  # keep the smallest prefix reaching top_p
        sp = sp * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def choose(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [N, V] -> one token per row [N] (long), sampled independently per row."""
    if p.greedy:
        return logits.argmax(-1)
    probs = processed_probs(logits, p)
    # Exponential-race sampling (argmax of p / Exp(1)): one kernel, no host sync, and exact.
    e = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / e).argmax(-1)
