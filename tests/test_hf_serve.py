"""system=hf_transformers's server: `transformers serve` through systems/hf_transformers/serve.py, which takes
vLLM's `ignore_eos` (the load generators' way to fix output lengths) instead of answering 422."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from runners.models import synthetic_model
from tests.server_helpers import request, running_server

serving = pytest.importorskip("transformers.cli.serving.completion")


def _handler():
    from systems.hf_transformers.serve import accept_ignore_eos

    accept_ignore_eos()
    accept_ignore_eos()  # idempotent: one wrapper, not two
    h = object.__new__(serving.CompletionHandler)
    h.generation_state = SimpleNamespace(_compile=False)
    return h


def test_ignore_eos_disables_the_requests_end_of_sequence_tokens_only():
    from transformers import GenerationConfig

    from systems.hf_transformers.serve import NO_EOS

    h = _handler()
    base = GenerationConfig(eos_token_id=[2, 7], max_new_tokens=5)
    on = h._build_generation_config({"max_tokens": 9, "ignore_eos": True}, base, use_cb=True)
    off = h._build_generation_config({"max_tokens": 9, "ignore_eos": False}, base, use_cb=True)
    plain = h._build_generation_config({"max_tokens": 9}, base, use_cb=True)
    assert on.eos_token_id == NO_EOS and on.max_new_tokens == 9
    assert off.eos_token_id == plain.eos_token_id == [2, 7] and base.eos_token_id == [2, 7]
    h._validate_request({"model": "m", "prompt": "x", "max_tokens": 3, "ignore_eos": True, "stop": None})
    with pytest.raises(Exception, match="Unexpected fields"):  # the schema is otherwise as strict as before
        h._validate_request({"model": "m", "prompt": "x", "no_such_field": 1})


def test_transformers_serve_takes_ignore_eos_over_http():
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        pytest.skip("transformers' serving extra is not installed")
    model = str(synthetic_model("tiny_mixtral"))

    def command(port):
        return [sys.executable, "-m", "systems.hf_transformers.serve", "serve", "--continuous-batching",
                "--host", "127.0.0.1", "--port", str(port), model]

    with running_server(command=command) as (_, port):
        body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 12, "ignore_eos": True, "stop": None}
        status, _, out = request(port, "POST", "/v1/completions", body, timeout=300)
        assert status == 200, out
        assert out["usage"]["completion_tokens"] == 12 and out["choices"][0]["finish_reason"] == "length"
        status, _, out = request(port, "POST", "/v1/completions", {**body, "no_such_field": 1})
        assert status == 422
