"""Prefix reuse (fiddler.batch.prefix_cache): the cache's own rules on a toy KV store, and, in fp32 on the test
families (tests/models.py), a request whose prompt starts with a cached prefix gets the greedy tokens of
transformers and of the request alone, batched or not, while computing only the rest of its prompt."""
from __future__ import annotations

import functools

import pytest
import torch

from fiddler import Engine
from fiddler.batch import BatchEngine, SamplingParams
from fiddler.batch.prefix_cache import PrefixCache
from fiddler.executors import GpuSide
from tests.models import ARCHS, hf_model, model_path

BLOCK = 8


class ToyKV:
    """save_row/load_row over one [rows, positions] tensor; a saved row costs one byte per position."""

    def __init__(self, rows=4, seq=64):
        self.t = torch.zeros(rows, seq, dtype=torch.uint8)

    def save_row(self, row, n):
        return (self.t[row, :n].clone(),)

    def load_row(self, row, saved, n):
        self.t[row, :n] = saved[0][:n]


def toks(*blocks):
    return [t for b in blocks for t in ([b] * BLOCK if isinstance(b, int) else b)]


def stored(pc, kv, row, tokens):
    kv.t[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.uint8)
    pc.store(tokens, row)


def test_longest_whole_block_prefix_leaving_one_token():
    kv = ToyKV()
    pc = PrefixCache(kv, max_bytes=1000, block=BLOCK)
    stored(pc, kv, 0, toks(1, 2, 3) + [9, 9])  # whole blocks kept: 24 positions
    e, n = pc.lookup(toks(1, 2, 7))
    assert n == 16 and list(e.tokens[:n]) == toks(1, 2)
    assert pc.lookup(toks(1, 2, 3))[1] == 16  # the whole prompt cached: its last block is left to compute
    assert pc.lookup(toks(1, 2, 3) + [5])[1] == 24
    assert pc.lookup(toks(4, 2, 3))[1] == 0  # a prefix matches from the first token
    assert pc.lookup([1] * (BLOCK - 1))[1] == 0  # shorter than a block
    pc.load(e, 16, 3)
    assert kv.t[3, :16].tolist() == toks(1, 2)


def test_a_hash_collision_never_reuses_another_prompts_entries():
    kv = ToyKV()
    pc = PrefixCache(kv, max_bytes=1000, block=BLOCK)
    pc._hashes = lambda tokens: [0] * (len(tokens) // BLOCK)  # every prefix collides
    stored(pc, kv, 0, toks(1, 2))
    assert pc.lookup(toks(3, 4, 5))[1] == 0
    assert pc.lookup(toks(1, 4, 5))[1] == 8


def test_least_recently_used_go_first_and_shared_prefixes_survive_them():
    kv = ToyKV()
    pc = PrefixCache(kv, max_bytes=48, block=BLOCK)  # two 3-block entries
    stored(pc, kv, 0, toks(1, 2, 3))
    stored(pc, kv, 1, toks(1, 2, 4))
    stored(pc, kv, 2, toks(1, 2, 4))  # held already: nothing stored
    assert pc.nbytes == 48 and len(pc.entries) == 2
    assert pc.lookup(toks(1, 2, 3, 0))[1] == 24  # touches the first entry: the second is now the oldest
    stored(pc, kv, 2, toks(5, 6, 7))
    assert pc.nbytes <= 48 and pc.lookup(toks(1, 2, 4, 0))[1] == 16  # its own block is gone, 1-2 stays
    stored(pc, kv, 3, toks(8, 8, 8))  # that lookup touched 1-2-3: 5-6-7 goes
    assert pc.lookup(toks(5, 6, 7, 0))[1] == 0 and pc.lookup(toks(1, 2, 3, 0))[1] == 24
    stored(pc, kv, 0, toks(9, 9, 9))  # now 8-8-8 is the oldest
    assert pc.lookup(toks(8, 8, 8, 0))[1] == 0 and len(pc.entries) == 2
    PrefixCache(kv, max_bytes=8, block=BLOCK).store(toks(1, 2), 0)  # larger than the budget: not kept
    with pytest.raises(ValueError):
        PrefixCache(kv, max_bytes=-1)


ARCH_NAMES = ["e8k2", "qwen3_moe", "deepseek_v2"]


@functools.cache
def engine(arch: str) -> Engine:
    return Engine.from_pretrained(model_path(arch), dtype=torch.float32, gpu=GpuSide.none(), max_batch=4,
                                  max_seq_len=128)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_a_cached_prefix_gives_the_tokens_of_the_request_alone(arch):
    e = engine(arch)
    V = ARCHS[arch]["vocab_size"]
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(3, V, (40,), generator=g)
    prompts = [torch.cat([shared, torch.randint(3, V, (n,), generator=g)]) for n in (3, 9, 1, 17)]
    alone = [e.generate(p, max_new_tokens=12).tokens.tolist() for p in prompts]
    ref = hf_model(arch, torch.float32).generate(prompts[1][None], max_new_tokens=12, do_sample=False)[0, 49:]
    assert alone[1] == ref.tolist()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    be = BatchEngine(e, token_budget=32, prefix_cache_bytes=1 << 30, prefix_block=BLOCK)
    assert be.generate([prompts[0]], params) == alone[:1]  # computes the shared prefix, keeps it
    assert be.stats()["prefix_hit_tokens"] == 0
    got = be.generate(prompts[1:], params)  # three at once, each from the cached prefix
    assert got == alone[1:]
    st = be.stats()
    assert st["prefix_hit_tokens"] == 3 * 40 and st["prefix_miss_tokens"] == sum(p.shape[0] for p in prompts) - 120
    assert st["prefill_tokens"] == st["prefix_miss_tokens"]  # only the rest was computed


def test_the_server_reuses_prefixes_and_counts_them():
    """python -m fiddler.server --prefix-cache-mb: the same greedy tokens for a prompt whose prefix was cached
    by an earlier request, and /metrics counts the hit and miss tokens."""
    from tests.server_helpers import metrics, request, running_server

    shared = list(range(10, 74))  # 64 tokens: four blocks of the default 16
    body = lambda tail: {"prompt": shared + tail, "max_tokens": 6, "temperature": 0, "ignore_eos": True}  # noqa: E731
    with running_server() as (_p, port):  # no prefix cache: what the tokens must be
        want = request(port, "POST", "/v1/completions", body([5, 6, 7]))[2]["choices"][0]["text"]
        assert metrics(port)['fiddler_prefix_cache_tokens_total{result="hit"}'] == 0
    with running_server("--prefix-cache-mb", "64") as (_p, port):
        request(port, "POST", "/v1/completions", body([1, 2]))
        status, _h, out = request(port, "POST", "/v1/completions", body([5, 6, 7]))
        m = metrics(port)
    assert status == 200 and out["choices"][0]["text"] == want
    assert m['fiddler_prefix_cache_tokens_total{result="hit"}'] == 64
    assert m['fiddler_prefix_cache_tokens_total{result="miss"}'] == 66 + 3
