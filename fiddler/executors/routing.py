"""Grouping a layer call's (token, slot) pairs by expert, and combining expert outputs per token."""

from __future__ import annotations

import torch


def check_expert_id(e: int, num_experts: int, layer: int) -> None:
    """The one rule for a routed expert id: in [0, num_experts)."""
    if not 0 <= e < num_experts:
        raise ValueError(f"expert ids must be in [0, {num_experts}), got {e} (layer {layer})")


def expert_counts(flat_idx: torch.Tensor, num_experts: int, layer: int) -> list[int]:
    """Routed (token, slot) pairs per expert: the one host sync per layer. Rejects bad expert ids."""
    if flat_idx.device.type == "cpu":  # bincount: 6x cheaper than the ops below on a CPU (9 against 55 us)
        counts = torch.bincount(flat_idx, minlength=num_experts).tolist()
        check_expert_id(len(counts) - 1, num_experts, layer)  # it grows past num_experts for an id beyond it
        return counts
    return fixed_size_counts(flat_idx, num_experts, layer)


def fixed_size_counts(flat_idx: torch.Tensor, num_experts: int, layer: int) -> list[int]:
    """expert_counts on a GPU, where bincount syncs once more to size its output: counted into a fixed-size
    tensor (one sync, its .tolist()), bad ids in an extra bucket."""
    bad = (flat_idx < 0) | (flat_idx >= num_experts)
    slot = torch.where(bad, num_experts, flat_idx)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat_idx.device)
    counts = counts.scatter_add_(0, slot, torch.ones_like(slot)).tolist()
    if counts[-1]:
        check_expert_id(int(flat_idx[bad][0]), num_experts, layer)
    return counts[:-1]


def row_counts(ids: list[int], num_experts: int, layer: int) -> list[int]:
    """expert_counts of one token's ids already on the host (the decode row: no tensor op, no sync)."""
    counts = [0] * num_experts
    for e in ids:
        check_expert_id(e, num_experts, layer)
        counts[e] += 1
    return counts


class ExpertGroups:
    """The (token, slot) pairs of topk_idx [T, K] grouped by expert. A stable sort keeps tokens in order
    within an expert, as transformers' grouped path orders them. The sort and the token of every pair are
    computed once for the layer call, so an expert's pairs are views (no launch per expert on a GPU)."""

    def __init__(self, topk_idx: torch.Tensor, num_experts: int, layer: int, counts: list[int] | None = None):
        """counts: expert_counts of topk_idx if the caller has them already (checked there)."""
        self.num_tokens, self.top_k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        self.counts = counts if counts is not None else expert_counts(flat, num_experts, layer)
        self.order = torch.argsort(flat, stable=True)  # flat pair index (token * top_k + slot), by expert
        self.tok = self.order // self.top_k
        self._slot: torch.Tensor | None = None
        self.offsets = [0]
        for n in self.counts:
            self.offsets.append(self.offsets[-1] + n)

    def tokens(self, e: int) -> torch.Tensor:
        """Token index of every pair routed to expert e (a view)."""
        return self.tok[self.offsets[e]:self.offsets[e + 1]]

    def flat(self, e: int) -> torch.Tensor:
        """Flat pair index (token * top_k + slot) of every pair routed to expert e (a view): SlotOutputs.put_flat."""
        return self.order[self.offsets[e]:self.offsets[e + 1]]

    def flat_of(self, experts: list[int]) -> torch.Tensor:
        """flat() of several experts, expert after expert in the given order."""
        return torch.cat([self.flat(e) for e in experts]) if len(experts) != 1 else self.flat(experts[0])

    def active(self) -> list[int]:
        """Experts with at least one routed token, by id."""
        return [e for e, n in enumerate(self.counts) if n]

    def pairs(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(token index, slot index) of every pair routed to expert e."""
        if self._slot is None:
            self._slot = self.order % self.top_k
        a, b = self.offsets[e], self.offsets[e + 1]
        return self.tok[a:b], self._slot[a:b]

    def pairs_of(self, experts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs of several experts, expert after expert in the given order."""
        tok, slot = zip(*(self.pairs(e) for e in experts))
        return torch.cat(tok), torch.cat(slot)

    def tokens_of(self, experts: list[int]) -> torch.Tensor:
        """tokens() of several experts, expert after expert in the given order."""
        return torch.cat([self.tokens(e) for e in experts]) if len(experts) != 1 else self.tokens(experts[0])


class Scratch:
    """Reusable buffers for a layer call's temporary [rows, hidden] tensors, one per name, grown as needed.

    torch's index_select into a new tensor ran ~6x slower than into an existing one (a 4096 x 2048 bf16
    gather, one thread, Intel Xeon family 6 model 167: 7.6 against 1.2 ms); a 2048-token prefill of
    small_mixtral does two such gathers per layer. A buffer is reused by the next call that takes the same
    name, so nothing taken here may outlive the layer call that took it."""

    def __init__(self):
        self._bufs: dict[tuple, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        key = (name, dtype, torch.device(device))
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n:
            buf = self._bufs[key] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n].view(shape)

    def gather(self, name: str, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """x.index_select(0, index) into the buffer `name`."""
        out = self.take(name, (index.numel(), *x.shape[1:]), x.dtype, x.device)
        return torch.index_select(x, 0, index, out=out)


class SlotOutputs:
    """Combination as in transformers' Mixtral experts (grouped_mm / batched_mm, the 5.x default): each
    (token, slot) output is y * w in the model dtype, then the top-k slots of a token are summed.

    The outputs are kept as they come (expert after expert) and put in (token, slot) order once, by a
    gather at the sum, where they are weighted in place (the same elementwise product, so the same bits)
    and summed. For a 512-token prefill layer of small_mixtral on one thread of an AMD EPYC Zen 5, the
    scatter into [T, K, H] and the sum over K took 3.1 ms, the gather and the sum below 0.9 ms. With a
    `scratch`, the gather writes into a reused buffer (Scratch)."""

    def __init__(self, x: torch.Tensor, top_k: int, scratch: Scratch | None = None, gpu_side: bool = False):
        """gpu_side: the fewest ops (launches) rather than the fastest CPU ops, the same bits: rows put in
        (token, slot) order by one scatter, not a gather by the inverse order (3 ops, 2.5-5x faster on a CPU:
        1024-4096 rows of 2048 bf16, one thread, AMD EPYC Zen 4), and summed by one op (see
        weighted_slot_sum)."""
        self.num_tokens, self.top_k = x.shape[0], top_k
        self._scratch = scratch
        self._gpu_side = gpu_side
        self._pairs: list[torch.Tensor] = []  # token * top_k + slot of each row of _rows
        self._rows: list[torch.Tensor] = []
        self._w: torch.Tensor | None = None

    def put(self, tok: torch.Tensor, slot: torch.Tensor, y: torch.Tensor, topk_w: torch.Tensor) -> None:
        """The outputs y of the (token, slot) pairs (tok, slot), unweighted; topk_w [T, K] is the layer's."""
        self.put_flat(tok * self.top_k + slot, y, topk_w)

    def put_flat(self, flat: torch.Tensor, y: torch.Tensor, topk_w: torch.Tensor) -> None:
        """put() of the pairs given by their flat index token * top_k + slot (ExpertGroups.flat)."""
        self._pairs.append(flat)
        self._rows.append(y)
        self._w = topk_w

    def sum(self) -> torch.Tensor:
        T, K = self.num_tokens, self.top_k
        pairs = self._pairs[0] if len(self._pairs) == 1 else torch.cat(self._pairs)
        rows = self._rows[0] if len(self._rows) == 1 else torch.cat(self._rows)
        if pairs.numel() != T * K:
            raise RuntimeError(f"combine: {pairs.numel()} (token, slot) outputs for {T} tokens x {K} slots")
        # rows into (token, slot) order: the same rows moved either way
        if self._gpu_side:
            shape = (T * K, *rows.shape[1:])
            slots = self._scratch.take("slots", shape, rows.dtype, rows.device) if self._scratch else \
                rows.new_empty(shape)
            slots.index_copy_(0, pairs, rows)
        else:
            order = torch.empty_like(pairs)
            order[pairs] = torch.arange(pairs.numel(), device=pairs.device)
            slots = self._scratch.gather("slots", rows, order) if self._scratch else rows.index_select(0, order)
        return weighted_slot_sum(slots, self._w, T, K, self._gpu_side)


def weighted_slot_sum(slots: torch.Tensor, topk_w: torch.Tensor, T: int, K: int, one_op_sum: bool) -> torch.Tensor:
    """sum over k of slots[t * K + k] * topk_w[t, k], as transformers combines: each product in the model dtype,
    then the K products summed (in place in `slots`). one_op_sum: one op for the sum (a GPU side)."""
    w = topk_w.reshape(T * K, 1)
    if w.device != slots.device:
        w = w.to(slots.device)
    if torch.result_type(slots, w) == slots.dtype:
        slots.mul_(w)
    else:  # y * w promotes (e.g. fp32 weights of bf16 outputs): the product keeps the wider type
        slots = slots * w
    slots = slots.view(T, K, -1)
    if K == 2 and not one_op_sum:
        # sum(dim=1) accumulates in fp32 from +0 and rounds once: for two slots that is one fp32 add
        # rounded once, with -0 + -0 made +0 (the "+ 0.0"), the same bits ~15x faster on a CPU
        return torch.add(slots[:, 0], slots[:, 1]).add_(0.0)
    return slots.sum(dim=1)
