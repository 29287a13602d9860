"""Every input is checked before anything runs: the model's config.json, the prompt file, the index
path, unknown keys (even with `+`), a system.adapter that is not a SystemAdapter class and threads
beyond this host's cores each fail with a one-line ConfigError (exit 2 from run.py,
tests/test_exit_codes.py) that names the problem, and no system is loaded."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fiddler import hardware
from runners.main import prepare, resolve_model_path
from runners.records import read_jsonl
from runners.schema import ConfigError
from tests.test_cli import run_py
from tests.test_harness import _job, cfg_of


@pytest.fixture(scope="module")
def tiny_path() -> Path:
    return Path(resolve_model_path(prepare(cfg_of())[0]))


@pytest.fixture
def loads(tmp_path, monkeypatch) -> Path:
    """A file that gets a line each time the fake system loads (in any process)."""
    path = tmp_path / "loads.txt"
    monkeypatch.setenv("FIDDLER_FAKE_LOAD_LOG", str(path))
    return path


def _refused(tmp_path, loads, *overrides: str) -> str:
    with pytest.raises(ConfigError) as err:
        _job(tmp_path, "workload.input_lens=[8,9]", *overrides)
    assert not loads.exists() and not (tmp_path / "index.jsonl").exists()  # nothing loaded or recorded
    return str(err.value)


def test_invalid_config_json_fails_at_start_naming_the_file(tmp_path, tiny_path):
    """Bug 5: a config.json that is not JSON gave a Hydra traceback (exit 1) naming no file."""
    bad = shutil.copytree(tiny_path, tmp_path / "m")
    (bad / "config.json").write_text('{"vocab_size": 1000,\n')
    res = run_py(f"model.path={bad}", "system.adapter=tests.fake_systems:FakeSystem", "workload.input_lens=[8]",
                 "workload.output_lens=[4]", f"hydra.run.dir={tmp_path / 'run'}",
                 f"run.index_path={tmp_path / 'i.jsonl'}", timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    first = res.stderr.strip().splitlines()[0]
    assert first.startswith(f"error: {bad / 'config.json'}: not a valid JSON file")
    assert not (tmp_path / "i.jsonl").exists()


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size"])
def test_config_json_without_a_required_key_fails_at_start_naming_it(tmp_path, tiny_path, loads, key):
    """Bug 5: without vocab_size, two configurations gave `error` records naming neither file nor key."""
    bad = shutil.copytree(tiny_path, tmp_path / "m")
    cfg = json.loads((bad / "config.json").read_text())
    del cfg[key]
    (bad / "config.json").write_text(json.dumps(cfg))
    msg = _refused(tmp_path, loads, f"model.path={bad}")
    assert msg == f"{bad / 'config.json'}: required key {key!r} is missing"


@pytest.mark.parametrize("content", [b"", b" \n\n"])
def test_empty_prompt_file_is_refused(tmp_path, loads, content):
    """Bug 6: an empty prompt file gave an `ok`, valid record whose prompt was all BOS tokens."""
    (tmp_path / "p.txt").write_bytes(content)
    assert _refused(tmp_path, loads, f"workload.prompt_file={tmp_path / 'p.txt'}").endswith(" is empty")


def test_prompt_of_special_tokens_only_is_an_error_record(tmp_path):
    """Bug 6, the tokenizer's side: text that tokenizes to special tokens only is not a prompt."""
    (tmp_path / "p.txt").write_text("</s></s>")
    recs = _job(tmp_path, "workload.input_lens=[8]", "run.isolation=inline", f"workload.prompt_file={tmp_path / 'p.txt'}")
    assert [r["status"] for r in recs] == ["error"] and "no tokens besides special ones" in recs[0]["reason"]


@pytest.mark.parametrize("make, words", [
    (lambda d: d / "missing.txt", "does not exist"),
    (lambda d: d, "is not a regular file"),
    (lambda d: (d / "bin").write_bytes(b"\x7fELF\x00\x01\x02") and d / "bin", "is not a UTF-8 text file"),
    (lambda d: (d / "latin1").write_bytes("caf\xe9".encode("latin-1")) and d / "latin1", "is not a UTF-8 text file"),
])
def test_bad_prompt_file_fails_before_the_model_loads(tmp_path, loads, make, words):
    """A missing, binary or directory prompt_file was found only after the model loaded: an `error`
    record per configuration and exit 1."""
    path = make(tmp_path)
    msg = _refused(tmp_path, loads, f"workload.prompt_file={path}")
    assert msg.startswith(f"workload.prompt_file='{path}' ") and msg.endswith(words)


def test_good_prompt_file_runs(tmp_path):
    (tmp_path / "p.txt").write_text("The quick brown fox.\n")
    recs = _job(tmp_path, "workload.input_lens=[8]", "run.isolation=inline", f"workload.prompt_file={tmp_path / 'p.txt'}")
    assert [r["status"] for r in recs] == ["ok"]


@pytest.mark.parametrize("override, expected", [
    ("+system.planer=paper", "system.planer is not a known key; did you mean system.planner?"),
    ("+run.timeout=5", "run.timeout is not a known key; did you mean run.timeout_s?"),
    ("+frobnicate=1", "frobnicate is not a known key; allowed under the top level:"),
])
def test_unknown_keys_added_with_plus_are_refused(override, expected):
    """`+system.planer=paper` (a typo with `+`) exited 0 with an `ok` record; planner stayed makespan."""
    with pytest.raises(ConfigError) as err:
        prepare(cfg_of("system=fiddler", override))
    assert str(err.value).startswith(expected)


@pytest.mark.parametrize("args, expected", [
    (("workload.repetitons=3",), "workload.repetitons is not a known key; did you mean workload.repetitions?"),
    (("environment.cpu.thread=4",), "environment.cpu.thread is not a known key; did you mean environment.cpu.threads?"),
    (("-m", "workload.repetitons=3,5"), "workload.repetitons is not a known key; did you mean workload.repetitions?"),
])
def test_a_typo_without_plus_gets_a_did_you_mean_naming_the_right_key(tmp_path, args, expected):
    """`workload.repetitons=3` got Hydra's 'To append to your config use +workload.repetitons=3', which adds the
    typo, and no word of the key meant."""
    res = run_py(*args, f"hydra.run.dir={tmp_path / 'D'}", f"hydra.sweep.dir={tmp_path / 'S'}",
                 f"run.index_path={tmp_path / 'i.jsonl'}", timeout=120)
    assert res.returncode == 2 and expected in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "i.jsonl").exists()


def test_free_form_mappings_still_take_new_keys():
    conf = prepare(cfg_of("+model.arch.rope_theta=10000.0"))[0]
    assert conf.model.arch["rope_theta"] == 10000.0


@pytest.mark.parametrize("override", ["environment.cpu.threads=1000", "system=fiddler", "system=llama_cpp"])
def test_threads_beyond_the_hosts_cores_are_refused(tmp_path, loads, override):
    """environment.cpu.threads=1000 was accepted and ran 1000 torch threads on 2 cores (1.8 tok/s)."""
    cores = hardware.cpu_cores()
    extra = [] if override.startswith("environment") else \
        [f"system.{'cpu_threads' if override.endswith('fiddler') else 'threads'}={cores + 1}"]
    msg = _refused(tmp_path, loads, override, *extra, "system.adapter=tests.fake_systems:FakeSystem")
    assert f"is more than the {cores} cores this process may use" in msg and msg.endswith(f"allowed: 1..{cores}")


def test_a_described_environment_says_how_to_run_it_here(tmp_path, loads, monkeypatch):
    from runners import provenance

    # on a host whose GPU is paper_env1's (else it is refused as another machine: test_honest_environments)
    monkeypatch.setattr(provenance, "host_gpu", lambda: {"name": "Quadro RTX 6000", "memory_gb": 24.0})
    msg = _refused(tmp_path, loads, "environment=paper_env1")  # 12 cores described
    assert msg.startswith("environment.cpu.threads=") and f"environment.cpu.threads={hardware.cpu_cores()} to run it here" in msg


@pytest.mark.parametrize("make, words", [
    (lambda d: d.mkdir() or d, "is a directory"),
    (lambda d: d.write_text("") or d / "index.jsonl", "is not a directory"),
    # on main the index lock could never be created there and the job waited for it forever
    pytest.param(lambda d: Path("/proc/fiddler-index.jsonl"), "/proc is not writable", marks=pytest.mark.timeout(120)),
])
def test_bad_index_path_fails_before_anything_runs(tmp_path, loads, make, words):
    """An unwritable run.index_path abandoned the sweep after measuring the first configuration; a
    directory gave an IsADirectoryError traceback."""
    path = make(tmp_path / "idx")
    with pytest.raises(ConfigError) as err:
        _job(tmp_path, "workload.input_lens=[8,9]", f"run.index_path={path}")
    assert str(err.value).startswith(f"run.index_path='{path}' ") and words in str(err.value)
    assert not loads.exists()


@pytest.mark.parametrize("spec, words", [
    ("builtins:print", "is a builtin_function_or_method, not a class"),
    ("runners.main:prepare", "is a function, not a class"),
    ("collections:OrderedDict", "is not a SystemAdapter subclass"),  # a class of another kind
    ("systems.base:SystemAdapter", "is abstract"),
    ("no_such_module:FakeSystem", "there is no module no_such_module"),
    ("tests.fake_systems:NoSuchClass", "module tests.fake_systems has no NoSuchClass"),
    ("tests.fake_systems", "is not module:Class"),
])
@pytest.mark.parametrize("mode", ["execute", "simulate"])  # simulate loads no adapter, but refuses a bad one too
def test_system_adapter_must_name_a_system_adapter_class(spec, words, mode):
    with pytest.raises(ConfigError) as err:
        prepare(cfg_of(f"mode={mode}", "model=mixtral_8x7b", f"system.adapter={spec}"))
    msg = str(err.value)
    assert msg.startswith(f"system.adapter={spec!r}") and words in msg and "\n" not in msg
    assert msg.endswith("allowed: module:Class naming a concrete subclass of systems.base.SystemAdapter "
                        "(a system's config class names its own)")


def test_run_py_refuses_a_bad_adapter_with_exit_2_and_a_sweep_refuses_its_job(tmp_path):
    res = run_py("system.adapter=builtins:print", "workload.input_lens=[8]", "workload.output_lens=[4]",
                 f"hydra.run.dir={tmp_path / 'run'}", f"run.index_path={tmp_path / 'i.jsonl'}", timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[0].startswith("error: system.adapter='builtins:print' is a ")
    assert "Traceback" not in res.stderr and not (tmp_path / "i.jsonl").exists()
    # in a sweep the bad job is refused like any refused job, and the others run
    res = run_py("-m", "system.adapter=builtins:print,tests.fake_systems:FakeSystem", "workload.input_lens=[8]",
                 "workload.output_lens=[4]", "workload.repetitions=1", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                 f"run.index_path={tmp_path / 'i.jsonl'}", "run.progress=false", timeout=300)
    assert res.returncode == 1, res.stderr[-2000:]
    errors = [p.read_text() for p in sorted((tmp_path / "sweep").glob("*/job_error.txt"))]
    assert len(errors) == 1 and errors[0].startswith("system.adapter='builtins:print' is a ")
    assert "Traceback" not in res.stderr
    assert [r["status"] for r in read_jsonl(tmp_path / "i.jsonl")] == ["ok"]
