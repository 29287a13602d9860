"""The batch engine (fiddler.batch): a request's tokens are the ones it gets alone, whatever else runs.

fp32, on the harness's generated Mixtral, Qwen3-MoE and DeepSeek-V2 (conf/model/tiny_*.yaml), for every
executor variant of the numerics suites (both planners, 0/50/100% resident on the emulated GPU): 16
requests of 1-200 prompt and 1-64 output tokens, submitted at once and staggered, give the greedy tokens
of Engine.generate alone; a seeded sampled request gives its alone draw; cancelling one leaves the others'
tokens unchanged. Plus the scheduler's rules, admission, step stats and the loop thread.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch

from fiddler import Engine
from fiddler.batch import BatchEngine, QueueFull, SamplingParams
from fiddler.batch.scheduler import Scheduler
from fiddler.batch.request import Request
from runners.models import synthetic_model
from tests.models import EXPECTED_KINDS, VARIANTS

MODELS = ["tiny_mixtral", "tiny_qwen3_moe", "tiny_deepseek_v2"]
SLOTS, SEQ = 16, 320
PROMPT_LENS = [1, 200, 17, 64, 3, 128, 5, 90, 33, 2, 150, 7, 45, 12, 99, 60]
OUTPUT_LENS = [1, 64, 10, 30, 64, 5, 20, 1, 40, 64, 8, 16, 3, 50, 25, 12]


@functools.cache
def engine(model: str, variant: str) -> Engine:
    return Engine.from_pretrained(synthetic_model(model), dtype=torch.float32, max_batch=SLOTS, max_seq_len=SEQ,
                                  **VARIANTS[variant])


@functools.cache
def prompts(model: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    V = engine(model, "fiddler-cpu").config.vocab_size
    return [torch.randint(0, V, (n,), generator=g) for n in PROMPT_LENS]


@functools.cache
def alone(model: str) -> list[list[int]]:
    """Each request alone, through the engine's one-request path."""
    e = engine(model, "fiddler-cpu")
    return [e.generate(p, max_new_tokens=n).tokens.tolist() for p, n in zip(prompts(model), OUTPUT_LENS)]


def params(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def run_staggered(be: BatchEngine, ps, outs, every: int = 3) -> list:
    """One new request every `every` steps, stepping in between."""
    reqs = []
    for p, n in zip(ps, outs):
        reqs.append(be.submit(p, params(n)))
        for _ in range(every):
            be.step()
    be.run()
    return reqs


VARIANT_NAMES = [v for v in VARIANTS if v != "reference"]


@pytest.mark.parametrize("variant", VARIANT_NAMES)
@pytest.mark.parametrize("model", MODELS)
def test_together_is_alone(model, variant):
    e = engine(model, variant)
    be = BatchEngine(e, token_budget=128)
    got = be.generate(prompts(model), [params(n) for n in OUTPUT_LENS])
    assert got == alone(model)
    st = be.stats()
    assert st["running"] == st["waiting"] == 0 and st["prefill_tokens"] == sum(PROMPT_LENS)
    assert max(s.tokens for s in be.steps) <= 128 and max(s.requests for s in be.steps) > 8
    if variant.startswith("fiddler-emul-"):  # the placement's decision kinds all occurred, per step counted
        used = "".join(k for k in "abc" if st["experts"][k] > 0)
        assert used == EXPECTED_KINDS[variant.split("-")[2]], st["experts"]
    staggered = run_staggered(BatchEngine(e, token_budget=64), prompts(model), OUTPUT_LENS)
    assert [r.tokens for r in staggered] == alone(model)
    assert all(r.finish_reason == "length" for r in staggered)


@pytest.mark.parametrize("model", MODELS)
def test_executor_plans_the_whole_step(model):
    """Every MoE layer hands the executor all of the step's tokens at once (its planner sees the tokens per
    expert of the whole step): the routed token-expert pairs per step are tokens x slots x MoE layers."""
    e = engine(model, "fiddler-emul-half-makespan")
    be = BatchEngine(e, token_budget=96)
    be.generate(prompts(model)[:6], [params(n) for n in OUTPUT_LENS[:6]])
    cfg = e.config
    per_token = cfg.active_slots * len(cfg.moe_layers)
    for s in be.steps:
        assert sum(s.expert_tokens.values()) == s.tokens * per_token, s
        assert s.tokens == s.decode_tokens + s.prefill_tokens


def test_seeded_sample_alone_and_batched():
    model = "tiny_mixtral"
    e = engine(model, "fiddler-cpu")
    p = prompts(model)[3]
    solo = e.generate(p, max_new_tokens=24, do_sample=True, temperature=0.8, top_k=50, top_p=0.9, seed=11)
    be = BatchEngine(e)
    others = [be.submit(q, params(n)) for q, n in zip(prompts(model)[:5], OUTPUT_LENS[:5])]
    sampled = be.submit(p, params(24, temperature=0.8, top_k=50, top_p=0.9, seed=11))
    be.run()
    assert sampled.tokens == solo.tokens.tolist()
    assert [r.tokens for r in others] == alone(model)[:5]


def test_cancel_mid_decode_frees_the_slot_and_leaves_the_others():
    model = "tiny_qwen3_moe"
    be = BatchEngine(engine(model, "fiddler-cpu"), slots=4)
    ids = [1, 4, 9, 13]  # 64, 64, 64 and 50 tokens
    reqs = [be.submit(prompts(model)[i], params(OUTPUT_LENS[i])) for i in ids]
    while len(reqs[1].tokens) < 5:
        be.step()
    assert reqs[1].slot is not None
    reqs[1].cancel()  # no loop thread and no step running: taken out now
    assert reqs[1].finish_reason == "cancelled" and reqs[1].slot is None and 5 <= len(reqs[1].tokens) < 64
    late = be.submit(prompts(model)[2], params(OUTPUT_LENS[2]))  # takes the freed slot
    be.run()
    assert reqs[1].tokens == alone(model)[4][: len(reqs[1].tokens)]
    assert [reqs[j].tokens for j in (0, 2, 3)] == [alone(model)[i] for i in (1, 9, 13)]
    assert late.tokens == alone(model)[2]


def test_loop_thread_streams_and_drains():
    model = "tiny_deepseek_v2"
    be = BatchEngine(engine(model, "fiddler-cpu"))
    be.start()
    try:
        streamed: dict[int, list[int]] = {}

        def client(i):
            r = be.submit(prompts(model)[i], params(OUTPUT_LENS[i]))
            streamed[i] = list(r)  # tokens as they come, from the loop thread

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert [streamed[i] for i in range(8)] == alone(model)[:8]
        tail = be.submit(prompts(model)[8], params(OUTPUT_LENS[8]))
    finally:
        be.stop(drain=True, timeout=120)
    assert tail.tokens == alone(model)[8]  # drained, not dropped


def test_callbacks_and_timestamps():
    model = "tiny_mixtral"
    be = BatchEngine(engine(model, "fiddler-cpu"))
    seen = []
    r = be.submit(prompts(model)[2], params(10), on_token=seen.append)
    be.run()
    assert seen == r.tokens == alone(model)[2]
    assert r.submitted_at <= r.first_token_at <= r.finished_at and len(r.token_times) == 10


def test_stop_tokens_and_eos():
    model = "tiny_mixtral"
    e = engine(model, "fiddler-cpu")
    ref = alone(model)[1]
    stop = ref[5]
    first = ref.index(stop)
    be = BatchEngine(e, eos_token_ids=(stop,))
    by_eos = be.submit(prompts(model)[1], SamplingParams(max_tokens=64))
    by_stop = be.submit(prompts(model)[1].clone(), SamplingParams(max_tokens=64, stop_token_ids=(stop,),
                                                                  ignore_eos=True))
    ignored = be.submit(prompts(model)[1].clone(), SamplingParams(max_tokens=64, ignore_eos=True))
    be.run()
    assert by_eos.tokens == by_stop.tokens == ref[: first + 1] and by_eos.finish_reason == "stop"
    assert ignored.tokens == ref and ignored.finish_reason == "length"


def test_admission():
    model = "tiny_mixtral"
    be = BatchEngine(engine(model, "fiddler-cpu"), slots=2, max_queue=1)
    p = prompts(model)[2]
    with pytest.raises(ValueError, match=r"300 tokens \+ 64 new tokens = 364 exceeds the engine's KV cache"):
        be.submit(torch.zeros(300, dtype=torch.long), params(64))
    with pytest.raises(ValueError, match="token ids must be in"):
        be.submit(torch.tensor([1, 10**6]), params(4))
    with pytest.raises(ValueError, match="max_tokens"):
        params(0)
    reqs = [be.submit(p, params(4)) for _ in range(3)]  # 2 free slots + 1 queued
    with pytest.raises(QueueFull, match="max_queue=1"):
        be.submit(p, params(4))
    be.run()
    assert all(r.tokens == alone(model)[2][:4] for r in reqs)
    with pytest.raises(ValueError, match="slots=32 exceeds"):
        BatchEngine(engine(model, "fiddler-cpu"), slots=32)


def _req(i: int, n: int) -> Request:
    return Request(i, torch.arange(n), SamplingParams(max_tokens=4))


def test_scheduler_decodes_first_then_chunks_prompts_fifo():
    s = Scheduler(slots=3, token_budget=10, max_queue=8)
    a, b, c, d = _req(0, 7), _req(1, 12), _req(2, 2), _req(3, 1)
    for r in (a, b, c, d):
        s.add(r)
    w = s.plan()  # admits a, b, c (3 slots); a's whole prompt, then 3 of b's
    assert [(x.request.id, x.start, x.length, x.emits) for x in w] == [(0, 0, 7, True), (1, 0, 3, False)]
    assert [r.slot for r in (a, b, c)] == [0, 1, 2] and list(s.waiting) == [d]
    a.prefilled, b.prefilled = 7, 3
    a.tokens.append(5)
    w = s.plan()  # a decodes (1 token), b gets 9 more = its last
    assert [(x.request.id, x.start, x.length, x.emits, x.decode) for x in w] == \
        [(0, 7, 1, True, True), (1, 3, 9, True, False)]
    s.release(a)
    assert s.plan()[0].request is b  # b still not marked prefilled: it is planned again
    assert d.slot == 0  # a's slot went to the queue's head
    with pytest.raises(ValueError, match="token_budget"):
        Scheduler(slots=4, token_budget=2, max_queue=1)


def test_slots_count_in_the_gpu_side_reservation():
    """The slots are the KV cache's rows: placement's GPU-side reservation holds all of them."""
    from fiddler.executors import FiddlerPolicy, GpuSide

    def reserved(slots):
        be = BatchEngine.from_pretrained(synthetic_model("tiny_mixtral"), slots=slots, max_seq_len=64,
                                         dtype=torch.float32, gpu=GpuSide.emulated(1 << 40),
                                         executor=FiddlerPolicy(placement="none"))
        kv = be.engine.info()["executor_info"]["placement"]["reserved_bytes"]["kv_cache"]
        assert kv == be.model.cache.nbytes and be.scheduler.slots == slots
        return kv

    assert reserved(12) == 3 * reserved(4)


# ---------------------------------------------------------------- a request's own failure is its own (issue 55)

def test_a_failing_sampler_fails_only_its_request(monkeypatch):
    """Whatever goes wrong in one request's own sampling (its warped distribution, its generator) fails that
    request alone: the greedy requests in the same steps get their alone tokens."""
    import fiddler.batch.engine as batch_engine

    def broken(*a, **kw):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    monkeypatch.setattr(batch_engine, "choose_token", broken)
    model = "tiny_mixtral"
    be = BatchEngine(engine(model, "fiddler-cpu"), slots=4)
    greedy = [be.submit(prompts(model)[i], params(OUTPUT_LENS[i])) for i in (2, 4)]
    sampled = be.submit(prompts(model)[3], params(20, temperature=0.7, seed=1))
    be.run()
    assert [r.tokens for r in greedy] == [alone(model)[2], alone(model)[4]]
    assert sampled.finish_reason == "error" and "probability tensor" in sampled.error
    assert be.scheduler.idle and sorted(be.scheduler._free) == [0, 1, 2, 3]


@pytest.mark.parametrize("temperature", [1e-300, 1e-45])
def test_a_vanishing_temperature_is_greedy_and_its_neighbours_unharmed(temperature):
    """A temperature too small to divide by (1/T overflows fp32) samples as greedy does (as vLLM treats any
    temperature below 1e-5), beside a greedy request."""
    model = "tiny_mixtral"
    be = BatchEngine(engine(model, "fiddler-cpu"), slots=4)
    beside = be.submit(prompts(model)[4], params(OUTPUT_LENS[4]))
    tiny = be.submit(prompts(model)[2], params(OUTPUT_LENS[2], temperature=temperature, seed=3))
    be.run()
    assert beside.tokens == alone(model)[4] and tiny.tokens == alone(model)[2]


def test_stopping_without_drain_aborts_the_requests_in_flight():
    """stop(drain=False) cuts the requests in flight with their own finish reason ('aborted'), not the one a
    client's own cancel gets, so a server can tell a cut answer from a complete or cancelled one."""
    model = "tiny_mixtral"
    be = BatchEngine(engine(model, "fiddler-cpu"), slots=2, max_queue=4)
    reqs = [be.submit(prompts(model)[i], params(64)) for i in (1, 3, 5)]  # two run, one waits
    mine = be.submit(prompts(model)[2], params(64))
    mine.cancel()
    be.start()
    while len(reqs[0].tokens) < 3:
        be._wait_for(reqs[0], len(reqs[0].tokens))
    be.stop(drain=False, timeout=60)
    assert [r.finish_reason for r in reqs] == ["aborted"] * 3 and mine.finish_reason == "cancelled"
    assert be.totals["finished"]["aborted"] == 3
