"""The paper experiments (conf/experiment/paper_*.yaml) and scripts/reproduce_paper.py's outputs:
every configuration composes in simulate mode on the paper's four machines, `run.py -m +experiment=...`
runs in a subprocess and labels its tables simulated, the outputs are a function of the records, --out
is replaced by one rename, and SIGINT/SIGTERM stop the script and its children and leave --out as it was."""
from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from hydra import compose, initialize_config_dir

import runners  # noqa: F401
from runners.main import prepare
from runners.records import read_jsonl
from tests.test_cli import run_py
from tests.test_paper_tables import rec, single_batch_records

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = {"paper_single_batch": ([32, 64, 128, 256], [64, 128, 256, 512], [1]),
               "paper_long_prefill": ([512, 1024, 2048, 4096], [1], [1]),
               "paper_beam": ([32], [64], [4, 8, 12, 16])}


def _compose(*overrides, hydra=False):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def _reproduce():
    spec = importlib.util.spec_from_file_location("reproduce_paper_under_test", ROOT / "scripts" / "reproduce_paper.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_every_configuration_of_the_three_experiments_composes_in_simulate_mode():
    jobs = 0
    for exp, grid in EXPERIMENTS.items():
        params = _compose(f"+experiment={exp}", hydra=True).hydra.sweeper.params
        envs, systems = params.environment.split(","), params.system.split(",")
        assert envs == ["rtx3060", "rtx4090", "paper_env1", "paper_env2"]
        # ${paper_systems:}: the config classes with a row in the paper's tables, in the tables' order
        assert systems == ["fiddler_original", "llama_cpp_original", "mixtral_offloading_original", "deepspeed_mii",
                           "fiddler_paper", "fiddler", "llama_cpp", "llama_cpp_cpu_moe", "mixtral_offloading"]
        for env, system in itertools.product(envs, systems):
            cfg = _compose(f"+experiment={exp}", f"environment={env}", f"system={system}")
            conf = prepare(cfg)[0]
            jobs += 1
            assert conf.mode.value == "simulate" and conf.model.name == "mixtral_8x7b"
            assert (conf.workload.input_lens, conf.workload.output_lens, conf.workload.beam_widths) == grid
            if system == "fiddler_paper":
                assert conf.system.name == "fiddler_paper" and conf.system.planner.value == "paper"
            if system == "llama_cpp_cpu_moe":
                assert conf.system.name == "llama_cpp_cpu_moe" and conf.system.n_cpu_moe == -1
            if system == "mixtral_offloading_original":
                assert conf.system.name == "mixtral_offloading_original" and conf.system.original_swap
    assert jobs == 108  # 9 rows x 4 machines x 3 experiments


def test_run_py_runs_an_experiment_in_simulate_mode_and_labels_it(tmp_path):
    """`python run.py -m +experiment=paper_beam`, narrowed to one machine and two systems for time."""
    res = run_py("-m", "+experiment=paper_beam", "environment=rtx3060", "system=fiddler_paper,llama_cpp",
                 f"hydra.sweep.dir={tmp_path / 's'}",
                 f"run.index_path={tmp_path / 'i.jsonl'}", "run.progress=false", timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    recs = read_jsonl(tmp_path / "i.jsonl", strict=True)
    assert len(recs) == 8 and {r["mode"] for r in recs} == {"simulate"}
    assert all(r["environment_info"]["provenance"] == "simulated" for r in recs)
    fiddler = [r for r in recs if r["system"] == "fiddler_paper"]  # a preset's records carry its own name
    assert len(fiddler) == 4 and all(r["status"] == "ok" and r["config"]["system"]["planner"] == "paper"
                                     for r in fiddler)
    table = (tmp_path / "s" / "table.md").read_text()
    assert table.startswith("Numbers: SIMULATED:")
    from tests import md_table

    rows = md_table.dicts(table)
    assert len(rows) == 8 and {r["system"] for r in rows} == {"fiddler_paper", "llama_cpp"}
    assert all(r["numbers"] == "simulated" for r in rows)


def test_outputs_are_a_function_of_the_records_and_publish_removes_stale_files(tmp_path):
    mod = _reproduce()
    # beam: the rows as the paper ran them (summary.md's first part and its prefix-bounds table) and today's
    recs = single_batch_records() + [rec("fiddler_original", "paper_env1", "beam", 32, 64, 4, tok=5.0),
                                     rec("llama_cpp_original", "paper_env1", "beam", 32, 64, 4, tok=0.5),
                                     rec("fiddler_paper", "paper_env1", "beam", 32, 64, 4, tok=4.0),
                                     rec("llama_cpp", "paper_env1", "beam", 32, 64, 4, tok=2.0)]
    outs = []
    for name in ("a", "b"):
        stage = tmp_path / name
        stage.mkdir()
        files = mod.write_outputs(list(recs if name == "a" else reversed(recs)), {}, stage)
        outs.append((files, {p.name: p.read_bytes() for p in stage.iterdir() if p.suffix in (".png", ".pdf", ".svg")}))
    assert outs[0] == outs[1]
    assert {"single_batch.png", "single_batch.pdf", "single_batch.svg", "parity.png"} <= set(outs[0][1])
    files = outs[0][0]
    assert {"single_batch.md", "single_batch.csv", "long_prefill.md", "beam.md", "speedups.md", "speedups.csv",
            "planner.md", "summary.md", "parity.csv"} <= set(files)
    assert files["parity.csv"].splitlines()[0] == "kind,workload,environment,system,what,paper,ours"
    summary = files["summary.md"]
    from tests import md_table

    assert md_table.has_row(summary, "beam", "all four", "1", "over llama.cpp (2024, llama_beam_search)", "10.00x",
                            "11.57x")  # 5.0 / 0.5
    assert md_table.has_row(summary, "prefix measured on the benchmark model (engine's beam search)", "1", "10.00x",
                            "11.57x")
    assert md_table.has_row(summary, "beam", "all four", "1", "over llama.cpp (today) †", "2.00x")  # 4.0 / 2.0
    assert not any(str(tmp_path) in text or "2026" in text for text in files.values())  # no paths or dates
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.md").write_text("from an older layout")
    stage = tmp_path / "a"
    for n, text in files.items():
        (stage / n).write_text(text)
    staged = sorted(p.name for p in stage.iterdir())
    mod.publish(stage, out, keep_validation=False)
    assert sorted(p.name for p in out.iterdir()) == staged
    assert json.dumps(sorted(files)) and not (out / "stale.md").exists()


def test_beyond_the_paper_rows_pair_each_model_card_and_weight_type():
    """results/paper/beyond_the_paper.*: one row per model x card x system x weight type, Fiddler's speedup
    over llama.cpp on the same model, card and weights, and a row whose every cell failed says why."""
    from tests.test_paper_tables import rec

    def r(system, model, quant, i, o, tok, status="ok"):
        out = rec(system, "rtx3060", "single_batch", i, o, tok=tok, ttft=0.5, status=status, quant=quant)
        out["config"]["model"] = {"name": model}
        out["reason"] = None if status == "ok" else "dense part does not fit"
        return out

    recs = [r("fiddler", "m", None, 32, 256, 4.0), r("fiddler", "m", None, 64, 64, 2.0),
            r("llama_cpp", "m", "bf16", 32, 256, 2.0), r("llama_cpp", "m", "bf16", 64, 64, 1.0),
            r("fiddler", "m", "q4_0", 32, 256, 9.0), r("llama_cpp", "m", "q4_0", 32, 256, 3.0),
            r("llama_cpp", "big", "bf16", 32, 256, None, status="skipped")]
    text, csv = _reproduce().beyond_markdown(recs)
    from tests import md_table

    rows = {(r["model"], r["environment"], r["system"], r["weights"]): r for r in md_table.dicts(text)}
    bf16 = rows[("m", "rtx3060", "fiddler", "bf16")]
    assert (bf16["cells ok"], bf16["mean e2e tok/s"], bf16["Fig. 4 e2e tok/s"]) == ("2/2", "3.00", "4.00")
    assert bf16["Fiddler / llama.cpp"] == "2.00x"  # mean 3.0 over llama.cpp's mean 1.5
    assert rows[("m", "rtx3060", "fiddler", "q4_0")]["Fiddler / llama.cpp"] == "3.00x"  # paired at q4_0, not bf16
    assert rows[("big", "rtx3060", "llama_cpp", "bf16")]["cells ok"] == "0/1" and "does not fit" in text
    assert text.startswith("# Beyond the paper") and "SIMULATED" in text and csv.count("\n") == 1 + 5  # header + one row per group


def test_publish_puts_the_staged_directory_in_place_by_a_rename(tmp_path):
    mod = _reproduce()
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.md").write_text("an earlier run's\n")
    (out / "stale.md").write_text("from an older layout\n")
    stage = tmp_path / ".out.new"
    stage.mkdir()
    (stage / "summary.md").write_text("this run's\n")
    staged = stage.stat().st_ino
    mod.publish(stage, out, keep_validation=False)
    assert out.stat().st_ino == staged  # the staged directory itself, so never a mix of old and new files
    assert [p.name for p in out.iterdir()] == ["summary.md"] and (out / "summary.md").read_text() == "this run's\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the earlier one removed, nothing left beside it


def test_publish_keeps_the_earlier_validation_when_validation_is_skipped(tmp_path):
    mod = _reproduce()
    out, stage = tmp_path / "out", tmp_path / ".out.new"
    out.mkdir()
    stage.mkdir()
    (out / "validation.md").write_text("an earlier validation\n")
    mod.publish(stage, out, keep_validation=True)
    assert (out / "validation.md").read_text() == "an earlier validation\n"


def test_an_out_that_holds_directories_is_refused_before_anything_runs(tmp_path, capsys):
    """--out is replaced as a whole: `--out results` would have removed results/reference with it."""
    out = tmp_path / "results"
    (out / "reference").mkdir(parents=True)
    with pytest.raises(SystemExit) as exc:
        _reproduce().main(["--out", str(out)])
    assert exc.value.code == 2 and "holds directories (reference)" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["results"] and (out / "reference").is_dir()


# ------------------------------------------------------------------------------------------ signals
# The run's sweeps take ~780 s of CPU (13 minutes on the shared 2-core machine this was written on), so with
# --jobs 2, 20 s in, it is still running them on a machine 5x faster; on one 5x slower the first two have
# started by then (or are waited for).
SIGNAL_AT_S = 20
EXIT_WITHIN_S = 10  # its shutdown waits STOP_GRACE_S (4 s) at most, then kills what is left


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _is_sweep(p: psutil.Process) -> bool:
    try:
        return "run.py" in p.cmdline()
    except psutil.Error:
        return False


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} (parent {p.ppid()}): {' '.join(p.cmdline()[1:4])}"
    except psutil.Error:
        return str(p.pid)


def _in_groups(groups: set[int]) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) in groups and _alive(p):
                found.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return found


def _files(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.mark.realtime
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_reproduce_paper_and_its_children_and_leaves_out_as_it_was(tmp_path, signum):
    results = tmp_path / "results"
    out = results / "paper"
    out.mkdir(parents=True)
    (out / "summary.md").write_text("an earlier run's\n")
    (out / "stale.md").write_text("from an older layout\n")
    before = _files(results)
    tmp = tmp_path / "tmp"  # where its scratch directory goes
    tmp.mkdir()
    stderr = tmp_path / "stderr.txt"
    start = time.monotonic()
    with open(stderr, "w") as err:
        proc = subprocess.Popen([sys.executable, "scripts/reproduce_paper.py", "--out", str(out), "--jobs", "2"],
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)})
    seen: dict[int, psutil.Process] = {}  # every descendant it had, and their process groups
    groups: set[int] = set()
    try:
        # until 20 s in, and until a sweep has started (seconds; more on a slow machine)
        while time.monotonic() < start + SIGNAL_AT_S or not any(_is_sweep(p) for p in seen.values()):
            assert proc.poll() is None and time.monotonic() - start < 120, stderr.read_text()[-3000:]
            for p in _descendants(proc.pid):
                with contextlib.suppress(psutil.Error, ProcessLookupError):
                    groups.add(os.getpgid(p.pid))
                    seen.setdefault(p.pid, p)
            time.sleep(0.2)
        groups.discard(os.getpgrp())
        assert proc.poll() is None, "it finished before the signal"
        proc.send_signal(signum)
        sent = time.monotonic()
        proc.wait(timeout=3 * EXIT_WITHIN_S)
        took = time.monotonic() - sent
    finally:  # whatever happened, nothing of it keeps running
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        alive = [p for p in seen.values() if _alive(p)] + [p for p in _in_groups(groups) if p.pid not in seen]
        survivors = [_describe(p) for p in alive]
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    assert not survivors, f"child processes outlived it: {survivors}"
    assert not list(tmp.iterdir())  # its scratch directory removed
    assert _files(results) == before  # --out untouched, nothing left beside it
    assert took < EXIT_WITHIN_S, f"exited {took:.1f} s after the signal"
    assert proc.returncode == 128 + signum
    text = stderr.read_text()
    assert text.strip().splitlines()[-1].startswith(f"reproduce_paper: interrupted by {signal.Signals(signum).name}: ")
    assert "Traceback" not in text
