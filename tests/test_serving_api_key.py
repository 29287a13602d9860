"""serve.api_key in the harness (runners/serving/api_key.py): from the environment only, to the server in its
environment and to guidellm in a private file, and never in a record, a log or the run folder."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from runners.serving.api_key import REDACTED, literal_on_command_line, redact, scrub
from runners.serving.process import server_environment
from runners.serving.workload import guidellm_command
from systems.base import SystemUnavailable
from tests.test_cli import run_py

KEY = "sk-test-9f8e7d6c5b4a"


def test_a_literal_key_on_the_command_line_is_refused_before_hydra_writes_it(tmp_path):
    assert literal_on_command_line(["mode=serve", f"serve.api_key={KEY}"])
    assert literal_on_command_line(["serve.api_key=${oc.env:MY_KEY}"]) is None
    assert literal_on_command_line(["serve.api_key=null", "serve.port=9000"]) is None
    d = tmp_path / "D"
    res = run_py("mode=serve", "system=fiddler", f"serve.api_key={KEY}", f"hydra.run.dir={d}", timeout=300)
    assert res.returncode == 2 and "FIDDLER_API_KEY" in res.stderr
    assert KEY not in res.stderr + res.stdout and not d.exists()  # nothing written: no .hydra/overrides.yaml


def test_records_keep_the_key_redacted():
    cfg = {"serve": {"api_key": KEY, "port": 1}, "workload": {}}
    out = redact(cfg)
    assert out["serve"] == {"api_key": REDACTED, "port": 1} and cfg["serve"]["api_key"] == KEY  # a copy
    assert redact({"serve": {"api_key": None}}) == {"serve": {"api_key": None}}
    assert scrub(f"bad key {KEY}!", KEY) == f"bad key {REDACTED}!" and scrub("x", None) == "x"


def test_the_server_gets_the_key_in_its_environment_under_its_own_variable():
    class Adapter:
        process_env = {"A": "1"}
        server_api_key_env = "VLLM_API_KEY"
        config = SimpleNamespace(name="vllm")

        def server_env(self, serve):
            return {"B": "2"}

    env = server_environment(Adapter(), SimpleNamespace(api_key=KEY))
    assert env["VLLM_API_KEY"] == KEY and env["A"] == "1" and env["B"] == "2"
    Adapter.server_api_key_env = None
    with pytest.raises(SystemUnavailable, match="takes no API key"):
        server_environment(Adapter(), SimpleNamespace(api_key=KEY))
    assert "VLLM_API_KEY" not in server_environment(Adapter(), SimpleNamespace(api_key=None))


@pytest.mark.skipif(guidellm_command() is None, reason="guidellm (the serving extra) is not installed")
def test_a_serving_run_with_a_key_measures_and_writes_it_nowhere(tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    monkeypatch.setenv("FIDDLER_API_KEY", KEY)
    d = tmp_path / "D"
    res = run_py("system=fiddler", "model=tiny_mixtral", "workload=serving", "workload.concurrency=[2]",
                 "workload.rate_search=0",
                 "workload.requests_per_stream=4", "workload.input_lens=[16]", "workload.output_lens=[4]",
                 f"hydra.run.dir={d}", f"run.index_path={tmp_path / 'i.jsonl'}", timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    text = (d / "records.jsonl").read_text()
    assert '"status": "ok"' in text and f'"api_key": "{REDACTED}"' in text  # guidellm got in: the key was sent
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "server.log" for p in written)
    for p in written:
        assert KEY not in p.read_text(errors="replace"), p
    assert KEY not in res.stdout + res.stderr


def test_fiddlers_server_gets_the_prefix_cache_and_reads_its_key_from_the_environment():
    from runners import schema
    from systems.base import ModelSpec, RunContext
    from systems.fiddler.adapter import FiddlerAdapter
    from systems.fiddler.config import FiddlerConfig

    a = FiddlerAdapter(FiddlerConfig.build(), ModelSpec("tiny_mixtral", "/nonexistent/tiny"),
                       RunContext(threads=2, gpu_memory_gb=0, has_cuda=False, cache_dir="/tmp"))
    cmd = a.server_command(schema.ServeConfig(prefix_cache_mb=64, api_key=KEY))
    assert cmd[cmd.index("--prefix-cache-mb") + 1] == "64" and KEY not in cmd and "--api-key" not in cmd
    assert "--prefix-cache-mb" not in a.server_command(schema.ServeConfig(api_key=None))
    assert a.server_api_key_env == "FIDDLER_API_KEY"
