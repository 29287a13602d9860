"""Workloads: the product of their lists, and the prompts every system receives.

Prompts are token ids, generated once per (seed, input length) so that every system sees exactly
the same ids; systems never re-tokenise.
"""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Point:
    """One measured configuration of a workload."""

    input_len: int
    output_len: int
    beam_width: int
    concurrency: int = 0  # concurrent streams of a serving workload; 0: not one
    rate: float = 0.0  # Poisson arrivals of a serving workload, requests/s; 0: not a rate level

    def key(self) -> str:
        tail = f"_c{self.concurrency}" if self.concurrency else ""
        tail += f"_r{self.rate:g}" if self.rate else ""
        return f"in{self.input_len}_out{self.output_len}_beam{self.beam_width}{tail}"

    def as_dict(self) -> dict:
        d = asdict(self)
        if not self.concurrency:  # the points (and hashes) of the other workloads stay as they were
            del d["concurrency"]
        if not self.rate:
            del d["rate"]
        return d


def expand(workload) -> list[Point]:
    """Every combination of input length x output length x beam width (a serving workload: x concurrency, then
    x rate, beam 1), in list order."""
    if getattr(workload, "concurrency", None) or getattr(workload, "rates", None):
        lens = list(itertools.product(workload.input_lens, workload.output_lens))
        return ([Point(i, o, 1, c) for (i, o), c in itertools.product(lens, getattr(workload, "concurrency", None) or [])]
                + [Point(i, o, 1, rate=r) for (i, o), r in itertools.product(lens, getattr(workload, "rates", None) or [])])
    return [Point(i, o, b) for i, o, b in
            itertools.product(workload.input_lens, workload.output_lens, workload.beam_widths)]


# Ids below this are reserved for special tokens (<unk>, <s>, </s>) in the SentencePiece vocab.
_FIRST_ORDINARY_ID = 3


def synthetic_prompt(seed: int, input_len: int, vocab_size: int) -> list[int]:
    """Seeded uniform token ids, starting with BOS (id 1) like a tokenised prompt."""
    rng = np.random.default_rng([seed, input_len])
    body = rng.integers(_FIRST_ORDINARY_ID, vocab_size, size=input_len - 1).tolist()
    return [1] + body


def file_prompt(path: str, input_len: int, model_path: str) -> list[int]:
    """The text file's token ids (by the model's own tokenizer), repeated to `input_len`.
    (runners.preflight has checked at start that the file is non-empty text.)"""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = tokenizer.encode(Path(path).expanduser().read_text(encoding="utf-8"))
    if not set(ids) - set(tokenizer.all_special_ids):  # e.g. only the BOS the tokenizer adds
        raise ValueError(f"workload.prompt_file={path!r} has no tokens besides special ones")
    return (ids * (input_len // len(ids) + 1))[:input_len]


def prompt_for(workload, point: Point, vocab_size: int, model_path: str) -> list[int]:
    if workload.prompt_file:
        return file_prompt(workload.prompt_file, point.input_len, model_path)
    return synthetic_prompt(workload.seed, point.input_len, vocab_size)
