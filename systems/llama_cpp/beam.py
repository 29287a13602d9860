"""Beam search on llama.cpp's own sequence / KV-cache API (neither llama.h nor llama-cpp-python has one).

One KV-cache sequence id per beam slot. Each step decodes one batch holding the last token of every
live beam (token j -> sequence j), reads every beam's logits, and keeps the ``width`` best
(beam, token) continuations by cumulative log-probability. When a beam is chosen more than once,
its first child keeps the parent's slot and each other child gets a slot whose beam died:
``seq_rm(slot)`` then ``seq_cp(parent, slot)`` (metadata-only in llama.cpp's unified KV cache).
All copies read parents that are not overwritten in the same step, so the order does not matter.

Scoring follows transformers' ``generate(num_beams=..., length_penalty=1.0)`` with end-of-sequence
disabled (no beam ever finishes early): log-probs are ``log_softmax`` of the float32 logits, the
first step expands only the prompt's distribution, and the returned sequence is the best
cumulative log-probability; its score is that sum divided by the number of generated tokens
(transformers' ``sequences_scores``).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .engine import LlamaCppModel


@dataclass
class BeamResult:
    tokens: list[int]  # best sequence's new tokens
    logprob: float  # its cumulative log-probability
    score: float  # logprob / len(tokens) ** length_penalty
    all_tokens: list[list[int]]  # every final beam, best first
    all_logprobs: list[float]
    decoded_tokens: int  # tokens pushed through llama_decode (prompt + all beams)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32, copy=False)
    m = x.max(axis=-1, keepdims=True)
    z = x - m
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True, dtype=np.float32))


def top_k_flat(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of a 1-D array, best first (ties: lower index first)."""
    k = min(k, scores.size)
    part = np.argpartition(-scores, k - 1)[:k]
    order = np.lexsort((part, -scores[part]))
    return part[order]


def beam_search(model: LlamaCppModel, ids: Sequence[int], max_new_tokens: int, width: int,
                on_first_token: Callable[[], None] | None = None, length_penalty: float = 1.0) -> BeamResult:
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if width < 1:
        raise ValueError("beam width must be >= 1")
    if model.n_seq_max < width:
        raise ValueError(f"context has {model.n_seq_max} sequences, beam width {width} needs as many")
    model.clear()
    prompt_len = len(ids)
    first = log_softmax(model.prefill(ids, seq=0))
    decoded = prompt_len

    # step 0: the prompt's distribution alone (transformers starts beams 1.. at -1e9)
    top = top_k_flat(first, width)
    beams = [[int(t)] for t in top]
    scores = first[top].astype(np.float64)
    if on_first_token is not None:
        on_first_token()
    for slot in range(1, len(beams)):
        model.seq_cp(0, slot)
    n = len(beams)

    for step in range(1, max_new_tokens):
        pos = prompt_len + step - 1
        model.decode([b[-1] for b in beams], [pos] * n, list(range(n)), [True] * n)
        decoded += n
        logp = np.stack([model.logits_view(j) for j in range(n)])
        logp = log_softmax(logp)
        vocab = logp.shape[1]
        # float32 like transformers' running_beam_scores
        total = (logp + scores.astype(np.float32)[:, None]).reshape(-1)
        top = top_k_flat(total, width)
        parents = (top // vocab).tolist()
        tokens = (top % vocab).tolist()
        new_scores = total[top].astype(np.float64)

        # slot assignment: the first child of a parent stays in the parent's slot
        taken: set[int] = set()
        slot_of = [-1] * len(top)
        for c, p in enumerate(parents):
            if p not in taken:
                taken.add(p)
                slot_of[c] = p
        free = [s for s in range(n) if s not in taken]
        for c, p in enumerate(parents):
            if slot_of[c] < 0:
                s = free.pop(0)
                model.seq_rm(s)
                model.seq_cp(p, s)
                slot_of[c] = s
        new_beams: list[list[int]] = [[] for _ in range(n)]
        new_sc = np.zeros(n, dtype=np.float64)
        for c, (p, t) in enumerate(zip(parents, tokens)):
            s = slot_of[c]
            new_beams[s] = beams[p] + [int(t)]
            new_sc[s] = new_scores[c]
        beams, scores = new_beams, new_sc

    order = sorted(range(n), key=lambda j: -scores[j])
    best = order[0]
    length = len(beams[best])
    return BeamResult(
        tokens=beams[best],
        logprob=float(scores[best]),
        score=float(scores[best] / (length ** length_penalty)),
        all_tokens=[beams[j] for j in order],
        all_logprobs=[float(scores[j]) for j in order],
        decoded_tokens=decoded,
    )
