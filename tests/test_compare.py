"""runners/compare.py (and its command, python -m runners.compare): two record sets compared configuration by configuration.
Hand-made records (metrics computed from their raw repetitions by runners/measure.py, as the runner does),
known answers; no timing is measured here."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from runners import compare
from runners.measure import Sample, metrics_of, raw_of
from runners.compare import main

ROOT = Path(__file__).resolve().parents[1]
STEADY = (2.0, 2.02, 1.98, 2.01, 1.99)  # decode seconds of five repetitions, ~1% apart


def rec(system="fiddler", decode=STEADY, *, ttft=0.5, tokens=64, input_len=128, mode="execute", status="ok",
        cpu="Test CPU", workload="single_batch", time="2026-01-01T00:00:00", reason=None, raw=True):
    prov = "simulated" if mode == "simulate" else "measured"
    r = {"schema_version": 1, "run_id": f"{system}-{time}", "time": time, "status": status, "reason": reason,
         "system": system, "model": "m", "workload": workload, "environment": "local", "mode": mode,
         "point": {"input_len": input_len, "output_len": tokens, "beam_width": 1},
         "config": {"system": {"name": system}}, "host": {"cpu_name": cpu},
         "environment_info": {"provenance": prov, "simulated": mode == "simulate"}}
    if status == "ok":
        samples = [Sample(ttft, d, tokens) for d in decode]
        r["metrics"] = metrics_of(samples, input_len, tokens, 1)
        if raw:
            r["raw"] = raw_of(samples)
    return r


def e2e(decode, ttft=0.5, tokens=64):
    return sum(tokens / (ttft + d) for d in decode) / len(decode)


def write(path: Path, recs) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def side(recs, label="x"):
    return compare.Side(label, list(recs))


def rows(a, b, **kw):
    c = compare.compare(side(a, "A"), side(b, "B"), **kw)
    return c, {(r["system"], r["provenance"]): r for r in c.rows.to_dict(orient="records")}


def test_a_clear_speedup_with_repetitions_is_a_change_in_the_right_direction():
    fast = tuple(d / 2 for d in STEADY)
    c, by = rows([rec(decode=STEADY)], [rec(decode=fast)])
    r = by[("fiddler", "measured")]
    assert r["flag"] == "B faster" and r["noise_from"] == "repetitions" and r["pairs"] == 5
    assert r["speedup"] == pytest.approx(e2e(fast) / e2e(STEADY)) and r["speedup"] > 1.6
    assert r["a"] == pytest.approx(e2e(STEADY)) and r["b"] == pytest.approx(e2e(fast))
    assert 0 < r["noise"] < 5  # percent
    assert c.summary["faster"] == 1 and c.summary["compared"] == 1 and c.problem is None
    assert c.summary["geomean_speedup"] == pytest.approx(r["speedup"])
    # the other way round it is slower
    _, back = rows([rec(decode=fast)], [rec(decode=STEADY)])
    assert back[("fiddler", "measured")]["flag"] == "B slower"


def test_lower_is_better_metrics_take_a_over_b():
    _, by = rows([rec(ttft=0.5)], [rec(ttft=0.25)], metric="ttft_s")
    r = by[("fiddler", "measured")]
    assert r["speedup"] == pytest.approx(2.0) and r["a"] == pytest.approx(0.5)
    # every repetition of B has half A's TTFT: all readings equal, so the band is 0 and 5 of 5 agree
    assert r["flag"] == "B faster" and r["paired_speedup"] == pytest.approx(2.0)
    assert "A/B" in compare.convention("ttft_s") and "B/A" in compare.convention("decode_tok_s")


def test_identical_ish_readings_are_within_noise():
    other = (2.01, 1.99, 2.0, 1.98, 2.02)  # the same readings in another order
    _, by = rows([rec(decode=STEADY)], [rec(decode=other)])
    r = by[("fiddler", "measured")]
    assert r["flag"] == "within noise" and r["speedup"] == pytest.approx(1.0)
    assert r["why"].startswith("|")  # |m - 1| <= band


def test_three_repetitions_can_never_be_a_change():
    _, by = rows([rec(decode=STEADY[:3])], [rec(decode=tuple(d / 2 for d in STEADY[:3]))])
    r = by[("fiddler", "measured")]
    assert r["flag"] == "within noise (3 reps: too few to tell)" and "too few for a sign test" in r["why"]
    assert r["speedup"] > 1.6
    # inside the band, three repetitions are simply within noise
    _, by = rows([rec(decode=STEADY[:3])], [rec(decode=STEADY[:3])])
    assert by[("fiddler", "measured")]["flag"] == "within noise"


def test_one_repetition_has_no_noise_estimate():
    c, by = rows([rec(decode=(2.0,))], [rec(decode=STEADY)])
    r = by[("fiddler", "measured")]
    assert r["flag"] == "no noise estimate (1 rep)" and r["why"] == "A has 1, B has 5 repetition(s)"
    assert r["speedup"] == pytest.approx(e2e(STEADY) / e2e((2.0,)))
    assert not compare.present(r["noise"]) and not compare.present(r["a_sd"])  # no ± for one repetition
    assert c.summary["no_noise_estimate"] == 1 and c.summary["compared"] == 1


def test_unequal_repetition_counts_pair_the_first_of_each():
    _, by = rows([rec(decode=STEADY)], [rec(decode=STEADY + (2.0,))])
    r = by[("fiddler", "measured")]
    assert r["pairs"] == 5 and "the first 5 of each paired (A has 5, B has 6)" in r["why"]


def test_per_repetition_readings_are_the_runners_metrics():
    r = rec(decode=(2.0, 4.0), ttft=0.5, tokens=9, input_len=100)
    assert compare.repetitions(r, "decode_tok_s") == ([8 / 2.0, 8 / 4.0], "")
    assert compare.repetitions(r, "e2e_tok_s") == ([9 / 2.5, 9 / 4.5], "")
    assert compare.repetitions(r, "prefill_tok_s") == ([200.0, 200.0], "")
    assert compare.repetitions(r, "ttft_s") == ([0.5, 0.5], "")
    r["metrics"]["decode_tok_s"] = 1.0  # raw that does not give the record's metric is not used
    assert compare.repetitions(r, "decode_tok_s") == (None, "raw does not give metrics.decode_tok_s")


def test_without_raw_the_band_is_the_sds_and_no_verdict():
    _, by = rows([rec(raw=False)], [rec(decode=tuple(d / 2 for d in STEADY), raw=False)])
    r = by[("fiddler", "measured")]
    assert r["flag"] == "no verdict (mean ± sd only)" and r["noise_from"] == "metrics sd"
    a, b = rec(raw=False)["metrics"], rec(decode=tuple(d / 2 for d in STEADY), raw=False)["metrics"]
    band = math.hypot(a["e2e_tok_s_sd"] / a["e2e_tok_s"], b["e2e_tok_s_sd"] / b["e2e_tok_s"])
    assert r["noise"] == pytest.approx(100 * band) and "metrics sd" in r["note"]


def test_simulated_rows_are_matched_only_with_simulated_rows():
    a = [rec("fiddler", STEADY), rec("fiddler", (4.0,), mode="simulate"), rec("llama_cpp", (3.0,), mode="simulate")]
    b = [rec("fiddler", (1.0,), mode="simulate"), rec("llama_cpp", STEADY)]
    c, by = rows(a, b)
    sim = by[("fiddler", "simulated")]
    assert sim["speedup"] == pytest.approx(e2e((1.0,)) / e2e((4.0,)))  # simulated with simulated, nothing averaged
    assert sim["a"] == pytest.approx(e2e((4.0,))) and sim["b"] == pytest.approx(e2e((1.0,)))
    assert by[("fiddler", "measured")]["flag"] == "only in A"  # the measured fiddler has no measured partner
    refused = by[("llama_cpp", "A simulated / B measured")]
    assert refused["flag"] == "refused" and "A is simulated, B is measured" in refused["note"]
    assert not compare.present(refused.get("speedup")) and not compare.present(refused.get("a"))
    assert len(c.rows) == 3 and c.summary["refused"] == 1 and c.summary["compared"] == 1 and c.problem is None


def test_all_simulated_against_all_measured_is_refused():
    c, _ = rows([rec("fiddler", mode="simulate")], [rec("fiddler")])
    assert c.problem.startswith("A is simulated, B is measured: refusing to compare")


def test_a_configuration_on_one_side_only_is_shown():
    c, by = rows([rec("fiddler"), rec("llama_cpp")], [rec("fiddler"), rec("hf_transformers")])
    assert by[("llama_cpp", "measured")]["flag"] == "only in A"
    assert by[("hf_transformers", "measured")]["flag"] == "only in B"
    assert not compare.present(by[("llama_cpp", "measured")].get("b"))
    assert by[("hf_transformers", "measured")]["b"] == pytest.approx(e2e(STEADY))
    assert (c.summary["only_a"], c.summary["only_b"], c.summary["compared"]) == (1, 1, 1)


def test_a_status_that_is_not_ok_has_no_speedup():
    c, by = rows([rec()], [rec(status="error", reason="boom: out of memory")])
    r = by[("fiddler", "measured")]
    assert r["flag"] == "B error" and not compare.present(r.get("speedup"))
    assert r["a_status"] == "ok" and r["b_status"] == "error" and r["note"] == "B: boom: out of memory"
    assert c.summary["not_ok"] == 1 and c.summary["compared"] == 0 and c.problem is None
    _, by = rows([rec(status="skipped", reason="no GPU")], [rec(status="skipped", reason="no GPU")])
    r = by[("fiddler", "measured")]
    assert (r["flag"], r["note"]) == ("A, B skipped", "A, B: no GPU")


def test_different_cpus_are_compared_with_a_note():
    _, by = rows([rec(cpu="CPU one")], [rec(cpu="CPU two")])
    r = by[("fiddler", "measured")]
    assert r["flag"] == "within noise" and r["note"] == "different CPUs: A CPU one, B CPU two"


def test_the_latest_record_of_a_configuration_counts_and_where_filters():
    a = [rec(decode=(9.0,) * 5, time="2026-01-02T00:00:00"), rec(decode=STEADY, time="2026-01-01T00:00:00"),
         rec("fiddler", workload="beam")]
    c, by = rows(a, [rec(decode=(9.0,) * 5)], where={"workload": "single_batch"})
    assert len(c.rows) == 1 and by[("fiddler", "measured")]["speedup"] == pytest.approx(1.0)
    with pytest.raises(compare.CompareError, match="want KEY=VALUE"):
        compare.parse_where(["colour=red"])


def test_a_git_revision_against_a_directory(tmp_path):
    repo = tmp_path / "repo"
    write(repo / "results" / "old.jsonl", [rec(decode=STEADY), rec("llama_cpp")])
    with open(repo / "results" / "old.jsonl", "a") as f:
        f.write('{"status": "ok"}\n')  # a damaged line: reported with the revision, file and line, and skipped
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "records"], check=True)
    (repo / "results" / "old.jsonl").write_text("")  # the working tree's copy is not what is read
    sha = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    newdir = tmp_path / "new"
    write(newdir / "run1" / "records.jsonl", [rec(decode=tuple(d / 2 for d in STEADY))])

    with pytest.warns(UserWarning, match=rf"{sha[:9]}:results/old.jsonl:3: damaged record line skipped"):
        a = compare.load(f"{sha[:9]}:results", repo)
    assert a.label == f"{sha[:9]}:results ({sha[:12]})" and len(a.records) == 2
    with pytest.warns(UserWarning, match="HEAD:results/old.jsonl:3"):
        assert len(compare.load("HEAD", repo).records) == 2  # default path results/
    c = compare.compare(a, compare.load(str(newdir)))
    by = {r["system"]: r for r in c.rows.to_dict(orient="records")}
    assert by["fiddler"]["flag"] == "B faster" and by["llama_cpp"]["flag"] == "only in A"

    with pytest.raises(compare.CompareError, match="holds no committed"):
        compare.load("HEAD:nowhere", repo)
    with pytest.raises(compare.CompareError, match="neither an existing file or directory nor a git revision"):
        compare.load("no-such-rev", repo)
    # an existing path wins over a revision of the same name
    write(tmp_path / "cwd" / "HEAD" / "records.jsonl", [rec("only_here")])
    import os
    old = os.getcwd()
    os.chdir(tmp_path / "cwd")
    try:
        here = compare.load("HEAD", repo)
    finally:
        os.chdir(old)
    assert here.label == "HEAD" and [r["system"] for r in here.records] == ["only_here"]


def test_exit_2_cases(tmp_path, capsys):
    a = write(tmp_path / "a.jsonl", [rec("fiddler")])
    b = write(tmp_path / "b.jsonl", [rec("llama_cpp")])
    sim = write(tmp_path / "sim.jsonl", [rec("fiddler", mode="simulate")])
    empty = tmp_path / "emptydir"
    empty.mkdir()
    cases = {
        (str(a), str(b)): "A and B share no configuration (1 only in A, 1 only in B)",
        (str(sim), str(a)): "A is simulated, B is measured: refusing to compare",
        (str(a), str(tmp_path / "missing.jsonl")): "is neither an existing file or directory nor a git revision",
        (str(a), str(empty)): "holds no usable records (below a directory only records.jsonl",
        (str(a), str(a), "--where", "nokey=1"): "want KEY=VALUE",
        (str(a), str(a), "--where", "system=nobody"): "A and B have no records matching --where",
    }
    for argv, message in cases.items():
        assert main([*argv, "--repo", str(tmp_path)]) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)
    assert main([str(a), str(a), "--metric", "tokens"]) == 2  # argparse: not a metric
    assert "invalid choice" in capsys.readouterr().err
    assert main([str(a), str(a), "--tolerance", "-1"]) == 2


def test_the_cli_prints_a_table_and_json_parses_back(tmp_path):
    a = write(tmp_path / "a.jsonl", [rec("fiddler", STEADY), rec("llama_cpp", (3.0,)), rec("mixtral_offloading")])
    b = write(tmp_path / "b" / "x" / "records.jsonl",
              [rec("fiddler", tuple(d / 2 for d in STEADY)), rec("llama_cpp", (3.0,)),
               rec("mixtral_offloading", status="oom", reason="too big")])
    run = subprocess.run([sys.executable, "-m", "runners.compare", str(a), str(tmp_path / "b")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert lines[0] == f"A: {a} (3 records) · B: {tmp_path / 'b'} (3 records) · metric: e2e_tok_s (e2e tok/s)"
    assert lines[2].startswith("speedup = B/A")
    assert lines[-1] == ("2 configs compared, geometric mean speedup "
                         f"{math.sqrt(e2e(tuple(d / 2 for d in STEADY)) / e2e(STEADY)):.3f}x: 1 B faster, 0 B slower, "
                         "0 within noise; 1 without a noise estimate; 1 not ok")
    table = [l for l in lines if l.startswith("| ")]
    assert table[0].split("|")[1].strip() == "system" and len(table) == 4
    assert "workload: single_batch" in run.stdout and "numbers: measured" in run.stdout  # constant keys lifted
    fid = next(l for l in table if l.startswith("| fiddler "))
    assert "B faster" in fid and " ± " in fid

    run = subprocess.run([sys.executable, "-m", "runners.compare", str(a), str(tmp_path / "b"), "--format", "json",
                          "--where", "system=mixtral_offloading"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    (row,) = json.loads(run.stdout)
    assert (row["system"], row["flag"], row["a_status"], row["b_status"], row["speedup"]) == \
        ("mixtral_offloading", "B oom", "ok", "oom", None)
    assert row["note"] == "B: too big" and row["a"] == pytest.approx(e2e(STEADY), rel=1e-5)
    assert run.stderr.splitlines()[-1].startswith("0 configs compared")


def test_machine_formats_keep_the_raw_columns(tmp_path, capsys):
    a = write(tmp_path / "a.jsonl", [rec()])
    assert main([str(a), str(a), "--format", "jsonl"]) == 0
    (row,) = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert row["speedup"] == 1.0 and row["flag"] == "within noise" and row["pairs"] == 5 and row["a_reps"] == 5
    assert main([str(a), str(a), "--format", "csv", "--metric", "decode_tok_s"]) == 0
    head, first = capsys.readouterr().out.splitlines()
    assert head.split(",")[:2] == ["system", "variant"] and "within noise" in first
