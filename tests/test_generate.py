"""Generation loops on a scripted toy model: beam search against exhaustive search, KV-cache reordering,
token counts, callbacks, sampling warpers against transformers', error paths."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from fiddler.generate import _check_finite, check_lengths, generate, warp_logits


class HistoryCache:
    """Stands in for the KV cache: each row holds the tokens that row has seen, so a wrong reorder
    changes the toy model's next logits."""

    def __init__(self, rows: int, length: int):
        self.hist = torch.full((rows, length), -1, dtype=torch.long)
        self.reorders = 0
        self.starts: list[int] = []

    def reorder(self, beam_idx, length, start=0):
        # Copies only [start, length), as the KV cache does, and checks that this equals copying the whole
        # filled prefix: a `start` past what every row shares would leave a row with another beam's tokens.
        # Rows never filled (-1: the placeholder beams of the first steps, scored -1e9, when the vocabulary
        # has fewer continuations than there are beams) hold nothing to keep.
        self.reorders += 1
        self.starts.append(start)
        B = beam_idx.shape[0]
        whole = self.hist[beam_idx, :length]
        self.hist[:B, start:length] = self.hist[beam_idx, start:length]
        real = (whole >= 0).all(dim=1)
        assert torch.equal(self.hist[:B, :length][real], whole[real]), f"reorder from {start} differs from a whole copy"


class ToyModel:
    """Logits are a fixed pseudo-random function of the whole history seen by the row (through its cache)."""

    def __init__(self, vocab=5, max_seq=64, max_batch=32, nan_at_step=None, seed=0):
        self.cfg = SimpleNamespace(vocab_size=vocab, max_position_embeddings=max_seq)
        self.max_seq_len, self.max_batch, self.device = max_seq, max_batch, torch.device("cpu")
        self.cache = HistoryCache(max_batch, max_seq)
        self.vocab, self.seed, self.nan_at_step, self.calls = vocab, seed, nan_at_step, 0

    def logits_for(self, history: list[int]) -> torch.Tensor:
        g = torch.Generator().manual_seed(hash((self.seed, tuple(history))) % (2**31))
        return torch.randn(self.vocab, generator=g) * 3

    def forward(self, tokens, segments):  # MoETransformer.forward's contract: segments' tokens back to back
        out, r = [], 0
        for s in segments:
            self.cache.hist[s.slot, s.start : s.start + s.length] = tokens[r : r + s.length]
            out.append(self.logits_for(self.cache.hist[s.slot, : s.start + s.length].tolist()))
            r += s.length
        out = torch.stack(out)
        if self.nan_at_step is not None and self.calls == self.nan_at_step:
            out[0, 1] = float("nan")
        self.calls += 1
        return out


def _seq_logprob(model: ToyModel, prompt: list[int], new: list[int]) -> float:
    total = 0.0
    for i, t in enumerate(new):
        total += float(torch.log_softmax(model.logits_for(prompt + new[:i]), -1)[t])
    return total


@pytest.mark.parametrize("n", [1, 2, 3])
def test_beam_search_is_exhaustive_when_beams_cover_all_prefixes(n):
    """With beam_width >= vocab^(n-1) no prefix is ever pruned, so beam search must return the global
    argmax of the summed log-prob, scored as sum / n (length_penalty=1)."""
    model, prompt = ToyModel(vocab=4, seed=n), [1, 2, 3]
    best = max(itertools.product(range(4), repeat=n), key=lambda s: _seq_logprob(model, prompt, list(s)))
    out = generate(model, torch.tensor(prompt), n, beam_width=4 ** max(n - 1, 1))
    assert out.tokens.tolist() == list(best)
    assert out.sequences_scores == pytest.approx(_seq_logprob(model, prompt, list(best)) / n, abs=1e-5)


@pytest.mark.parametrize("beam_width", [2, 3, 5])
def test_beam_score_is_the_returned_sequence_logprob(beam_width):
    """The reported score must be the true log-prob of the returned tokens (recomputed without any cache):
    a wrong KV-cache reorder makes later logits come from another beam's history and breaks this."""
    model, prompt = ToyModel(vocab=7, seed=11), [4, 4]
    out = generate(model, torch.tensor(prompt), 12, beam_width=beam_width)
    assert len(out.tokens) == 12
    assert out.sequences_scores == pytest.approx(_seq_logprob(model, prompt, out.tokens.tolist()) / 12, abs=1e-5)
    assert model.cache.reorders > 0
    # and it beats greedy on that objective
    greedy = generate(ToyModel(vocab=7, seed=11), torch.tensor(prompt), 12).tokens.tolist()
    assert out.sequences_scores >= _seq_logprob(model, prompt, greedy) / 12 - 1e-6


def test_greedy_is_argmax_and_generates_exactly_max_new_tokens():
    model, prompt = ToyModel(vocab=9, seed=3), [0, 1]
    out = generate(model, torch.tensor(prompt), 20)
    hist = list(prompt)
    for t in out.tokens.tolist():
        assert t == int(model.logits_for(hist).argmax())
        hist.append(t)
    assert len(out.tokens) == 20 and len(out.stats["decode_latencies_s"]) == 19
    assert out.stats["ttft_s"] > 0 and all(x > 0 for x in out.stats["decode_latencies_s"])


def test_eos_ignored_unless_given():
    model, prompt = ToyModel(vocab=9, seed=3), [0, 1]
    full = generate(model, torch.tensor(prompt), 20).tokens.tolist()
    eos = full[4]
    assert len(generate(ToyModel(vocab=9, seed=3), torch.tensor(prompt), 20).tokens) == 20
    stopped = generate(ToyModel(vocab=9, seed=3), torch.tensor(prompt), 20, eos_token_id=eos).tokens.tolist()
    assert stopped == full[: full.index(eos) + 1]


@pytest.mark.parametrize("beam_width", [1, 3])
def test_on_first_token_called_once_before_decoding(beam_width):
    model = ToyModel(vocab=6)
    calls = []
    generate(model, torch.tensor([1, 2, 3]), 5, beam_width=beam_width, on_first_token=lambda: calls.append(model.calls))
    assert calls == [1]  # exactly once, after the prefill forward and before any decode forward
    assert model.calls == 5


def test_sampling_is_seeded_and_respects_top_k():
    prompt = torch.tensor([1, 2])

    def run(seed, **kw):
        g = torch.Generator().manual_seed(seed)
        return generate(ToyModel(vocab=50, seed=1), prompt, 30, do_sample=True, generator=g, **kw).tokens.tolist()

    assert run(7) == run(7)
    assert run(7) != run(8)
    model = ToyModel(vocab=50, seed=1)
    toks = run(3, top_k=1)  # top-k 1 is greedy
    assert toks == generate(model, prompt, 30).tokens.tolist()


def test_warpers_match_transformers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 200, generator=g) * 4
    for t, k, p in [(0.7, 20, 0.9), (1.3, None, 0.5), (1.0, 5, None), (0.5, 150, 0.99)]:
        ref = logits.clone()
        if t != 1.0:
            ref = TemperatureLogitsWarper(t)(None, ref)
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p is not None:
            ref = TopPLogitsWarper(p)(None, ref)
        got = warp_logits(logits, t, k, p)
        assert torch.equal(torch.isinf(got), torch.isinf(ref))
        torch.testing.assert_close(got[~torch.isinf(got)], ref[~torch.isinf(ref)], rtol=0, atol=0)


def test_nan_logits_raise_with_step_number():
    with pytest.raises(FloatingPointError, match="step 3"):
        generate(ToyModel(nan_at_step=3), torch.tensor([1, 2]), 10)
    with pytest.raises(FloatingPointError, match="step 0"):
        generate(ToyModel(nan_at_step=0), torch.tensor([1, 2]), 10, beam_width=2)


@pytest.mark.parametrize("bad, name", [(float("nan"), "NaN"), (float("inf"), "inf"), (-float("inf"), "inf"), (None, None)])
def test_the_finite_check_is_elementwise(bad, name):
    # logits whose sum overflows are finite (no error); one inf, -inf or NaN among them is caught, also
    # beside an inf of the other sign (whose sum is NaN)
    logits = torch.full((4, 100), 3e38)
    if bad is None:
        _check_finite(logits, 1)
        return
    logits[2, 7] = bad
    with pytest.raises(FloatingPointError, match=f"{name} in logits at generation step 5"):
        _check_finite(logits, 5)
    logits[0, 0] = -bad
    with pytest.raises(FloatingPointError, match="step 5"):
        _check_finite(logits, 5)


def test_length_checks_name_both_numbers():
    with pytest.raises(ValueError, match=r"100 tokens \+ 30 new tokens = 130 .*max_position_embeddings=120"):
        check_lengths(100, 30, 120, 4096)
    with pytest.raises(ValueError, match=r"200 tokens .*max_position_embeddings=120"):
        check_lengths(200, 1, 120, 4096)
    with pytest.raises(ValueError, match=r"max_seq_len=64"):
        check_lengths(60, 10, 1000, 64)
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        generate(ToyModel(max_seq=64), torch.arange(60) % 5, 5)
    with pytest.raises(ValueError, match="max_batch"):
        generate(ToyModel(max_batch=2), torch.tensor([1]), 3, beam_width=4)
    with pytest.raises(ValueError, match="beam sampling"):
        generate(ToyModel(), torch.tensor([1]), 3, beam_width=2, do_sample=True)
    check_lengths(100, 20, 120, 120)  # exactly at the limit is fine
    assert math.isfinite(generate(ToyModel(max_seq=8), torch.tensor([1, 2, 3]), 5).stats["ttft_s"])


def test_common_prefix_of_rows():
    from fiddler.generate import _common_prefix

    assert _common_prefix(torch.tensor([[1, 2, 3], [1, 2, 4]])) == 2
    assert _common_prefix(torch.tensor([[1, 2, 3], [1, 2, 3]])) == 3
    assert _common_prefix(torch.tensor([[5, 2], [1, 2], [5, 2]])) == 0


@pytest.mark.parametrize("beam_width", [2, 4])
def test_beam_stats_record_the_common_prefix(beam_width):
    """common_prefix_lens[i]: the generated tokens every running beam shares after step i (what
    llama_beam_search decodes once and drops from each beam's next call); it can only grow (beams extend
    beams) and never exceeds the tokens generated."""
    model, prompt = ToyModel(vocab=3, seed=5), [1, 2]
    out = generate(model, torch.tensor(prompt), 10, beam_width=beam_width)
    lens = out.stats["common_prefix_lens"]
    assert 1 <= len(lens) <= 10
    assert all(0 <= p <= i + 1 for i, p in enumerate(lens))
    assert lens == sorted(lens)


@pytest.mark.parametrize("vocab,seed,beam_width", [(3, 5, 2), (3, 5, 4), (2, 1, 3), (4, 7, 2)])
def test_the_reorder_skips_only_what_every_beam_shares(vocab, seed, beam_width):
    """After the first step the cache reorder starts past the prompt and the tokens all beams share; the
    returned score is still the true log-prob of the returned tokens (a row left with another beam's
    history would change it), and the reorders did skip shared tokens."""
    model, prompt = ToyModel(vocab=vocab, seed=seed), [1, 0, 1]
    out = generate(model, torch.tensor(prompt), 14, beam_width=beam_width)
    assert out.sequences_scores == pytest.approx(_seq_logprob(model, prompt, out.tokens.tolist()) / len(out.tokens),
                                                 abs=1e-5)
    starts = model.cache.starts
    assert starts[0] == 0 and all(s >= len(prompt) for s in starts[1:])
    assert any(s > len(prompt) for s in starts[1:])
