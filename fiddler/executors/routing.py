"""Grouping a layer call's (token, slot) pairs by expert, and combining expert outputs per token."""

from __future__ import annotations

import torch


def expert_counts(flat_idx: torch.Tensor, num_experts: int, layer: int) -> list[int]:
    """Routed (token, slot) pairs per expert: the one host sync per layer. Rejects bad expert ids."""
    counts = torch.bincount(flat_idx, minlength=num_experts).tolist()
    if len(counts) != num_experts:
        raise ValueError(f"expert ids must be in [0, {num_experts}), got {len(counts) - 1} (layer {layer})")
    return counts


class ExpertGroups:
    """The (token, slot) pairs of topk_idx [T, K] grouped by expert. A stable sort keeps tokens in order
    within an expert, as transformers' grouped path orders them."""

    def __init__(self, topk_idx: torch.Tensor, num_experts: int, layer: int):
        self.num_tokens, self.top_k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        self.counts = expert_counts(flat, num_experts, layer)
        self.order = torch.argsort(flat, stable=True)
        self.offsets = [0]
        for n in self.counts:
            self.offsets.append(self.offsets[-1] + n)

    def active(self) -> list[int]:
        """Experts with at least one routed token, by id."""
        return [e for e, n in enumerate(self.counts) if n]

    def pairs(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token index, slot index) of every pair routed to expert e."""
        return self._split(self.order[self.offsets[e]:self.offsets[e + 1]])

    def pairs_of(self, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs of several experts, expert after expert in the given order."""
        return self._split(torch.cat([self.order[self.offsets[e]:self.offsets[e + 1]] for e in experts]))

    def _split(self, sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sel // self.top_k, sel % self.top_k


class SlotOutputs:
    """Combination as in transformers' Mixtral experts (grouped_mm / batched_mm, the 5.x default): each
    (token, slot) output is y * w in the model dtype, then the top-k slots of a token are summed."""

    def __init__(self, x: torch.Tensor, top_k: int):
        self.slots = torch.empty(x.shape[0], top_k, x.shape[1], dtype=x.dtype, device=x.device)

    def put(self, tok: torch.Tensor, slot: torch.Tensor, y: torch.Tensor, topk_w: torch.Tensor) -> None:
        self.slots[tok, slot] = y * topk_w[tok, slot].unsqueeze(-1)

    def sum(self) -> torch.Tensor:
        return self.slots.sum(dim=1)
