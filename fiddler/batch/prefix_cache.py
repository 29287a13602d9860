"""Prefix reuse: the KV entries of prompts already computed, kept so that a request whose prompt starts with
one computes only the rest (a chat's system prompt, an agent's tools, a few-shot preamble).

A prompt's entries at positions [0, n) depend only on its first n tokens, so copying a cached prefix's
entries into a new request's cache row at admission gives it what its own prefill would have computed
(within the rounding of a different chunking, as chunked prefill already has: tests/test_prefix_cache.py
shows the tokens are those of the request alone). Prefixes match in blocks of `block` tokens, found by a
chain of hashes (each block's hash covers every token before it) and confirmed token by token; at least one
prompt token is always left to compute, for its logits. Entries live on the KV cache's devices and are
evicted least recently used first to stay within `max_bytes`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_BLOCK = 16


@dataclass
class Entry:
    tokens: tuple[int, ...]  # the cached prefix (a whole number of blocks)
    kv: tuple  # KVCache.save_row of its positions
    nbytes: int
    keys: list[int] = field(default_factory=list)  # its block hashes that point at it


class PrefixCache:
    def __init__(self, cache, max_bytes: int, block: int = DEFAULT_BLOCK):
        if max_bytes < 0 or block < 1:
            raise ValueError(f"prefix cache: max_bytes must be >= 0 and block >= 1, got {max_bytes}, {block}")
        self.cache, self.max_bytes, self.block = cache, max_bytes, block
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # id -> entry, least recently used first
        self.index: dict[int, list[int]] = {}  # block-chain hash -> ids of the entries holding that prefix
        self.nbytes = 0
        self._next = 0

    def _hashes(self, tokens) -> list[int]:
        """hashes[k]: the first (k + 1) blocks of tokens (whole blocks only)."""
        out, h = [], 0
        for k in range(len(tokens) // self.block):
            h = hash((h, tuple(tokens[k * self.block : (k + 1) * self.block])))
            out.append(h)
        return out

    def lookup(self, tokens: list[int]) -> tuple[Entry | None, int]:
        """The cached entry sharing the longest whole-block prefix with `tokens` that leaves at least one token
        to compute, and that prefix's length (0 when none)."""
        usable = self._hashes(tokens[: len(tokens) - 1])
        for k in range(len(usable) - 1, -1, -1):
            n = (k + 1) * self.block
            for eid in reversed(self.index.get(usable[k], ())):  # the most recently stored first
                e = self.entries[eid]
                if e.tokens[:n] == tuple(tokens[:n]):  # a hash collision must not reuse another prompt's entries
                    self.entries.move_to_end(eid)
                    return e, n
        return None, 0

    def load(self, entry: Entry, length: int, row: int) -> None:
        self.cache.load_row(row, entry.kv, length)

    def store(self, tokens: list[int], row: int) -> None:
        """Keep the whole blocks of a prompt just computed in cache row `row` (unless an entry already holds
        them), evicting least recently used entries to fit."""
        hashes = self._hashes(tokens)
        if not hashes:
            return
        n = len(hashes) * self.block
        for eid in self.index.get(hashes[-1], ()):
            if self.entries[eid].tokens[:n] == tuple(tokens[:n]):
                self.entries.move_to_end(eid)
                return
        kv = self.cache.save_row(row, n)
        size = sum(t.numel() * t.element_size() for t in kv)
        if size > self.max_bytes:
            return
        while self.nbytes + size > self.max_bytes:
            self._evict()
        e = Entry(tuple(tokens[:n]), kv, size, hashes)
        eid, self._next = self._next, self._next + 1
        self.entries[eid] = e
        self.nbytes += size
        for h in hashes:
            self.index.setdefault(h, []).append(eid)

    def _evict(self) -> None:
        eid, e = self.entries.popitem(last=False)
        self.nbytes -= e.nbytes
        for h in e.keys:
            ids = self.index[h]
            ids.remove(eid)
            if not ids:
                del self.index[h]
