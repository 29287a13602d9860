"""One engine step (issue 46): what the server runs is what every benchmark measures. Breaking the step
(Engine.step, patched in every process by a sitecustomize) breaks both a `python run.py system=fiddler` job
and a request through `python -m fiddler.server`, with the step's own error; restored, both succeed."""
from __future__ import annotations

import os
import pathlib

import pytest

from runners.records import read_jsonl
from tests.server_helpers import request, running_server
from tests.test_cli import run_py

ROOT = pathlib.Path(__file__).resolve().parents[1]
MESSAGE = "the engine step is broken on purpose (tests/test_one_step.py)"
SITECUSTOMIZE = '''import os
if os.environ.get("FIDDLER_BREAK_STEP"):
    import fiddler.engine

    def _broken(self, tokens, segments, **kw):
        raise RuntimeError(os.environ["FIDDLER_BREAK_STEP"])

    fiddler.engine.Engine.step = _broken
'''


def _fiddler_job(d: pathlib.Path):
    res = run_py("system=fiddler", "model=tiny_mixtral", "workload=single_batch", "workload.input_lens=[8]",
                 "workload.output_lens=[4]", "workload.repetitions=1", f"hydra.run.dir={d}",
                 f"run.index_path={d / 'index.jsonl'}", timeout=600)
    return res, read_jsonl(d / "records.jsonl")


@pytest.mark.slow
def test_breaking_the_step_breaks_the_benchmark_and_the_server(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH"))
                                                     if p))
    for broken in (True, False):
        if broken:
            monkeypatch.setenv("FIDDLER_BREAK_STEP", MESSAGE)
        else:
            monkeypatch.delenv("FIDDLER_BREAK_STEP")
        res, recs = _fiddler_job(tmp_path / f"run-{broken}")
        assert recs, res.stderr[-3000:]
        if broken:
            assert res.returncode == 1 and all(r["status"] == "error" and MESSAGE in r["reason"] for r in recs), \
                [(r["status"], r.get("reason")) for r in recs]
        else:
            assert res.returncode == 0 and all(r["status"] == "ok" for r in recs), res.stderr[-3000:]
        with running_server() as (_proc, port):
            status, _h, body = request(port, "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3})
        if broken:
            assert status == 500 and MESSAGE in body["error"]["message"], (status, body)
        else:
            assert status == 200 and body["usage"]["completion_tokens"] == 3, (status, body)



def test_the_in_process_batching_measurement_runs_the_step(monkeypatch):
    """runners/concurrency.py (batch_decode16_vs_1, scripts/bench_batch.py) drives the same Engine.step."""
    import fiddler.engine
    from fiddler.batch import BatchEngine
    from runners.concurrency import prompts, timed_concurrent
    from runners.models import synthetic_model

    be = BatchEngine.from_pretrained(synthetic_model("tiny_mixtral"), slots=2, max_seq_len=32)
    ps = prompts(2, 8, be.engine.config.vocab_size)
    assert timed_concurrent(be, ps, 3)["output_tokens"] == 6
    calls = []
    real = fiddler.engine.Engine.step
    monkeypatch.setattr(fiddler.engine.Engine, "step", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    timed_concurrent(be, ps, 3)
    assert calls

    def broken(self, *a, **k):
        raise RuntimeError(MESSAGE)

    monkeypatch.setattr(fiddler.engine.Engine, "step", broken)
    with pytest.raises(RuntimeError, match="broken on purpose"):
        timed_concurrent(be, ps, 3)
