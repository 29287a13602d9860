"""The engine step's unit of work. A step advances a set of sequences at once: each contributes a prompt
chunk or one decode token on its own KV-cache row, at its own positions (`Segment`). Single requests,
beams (one request's sequences, their rows reordered between steps), continuous batching and chunked
prefill are all lists of segments for the same step (fiddler.engine.Engine.step)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """`length` tokens at positions start.. of KV-cache row `slot`; `logits`: the step returns the logits
    of its last position (it emits a token)."""

    slot: int
    start: int
    length: int
    logits: bool = True


def rows(n: int, start: int, length: int = 1) -> list[Segment]:
    """Segments of n sequences on rows 0..n-1, each with `length` tokens at start..: a prompt (n = 1) or a
    decode step of beams."""
    return [Segment(b, start, length) for b in range(n)]


# The paths a step can take (MoETransformer.forward): every decode row through the fused CPU kernels, the
# GPU side's decode with its dense part as CUDA graphs (fiddler.decode_graph), or the general ops (prefill,
# chunks, fp32, a GPU side).
PATHS = ("fused_decode", "graph_decode", "general")
