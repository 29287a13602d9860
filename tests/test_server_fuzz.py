"""The fuzz campaign (issue 55): schemathesis against the server's own OpenAPI schema for the completions and
chat routes (positive and negative cases), and hypothesis over parse_body and make_job, the request model. No
request may get a 5xx other than the documented 503 (with Retry-After), and the server answers a normal
request after the campaign.

This is the short campaign of every `python -m pytest` run: FIDDLER_FUZZ_EXAMPLES cases per route and mode (default
25; deterministic, one server on 127.0.0.1 with a 128-token cache so every generation is short, its test bounded
by pytest-timeout). scripts/fuzz_server.py runs the long one: more examples, random seeds, the same tests."""

from __future__ import annotations

import functools
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("schemathesis")

from fiddler.batch import SamplingParams  # noqa: E402
from fiddler.server import protocol as P  # noqa: E402
from runners.models import synthetic_model  # noqa: E402
from scripts.fuzz_server import run_campaign  # noqa: E402
from tests.server_helpers import request, running_server  # noqa: E402

EXAMPLES = int(os.environ.get("FIDDLER_FUZZ_EXAMPLES", "25"))
RANDOM = os.environ.get("FIDDLER_FUZZ_RANDOM") == "1"  # the long campaign draws new cases each run
CONTEXT = 128
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_port():
    with running_server("--slots", "4", "--max-queue", "8", "--max-seq-len", str(CONTEXT)) as (_, port):
        yield port


@pytest.mark.timeout(600)
def test_the_api_schema_cases_get_no_unexpected_5xx(fuzz_port):
    out = run_campaign(f"http://127.0.0.1:{fuzz_port}", EXAMPLES, None if RANDOM else 0)
    assert out["requests"] >= 4 * EXAMPLES * 0.5, out  # hypothesis may stop early on a small space, not here
    assert not out["failures"], "\n\n".join(f"{k}\n{m}\nbody: {b!r}" for k, (m, b) in out["failures"].items())


def test_the_server_answers_a_normal_request_after_the_campaign(fuzz_port):
    st_, _, body = request(fuzz_port, "POST", "/v1/completions", {"prompt": "after", "max_tokens": 3,
                                                                   "temperature": 0, "ignore_eos": True})
    assert st_ == 200 and body["usage"]["completion_tokens"] == 3
    st_, _, body = request(fuzz_port, "POST", "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "after"}], "max_tokens": 3})
    assert st_ == 200 and body["choices"][0]["message"]["role"] == "assistant"


# ---------------------------------------------------------------- hypothesis over the request model

@functools.cache
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(synthetic_model("tiny_mixtral"), local_files_only=True)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                    max_leaves=12)
PLAUSIBLE = {  # values near what each field takes, so cases get past the first check
    "prompt": st.text(max_size=40) | st.lists(st.integers(-2, 1100), max_size=8),
    "messages": st.lists(st.fixed_dictionaries({
        "role": st.sampled_from(["user", "system", "assistant"]) | st.text(max_size=5),
        "content": st.text(max_size=20) | st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8) | st.integers()}), max_size=3),
    }), max_size=3),
    "max_tokens": st.integers(-2, 300), "max_completion_tokens": st.integers(-2, 300),
    "temperature": st.floats(-1, 3) | st.sampled_from([1e-300, 1e-45, 5e-324]), "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-3, 2000), "seed": st.integers(-(2**64), 2**64), "stop": st.text(max_size=4) | st.lists(
        st.text(max_size=4), max_size=6), "stream": st.booleans(), "ignore_eos": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": JSON}), "model": st.sampled_from(["m", "other"]),
    **{k: st.sampled_from([None, *v]) | JSON for k, v in P.UNSUPPORTED.items()},
}
BODIES = st.dictionaries(st.sampled_from(sorted(PLAUSIBLE)) | st.text(max_size=6), JSON, max_size=3).flatmap(
    lambda extra: st.fixed_dictionaries({}, optional={k: v | JSON for k, v in PLAUSIBLE.items()}).map(
        lambda body: {**extra, **body}))


@FUZZ
@given(raw=st.binary(max_size=300) | BODIES.map(lambda b: json.dumps(b).encode()) | st.integers(1, 3000).map(
    lambda depth: b"[" * depth + b"]" * depth))
def test_parse_body_answers_a_dict_or_a_400(raw):
    try:
        body = P.parse_body(raw)
    except P.APIError as e:
        assert e.status == 400 and e.code == "invalid_json"
        return
    assert isinstance(body, dict)


@settings(FUZZ, max_examples=EXAMPLES * 8)
@given(body=BODIES, chat=st.booleans())
def test_make_job_answers_a_job_that_fits_or_a_4xx(body, chat):
    try:
        job = P.make_job(body, tokenizer(), chat=chat, context=CONTEXT, served_model="m")
    except P.APIError as e:
        assert e.status in (400, 404) and set(e.body()["error"]) == {"message", "type", "code"}
        return
    assert isinstance(job.params, SamplingParams) and job.chat == chat
    assert 1 <= len(job.prompt_ids) and len(job.prompt_ids) + job.params.max_tokens <= CONTEXT
    assert all(isinstance(s, str) and s for s in job.stop_strings)
