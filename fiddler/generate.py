"""Prefill + decode loops: greedy, sampling (temperature / top-k / top-p) and beam search.

Token choice follows transformers 5.24's generate() so that results can be compared exactly:
logits are taken in fp32; sampling applies temperature, top-k, then top-p and draws with
torch.multinomial; beam search keeps the top 2*B continuations of the B*V accumulated log-probs, the
best B unfinished ones run on (their KV-cache rows reordered), and finished hypotheses are scored
sum(log p) / generated_length ** length_penalty.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .kernel_loader import load_argmax_kernels
from .step import Segment, rows


@dataclass
class GenerationOutput:
    tokens: torch.Tensor  # [n] new tokens of the returned sequence (n == max_new_tokens unless EOS stopped it)
    sequences_scores: float | None = None  # beam search: length-normalised log-prob of the returned sequence
    stats: dict = field(default_factory=dict)


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check_finite(logits: torch.Tensor, step: int):
    # The sum is finite only if every logit is (an inf or NaN carries into it): one reduction, about 30x
    # cheaper than isfinite().all() on 16 beams x 32000 logits. Finite logits whose sum overflows fall
    # through to the elementwise check.
    if bool(torch.isfinite(logits.sum())):
        return
    if not bool(torch.isfinite(logits).all()):
        bad = "NaN" if bool(torch.isnan(logits).any()) else "inf"
        raise FloatingPointError(f"{bad} in logits at generation step {step} (0 = prefill); weights or activations overflowed")


def greedy_rows(logits: torch.Tensor) -> list[int]:
    """Each row's greedy token (torch.argmax's: the first of equal maxima), or -1 for a row holding a NaN
    or an inf. Contiguous fp32 CPU logits take one C call (fiddler.kernels.argmax: the check and the choice
    in one pass); others torch's ops."""
    k = load_argmax_kernels() if logits.is_cpu and logits.dtype == torch.float32 and logits.is_contiguous() \
        and logits.dim() == 2 else None
    if k is not None:
        return k.argmax_finite(logits)
    ok = torch.isfinite(logits).all(dim=-1)
    return torch.where(ok, torch.argmax(logits, dim=-1), -1).tolist()  # one host read (one sync on a GPU)


def warp_logits(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None, min_keep: int = 1):
    """transformers' TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, in that order."""
    if temperature != 1.0:
        logits = logits / temperature
    if top_k:
        k = min(max(top_k, min_keep), logits.shape[-1])
        logits = logits.masked_fill(logits < torch.topk(logits, k)[0][..., -1, None], -float("inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, descending=False)
        remove = sorted_logits.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        remove[..., -min_keep:] = False
        logits = logits.masked_fill(remove.scatter(-1, sorted_idx, remove), -float("inf"))
    return logits


def choose_token(logits: torch.Tensor, do_sample: bool, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row of fp32 logits [B, V]: argmax, or a draw from the warped distribution
    with `generator` (transformers' order: temperature, top-k, top-p, then torch.multinomial)."""
    if not do_sample:
        return torch.argmax(logits, dim=-1)
    probs = torch.softmax(warp_logits(logits, temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_lengths(prompt_len: int, max_new_tokens: int, max_positions: int, cache_len: int):
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if prompt_len < 1:
        raise ValueError("empty prompt")
    total = prompt_len + max_new_tokens
    if prompt_len > max_positions or total > max_positions:
        raise ValueError(
            f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens = {total} exceeds the model's "
            f"context (max_position_embeddings={max_positions})"
        )
    if total > cache_len:
        raise ValueError(
            f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens = {total} exceeds the engine's KV cache "
            f"(max_seq_len={cache_len}); create the Engine with a larger max_seq_len"
        )


def generate(
    model,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    beam_width: int = 1,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | list[int] | None = None,
    length_penalty: float = 1.0,
    on_first_token: Callable[[], None] | None = None,
    step: Callable | None = None,
) -> GenerationOutput:
    """Generate from a 1-D prompt with `model` (a fiddler.model.MoETransformer): every forward is
    step(tokens, segments) (fiddler.engine.Engine.step, the one engine step; default model.forward), one
    sequence, or one per beam on KV-cache rows 0..B-1."""
    S = prompt.shape[0]
    check_lengths(S, max_new_tokens, model.cfg.max_position_embeddings, model.max_seq_len)
    if beam_width < 1:
        raise ValueError(f"beam_width must be >= 1, got {beam_width}")
    if beam_width > model.max_batch:
        raise ValueError(f"beam_width {beam_width} exceeds the engine's max_batch={model.max_batch}")
    if do_sample and beam_width > 1:
        raise ValueError("sampling with beam_width > 1 (beam sampling) is not supported")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    eos = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    prompt = prompt.to(model.device)
    run = step or model.forward
    if beam_width == 1:
        return _sample_loop(model, run, prompt, max_new_tokens, do_sample, temperature, top_k, top_p, generator, eos,
                            on_first_token)
    return _beam_loop(model, run, prompt, max_new_tokens, beam_width, eos, length_penalty, on_first_token)


def _sample_loop(model, run, prompt, n, do_sample, temperature, top_k, top_p, generator, eos, on_first_token):
    dev, S = model.device, prompt.shape[0]
    out = torch.empty(n, dtype=torch.long)
    lat = []

    def choose(logits):
        return choose_token(logits, do_sample, temperature, top_k, top_p, generator)

    def next_token(logits, step: int) -> int:
        if not do_sample:  # the finiteness check and argmax in one pass where the kernel serves the logits
            t = greedy_rows(logits)[0]  # a host read: syncs the device
            if t < 0:
                _check_finite(logits, step)  # raises, naming NaN or inf
            return t
        _check_finite(logits, step)
        return int(choose(logits))  # syncs the device

    t0 = time.perf_counter()
    logits = run(prompt, rows(1, 0, S))
    out[0] = next_token(logits, 0)
    ttft = time.perf_counter() - t0
    if on_first_token is not None:
        on_first_token()
    produced = 1
    while produced < n and not (eos and int(out[produced - 1]) in eos):
        t = time.perf_counter()
        logits = run(out[produced - 1 : produced].to(dev), [Segment(0, S + produced - 1, 1)])
        out[produced] = next_token(logits, produced)
        lat.append(time.perf_counter() - t)
        produced += 1
    return GenerationOutput(tokens=out[:produced], stats={"ttft_s": ttft, "decode_latencies_s": lat, "prompt_tokens": S})


def _beam_loop(model, run, prompt, n, B, eos, length_penalty, on_first_token):
    dev, S = model.device, prompt.shape[0]
    V = model.cfg.vocab_size
    K = max(2, 1 + len(eos)) * B  # continuations kept per step, so that B unfinished ones survive EOS
    eos_t = torch.tensor(eos, dtype=torch.long, device=dev)
    running_scores = torch.full((B,), -1e9, dtype=torch.float32, device=dev)
    running_scores[0] = 0.0  # all rows start identical: only row 0's continuations are distinct
    seqs = torch.zeros((B, n), dtype=torch.long, device=dev)
    finished: list[tuple[float, torch.Tensor]] = []  # (score, tokens), best first, at most B
    improvable = True
    lat = []
    prefix = []  # per step: generated tokens all running beams share (llama_beam_search's common prefix)

    t0 = time.perf_counter()
    # One batch-1 prefill: every first-step continuation comes from row 0, so the reorder before the
    # first decode step copies row 0's cache into all beams.
    logits = run(prompt, rows(1, 0, S))
    _check_finite(logits, 0)
    log_probs = torch.log_softmax(logits, dim=-1).expand(B, V)
    step = 0
    while True:
        ts = time.perf_counter()
        acc = (log_probs + running_scores[:, None]).reshape(-1)
        top_scores, top_idx = torch.topk(acc, K)
        src_beam, tok = top_idx // V, top_idx % V
        gen_len = step + 1
        last = gen_len == n
        stops = torch.ones(K, dtype=torch.bool, device=dev) if last else torch.isin(tok, eos_t)
        # Hypotheses finishing among the top B continuations join the finished set (if they can still matter).
        if improvable and bool(stops[:B].any()):
            for j in torch.nonzero(stops[:B]).flatten().tolist():
                hyp = seqs[src_beam[j]].clone()
                hyp[step] = tok[j]
                finished.append((float(top_scores[j] / gen_len**length_penalty), hyp[:gen_len]))
            finished.sort(key=lambda h: -h[0])  # stable: earlier hypotheses win ties, as in transformers
            del finished[B:]
        # The best B unfinished continuations run on.
        run_scores = top_scores + stops.float() * -1e9
        keep = torch.topk(run_scores, B).indices
        beam_idx = src_beam[keep]
        running_scores = run_scores[keep]
        seqs = seqs[beam_idx]
        seqs[:, step] = tok[keep]
        prefix.append(_common_prefix(seqs[:, : step + 1]))
        if step == 0:
            _sync(dev)
            ttft = time.perf_counter() - t0
            if on_first_token is not None:
                on_first_token()
        else:
            lat[-1] += time.perf_counter() - ts
        step += 1
        # transformers' early-stopping heuristic (early_stopping=False): stop when all B finished slots are
        # filled and the best running beam, normalised at the current length, cannot beat the worst of them.
        if len(finished) == B and not float(running_scores[0]) / step**length_penalty > finished[-1][0]:
            improvable = False
        if last or not improvable or bool(stops.all()):
            break
        ts = time.perf_counter()
        if step == 1:
            # Only row 0 holds the prompt. Every row takes it: the beams (all continuations of row 0) and the
            # placeholder beams a vocabulary smaller than the width leaves (scored -1e9). So from here on the
            # rows agree on the prompt, and on the tokens all beams share, and reorders skip those.
            model.cache.reorder(torch.zeros(B, dtype=torch.long, device=dev), S)
        elif not bool((beam_idx == torch.arange(B, device=dev)).all()):
            # The cache holds the prompt and the tokens of columns [0, step - 1) of the beams before this
            # step's choice, which all share their first prefix[-2] tokens: rows with the same tokens hold
            # the same entries, since each row's are computed from its own tokens alone (the kernels'
            # contract: a row's bits do not depend on the rows beside it).
            model.cache.reorder(beam_idx, S + step - 1, start=S + prefix[-2])
        logits = run(seqs[:, step - 1].contiguous(), rows(B, S + step - 1))
        _check_finite(logits, step)
        log_probs = torch.log_softmax(logits, dim=-1)
        lat.append(time.perf_counter() - ts)
    best_score, best = finished[0]
    return GenerationOutput(
        tokens=best.cpu(),
        sequences_scores=best_score,
        stats={"ttft_s": ttft, "decode_latencies_s": lat, "prompt_tokens": S, "beam_width": B,
               "common_prefix_lens": prefix},
    )


def _common_prefix(seqs: torch.Tensor) -> int:
    """How many leading generated tokens every running beam (row of `seqs`) has in common."""
    differs = (seqs != seqs[:1]).any(dim=0)
    return int(differs.int().argmax()) if bool(differs.any()) else int(seqs.shape[1])
