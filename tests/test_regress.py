"""scripts/regress.py's judging and floor bookkeeping (the suite itself is replaced by fixed readings)."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def regress(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("regress_under_test", ROOT / "scripts" / "regress.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "FLOORS", tmp_path / "floors.yaml")
    monkeypatch.setattr(mod, "cpu_name", lambda: "Test CPU")
    monkeypatch.delenv("FIDDLER_KERNEL_ISA", raising=False)
    readings = {"values": {"k_up": 1.0, "p_down": 0.1}, "skipped": [], "reruns": []}

    def fake_suite(quick, select, nodes=None, rounds=None, root=mod.ROOT):
        values = readings["values"]
        if root != mod.ROOT:  # the reference build of the side-by-side check (a list: in turn)
            readings.setdefault("ref_runs", []).append(nodes)
            readings.setdefault("order", []).append("ref")
            values = readings["ref_values"]
            values = values.pop(0) if isinstance(values, list) else values
        elif nodes is not None and "ref_runs" in readings:  # this build, side by side
            readings.setdefault("order", []).append("this")
            values = readings.get("this_values", values)
            values = values.pop(0) if isinstance(values, list) else values
        elif nodes is not None:  # a confirmation run: the next readings, if a test set them (a list: in turn)
            readings["reruns"].append(nodes)
            readings.setdefault("rounds", []).append(rounds)
            again = readings.get("again", values)
            values = (again.pop(0) if len(again) > 1 else again[0]) if isinstance(again, list) else again
        ratios = [{"name": n, "value": v, "direction": "lower" if n.startswith("p_") else "higher",
                   "what": n, "sides": {}, "test": f"benchmarks/test_x.py::test_{n}",
                   **({"path": readings["paths"][n]} if n in readings.get("paths", {}) else {})}
                  for n, v in values.items()]
        if nodes is not None:  # pytest runs only the nodes given
            ratios = [r for r in ratios if r["test"] in nodes]
        return ratios, readings["skipped"], 0

    monkeypatch.setattr(mod, "run_suite", fake_suite)
    monkeypatch.setattr(mod, "reference_build", lambda commit, dest: readings.setdefault("built", []).append(commit)
                        or readings.get("build_error"))
    monkeypatch.setattr(mod, "nodes_in", lambda root, nodes: [n for n in nodes if n not in readings.get("ref_lacks", ())])
    git_answers = {"status": " M fiddler/x.py", "rev-parse": "c0ffee" * 6 + "abcd"}  # dirty: no reference
    monkeypatch.setattr(mod, "git", lambda *a: git_answers[a[0]])
    readings["git"] = git_answers
    monkeypatch.setattr(mod.time, "sleep", lambda s: readings.setdefault("pauses", []).append(s))
    mod.readings = readings
    return mod


def floors(mod) -> dict:
    return yaml.safe_load(mod.FLOORS.read_text())["classes"]["avx512"]["quick"]


def test_update_needs_three_readings_then_derives_the_floor_from_the_windows_low_quantile(regress, capsys):
    args = ["--quick", "--update", "--class", "avx512"]
    assert regress.main(args) == 0 and floors(regress)["k_up"]["floor"] is None  # one reading moves nothing
    regress.main(args)
    assert floors(regress)["k_up"]["floor"] is None
    regress.main(args)
    f = floors(regress)
    assert f["k_up"]["floor"] == pytest.approx(0.85) and f["p_down"]["floor"] == pytest.approx(0.115)
    for _ in range(2):
        regress.main(args)  # five readings of 1.0 / 0.1
    regress.readings["values"] = {"k_up": 0.5, "p_down": 0.5}  # one bad run among five moves nothing
    regress.main(args)
    f = floors(regress)
    assert f["k_up"]["floor"] == pytest.approx(0.85) and f["p_down"]["floor"] == pytest.approx(0.115)
    capsys.readouterr()
    regress.main(args)  # a second one: the window's second worst is 0.5 now, and the floor follows it down
    f = floors(regress)
    assert f["k_up"]["floor"] == pytest.approx(0.425) and f["p_down"]["floor"] == pytest.approx(0.575)
    assert "k_up: 0.85 -> 0.425 (looser: the window's readings support no more)" in capsys.readouterr().out
    regress.readings["values"] = {"k_up": 3.0, "p_down": 0.1}  # a few high readings (a quiet moment) ...
    for _ in range(3):
        regress.main(args)
    f = floors(regress)
    assert [x["value"] for x in f["k_up"]["readings"]] == [1.0] * 3 + [0.5] * 2 + [3.0] * 3  # the last 8
    assert all(isinstance(x["load"], float) for x in f["k_up"]["readings"])  # how busy the machine was: a note
    assert f["k_up"]["floor"] == pytest.approx(0.425)  # ... do not lift the floor above the others
    for _ in range(3):
        regress.main(args)
    assert floors(regress)["k_up"]["floor"] == pytest.approx(0.425)  # [0.5, 0.5, 3.0 x 6]: 0.5 is the second worst
    regress.main(args)
    assert floors(regress)["k_up"]["floor"] == pytest.approx(2.55)  # [0.5, 3.0 x 7]: the one 0.5 left is an outlier


def test_the_low_quantile_is_a_reading_of_the_window(regress):
    assert regress.low_reading([3.0, 1.0, 2.0], higher=True) == 1.0  # three or four readings: the worst
    assert regress.low_reading([3.0, 1.0, 2.0, 4.0], higher=False) == 4.0
    assert regress.low_reading([5.0, 1.0, 4.0, 2.0, 3.0], higher=True) == 2.0  # five to eight: the second worst
    assert regress.low_reading([5.0, 1.0, 4.0, 2.0, 3.0], higher=False) == 4.0
    assert regress.low_reading([9.0, 8.0, 7.0, 6.5, 6.4, 44.0, 110.0, 142.0], higher=True) == 6.5


def test_other_cpus_readings_hold_a_floor_down(regress, monkeypatch):
    for _ in range(3):
        regress.main(["--quick", "--update", "--class", "avx512"])
    data = yaml.safe_load(regress.FLOORS.read_text())
    data["classes"]["avx512"]["quick"]["k_up"]["readings"].insert(0, {"value": 0.6, "cpu": "Other CPU"})
    regress.FLOORS.write_text(yaml.safe_dump(data))
    regress.readings["values"]["k_up"] = 3.0
    for _ in range(3):
        regress.main(["--quick", "--update", "--class", "avx512"])
    f = floors(regress)["k_up"]
    assert f["floor"] == pytest.approx(0.51)  # the class must pass on the other CPU too: 0.6 less the margin
    assert f["cpu_floors"] == {"Test CPU": pytest.approx(0.85)}  # this CPU's own: 1.0 is still its second worst


def test_judging_names_each_failure(regress, capsys):
    for _ in range(3):
        regress.main(["--quick", "--update", "--class", "avx512"])
    capsys.readouterr()
    assert regress.main(["--quick", "--class", "avx512"]) == 0
    out = capsys.readouterr().out
    assert "k_up" in out and "pass" in out and "FAIL" not in out
    regress.readings["values"] = {"k_up": 0.8, "p_down": 0.2}
    assert regress.main(["--quick", "--class", "avx512"]) == 1
    cap = capsys.readouterr()
    assert "FAILED k_up = 0.8 < floor 0.85" in cap.err and "p_down = 0.2 > floor" in cap.err
    assert "readings 0.8, 0.8, 0.8, 0.8" in cap.out  # measured again after each pause, crossed each time
    assert regress.readings["reruns"][-1] == ["benchmarks/test_x.py::test_k_up", "benchmarks/test_x.py::test_p_down"]


def test_a_crossing_is_measured_again_and_fails_only_if_it_crosses_again(regress, capsys):
    for _ in range(3):
        regress.main(["--quick", "--update", "--class", "avx512"])
    regress.readings["values"] = {"k_up": 0.6, "p_down": 0.1}
    regress.readings["again"] = {"k_up": 0.95, "p_down": 0.3}  # p_down passed the first time: not re-judged
    assert regress.main(["--quick", "--class", "avx512"]) == 0
    cap = capsys.readouterr()
    assert "readings 0.6, 0.95  -> pass" in cap.out and regress.readings["reruns"] == [["benchmarks/test_x.py::test_k_up"]]
    assert regress.readings["rounds"] == [10]  # twice the quick suite's rounds
    assert "pauses" not in regress.readings  # the first re-measurement is right away

    # a busy phase that outlasts the first re-measurements: cleared by a later one, after the pauses
    regress.readings["reruns"].clear()
    regress.readings["again"] = [{"k_up": 0.7, "p_down": 0.1}, {"k_up": 0.8, "p_down": 0.1}, {"k_up": 0.9, "p_down": 0.1}]
    assert regress.main(["--quick", "--class", "avx512"]) == 0
    assert "readings 0.6, 0.7, 0.8, 0.9  -> pass" in capsys.readouterr().out
    assert len(regress.readings["reruns"]) == 3 and regress.readings["pauses"] == list(regress.CONFIRM_PAUSES_S[1:3])

    # a regression crosses every time: every reading is taken, the best one is judged, and it fails
    regress.readings["reruns"].clear()
    regress.readings["again"] = {"k_up": 0.7, "p_down": 0.1}
    assert regress.main(["--quick", "--class", "avx512"]) == 1
    cap = capsys.readouterr()
    assert "FAILED k_up = 0.7 < floor 0.85" in cap.err  # the best reading is still below
    assert "readings 0.6" + ", 0.7" * len(regress.CONFIRM_PAUSES_S) + "  -> FAIL" in cap.out
    assert len(regress.readings["reruns"]) == len(regress.CONFIRM_PAUSES_S)
    regress.readings["values"] = {"k_up": 0.6, "p_down": 0.1}
    assert regress.main(["--quick", "--class", "avx512", "--update"]) == 0  # --update records, never re-measures
    assert len(regress.readings["reruns"]) == len(regress.CONFIRM_PAUSES_S)


def test_update_makes_its_commit_the_reference_build_only_from_a_clean_tree(regress):
    regress.main(["--quick", "--update", "--class", "avx512"])
    assert "reference" not in yaml.safe_load(regress.FLOORS.read_text())  # uncommitted changes: not a build
    regress.readings["git"]["status"] = " M results/regression/floors.yaml"  # the floors file itself may differ
    regress.main(["--quick", "--update", "--class", "avx512"])
    ref = yaml.safe_load(regress.FLOORS.read_text())["reference"]
    assert ref["commit"] == regress.readings["git"]["rev-parse"] and ref["cpu"] == "Test CPU"
    for _ in range(2):
        regress.main(["--quick", "--update", "--class", "avx512"])  # floors now set
    regress.readings["git"]["rev-parse"] = "bad" * 13 + "b"
    regress.readings["values"] = {"k_up": 0.5, "p_down": 0.1}  # this build is below a floor: never the yardstick
    regress.main(["--quick", "--update", "--class", "avx512"])
    assert yaml.safe_load(regress.FLOORS.read_text())["reference"]["commit"] == ref["commit"]


def test_update_of_a_selection_records_its_readings_but_never_moves_the_reference(regress, capsys):
    """--update -k seeds a new benchmark's floors; a partial run cannot vouch for the floors it did not
    read, so even a clean tree does not become the reference build."""
    regress.readings["git"]["status"] = ""
    for _ in range(3):
        assert regress.main(["--quick", "--update", "-k", "p_down", "--class", "avx512"]) == 0
    data = yaml.safe_load(regress.FLOORS.read_text())
    assert "reference" not in data
    assert len(floors(regress)["p_down"]["readings"]) == 3 and floors(regress)["p_down"]["floor"] is not None
    assert "reference build unchanged (-k" in capsys.readouterr().out


def test_a_ratio_crossing_at_every_reading_is_judged_side_by_side_with_the_reference(regress, capsys):
    regress.readings["git"]["status"] = ""
    for _ in range(3):
        regress.main(["--quick", "--update", "--class", "avx512"])
    capsys.readouterr()
    sha = regress.readings["git"]["rev-parse"]
    # a busy machine: every reading crosses, and the reference build reads as low side by side
    regress.readings["values"] = {"k_up": 0.6, "p_down": 0.2}
    regress.readings["ref_values"] = {"k_up": 0.63, "p_down": 0.19}
    assert regress.main(["--quick", "--class", "avx512"]) == 0
    cap = capsys.readouterr()
    assert regress.readings["built"] == [sha] and len(regress.readings["ref_runs"]) == regress.AB_ROUNDS
    assert regress.readings["ref_runs"][0] == ["benchmarks/test_x.py::test_k_up", "benchmarks/test_x.py::test_p_down"]
    assert "this/reference 0.952 (median of rounds): within noise" in cap.out
    assert "this/reference 1.053 (median of rounds): within noise" in cap.out
    assert "k_up, p_down only side by side with the reference build" in cap.out
    # a regression: the reference build reads well in the same window
    regress.readings["ref_values"] = {"k_up": 0.9, "p_down": 0.1}
    assert regress.main(["--quick", "--class", "avx512"]) == 1
    cap = capsys.readouterr()
    assert "this/reference 0.667 (median of rounds): changed (head/base lower)" in cap.out
    assert "this/reference 2.000 (median of rounds): changed (head/base higher)" in cap.out
    assert "FAILED k_up = 0.6 < floor 0.85" in cap.err
    # no reference to compare with: the crossing stands
    regress.readings["ref_values"] = {"k_up": 0.6, "p_down": 0.2}
    regress.readings["build_error"] = "building c0ffee failed: no compiler"
    assert regress.main(["--quick", "--class", "avx512"]) == 1
    cap = capsys.readouterr()
    assert "no side-by-side check: building c0ffee failed" in cap.err and "FAILED k_up" in cap.err


def test_a_benchmark_the_reference_lacks_stays_failed_and_the_others_are_still_judged(regress, capsys):
    """CI once could not run the side-by-side at all: the reference build predated one crossing ratio's
    benchmark, and pytest given one missing node runs none (exit 4)."""
    regress.readings["git"]["status"] = ""
    for _ in range(3):
        regress.main(["--quick", "--update", "--class", "avx512"])
    capsys.readouterr()
    regress.readings["values"] = {"k_up": 0.6, "p_down": 0.2}
    regress.readings["ref_values"] = {"k_up": 0.61, "p_down": 0.2}
    regress.readings["ref_lacks"] = ["benchmarks/test_x.py::test_p_down"]
    assert regress.main(["--quick", "--class", "avx512"]) == 1
    cap = capsys.readouterr()
    assert all(run == ["benchmarks/test_x.py::test_k_up"] for run in regress.readings["ref_runs"])
    assert "has no benchmarks/test_x.py::test_p_down; its ratios stay failed" in cap.err
    assert "FAILED p_down" in cap.err and "FAILED k_up" not in cap.err


def test_nodes_in_finds_a_benchmark_by_its_file_and_function(tmp_path):
    spec = importlib.util.spec_from_file_location("regress_nodes_in", ROOT / "scripts" / "regress.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    real = mod.nodes_in
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "test_a.py").write_text("def test_one(x):\n    pass\n\n\n    def test_inner():\n")
    nodes = ["benchmarks/test_a.py::test_one[4]", "benchmarks/test_a.py::TestK::test_inner", "benchmarks/test_a.py::test_two",
             "benchmarks/test_b.py::test_one"]
    assert real(tmp_path, nodes) == ["benchmarks/test_a.py::test_one[4]", "benchmarks/test_a.py::TestK::test_inner"]


def test_side_by_side_is_judged_round_by_round_not_by_one_quiet_moment(regress, capsys):
    """CI once failed planner_paper_e128k8_t1 side by side (this/reference 1.243 from the best of 2
    alternations) and passed on a quiet rerun. Readings are paired by round, the order alternated (ABBA),
    and judged by scripts/ab.py's noise rule: one round where the reference caught a quiet moment is noise;
    an effect in every round is a regression."""
    regress.readings["git"]["status"] = ""
    for _ in range(3):
        regress.main(["--quick", "--update", "--class", "avx512"])
    capsys.readouterr()
    busy = {"k_up": 0.6, "p_down": 0.2}
    regress.readings["values"] = busy
    # the reference caught one quiet moment (round 1); otherwise both builds read alike
    ref = [0.9, 0.61, 0.58, 0.6, 0.62, 0.59, 0.6]
    this = [0.6, 0.6, 0.59, 0.61, 0.6, 0.6, 0.6]
    regress.readings["ref_values"] = [{"k_up": v, "p_down": 0.2} for v in ref]
    regress.readings["this_values"] = [{"k_up": v, "p_down": 0.2} for v in this]
    assert regress.main(["--quick", "--class", "avx512"]) == 0
    out = capsys.readouterr().out
    n = len(regress.readings["ref_runs"])
    assert n >= 5  # the sign test of scripts/ab.py needs 5 rounds to tell anything
    assert regress.readings["order"][:4] == ["ref", "this", "this", "ref"]  # ABBA: neither build always first
    assert "k_up" in out and "within noise" in out
    # a regression: this build reads low in every round, side by side
    regress.readings.pop("ref_runs"), regress.readings.pop("order")
    regress.readings["ref_values"] = [{"k_up": 0.9, "p_down": 0.2} for _ in range(n)]
    regress.readings["this_values"] = [{"k_up": 0.6, "p_down": 0.2} for _ in range(n)]
    assert regress.main(["--quick", "--class", "avx512"]) == 1
    cap = capsys.readouterr()
    assert "changed" in cap.out and "FAILED k_up = 0.6 < floor 0.85" in cap.err


def test_machine_state_reads_steal_and_load(regress):
    since = regress.cpu_times()
    assert since is not None and 0 <= since[0] <= since[1]
    line = regress.machine_state((since[0], since[1] - 100))
    assert "steal" in line and "% of vCPU time" in line and "load" in line


def test_missing_and_skipped_ratios(regress, capsys):
    for _ in range(3):
        regress.main(["--quick", "--update", "--class", "avx512"])
    regress.readings["values"] = {"k_up": 1.0}
    assert regress.main(["--quick", "--class", "avx512"]) == 2  # a floor without a reading is not a pass
    assert "p_down" in capsys.readouterr().err
    regress.readings["skipped"] = [{"ratios": ["p_down"], "reason": "llama-cpp-python is not installed"}]
    assert regress.main(["--quick", "--class", "avx512"]) == 0
    assert "skipped" in capsys.readouterr().out


def test_lowering_needs_a_reason_and_keeps_it(regress):
    for _ in range(3):
        regress.main(["--quick", "--update", "--class", "avx512"])
    with pytest.raises(SystemExit):
        regress.main(["--quick", "--class", "avx512", "--lower", "k_up=0.5"])
    assert regress.main(["--quick", "--class", "avx512", "--lower", "k_up=0.5", "--reason", "new torch is faster"]) == 0
    e = floors(regress)["k_up"]
    assert e["floor"] == 0.5 and e["lowered"][0]["reason"] == "new torch is faster" and e["lowered"][0]["from"] == 0.85
    # a value above the class floor lowers only the CPU floors above it, never raises the class floor
    assert regress.main(["--quick", "--class", "avx512", "--lower", "k_up=0.7", "--reason", "one CPU reads lower"]) == 0
    e = floors(regress)["k_up"]
    assert e["floor"] == 0.5 and e["cpu_floors"]["Test CPU"] == 0.5
    assert [x["to"] for x in e["lowered"]] == [0.5, 0.5]
    with pytest.raises(SystemExit, match="no floor named"):
        regress.main(["--quick", "--class", "avx512", "--lower", "nope=1", "--reason", "x"])


def test_a_lowering_caps_the_floors_later_updates_derive(regress, monkeypatch):
    """Readings beside busy neighbours can all sit far above a quiet run (a Zen 4 read the engine against
    transformers at 15-142 under load, 6.5 in CI): a lowering with its reason holds against them."""
    args = ["--quick", "--update", "--class", "avx512"]
    for _ in range(3):
        regress.main(args)
    assert regress.main(["--quick", "--class", "avx512", "--lower", "k_up=0.5", "--reason", "quiet runs read 0.7"]) == 0
    regress.readings["values"] = {"k_up": 3.0, "p_down": 0.1}
    for _ in range(8):
        regress.main(args)  # a whole window of high readings
    f = floors(regress)["k_up"]
    assert f["floor"] == 0.5 and f["cpu_floors"] == {"Test CPU": 0.5}
    monkeypatch.setattr(regress, "cpu_name", lambda: "Slow CPU")
    regress.readings["values"] = {"k_up": 0.3, "p_down": 0.1}
    for _ in range(3):
        regress.main(args)  # below the cap: the readings rule
    f = floors(regress)["k_up"]
    assert f["floor"] == pytest.approx(0.255) and f["cpu_floors"]["Slow CPU"] == pytest.approx(0.255)
    assert regress.lowering_caps({"lowered": [{"to": 0.5, "cpu_floors_at_most": 0.7}, {"to": 0.4}]}, True) == (0.4, 0.4)
    assert regress.lowering_caps({"lowered": [{"to": 0.5, "cpu_floors_at_most": 0.7}]}, False) == (0.5, 0.7)
    assert regress.lowering_caps({}, True) == (None, None)


def test_floors_are_chosen_by_the_kernel_path_the_cpu_runs(regress):
    avx512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
    assert regress.cpu_class(avx512 | {"avx512_bf16", "amx_tile", "amx_bf16"}) == "amx"  # Sapphire Rapids
    assert regress.cpu_class(avx512 | {"avx512_bf16", "avx512_vnni"}) == "avx512_bf16"  # AMD Zen 4 / 5
    assert regress.cpu_class(avx512) == "avx512"  # AVX-512 without BF16 (Skylake-SP to Ice Lake): bf16 widened on zmm
    assert regress.cpu_class(avx512 - {"avx512dq"}) == "avx2"  # Knights Landing: no DQ, the AVX2 path
    assert regress.cpu_class({"avx2", "fma"}) == "avx2"
    assert regress.cpu_class(avx512 | {"avx512_bf16", "amx_tile", "amx_bf16"}, "avx512_bf16") == "avx512_bf16"
    assert regress.cpu_class(avx512 | {"avx512_bf16"}, "avx2") == "avx2" and regress.cpu_class(avx512, "auto") == "avx512"


def test_committed_floors_cover_every_path_class():
    data = yaml.safe_load((ROOT / "results" / "regression" / "floors.yaml").read_text())
    floored = ("kernel_vs_torch_t1", "kernel_vs_limit_t1", "engine_decode_vs_transformers",
               "planner_vs_python_makespan_e128k8_t1", "batch_decode16_vs_1")
    for cls, names in (("amx", floored + ("kernel_vs_limit_t64",)), ("avx512_bf16", floored), ("avx512", floored),
                       ("avx2", floored)):
        quick = data["classes"][cls]["quick"]
        for name in names:
            assert quick[name]["floor"] is not None, (cls, name)
    # compute-bound on vdpbf16ps from 64 tokens and on AVX2 from 16: reported there, never floored
    # (benchmarks/test_kernel_ratios.py COMPUTE_BOUND_FROM)
    from benchmarks.test_kernel_ratios import COMPUTE_BOUND_FROM, TOKENS

    for cls, start in COMPUTE_BOUND_FROM.items():
        for t in (t for t in TOKENS if t >= start):
            e = data["classes"].get(cls, {}).get("quick", {}).get(f"kernel_vs_limit_t{t}", {})
            assert e.get("floor") is None and not e.get("cpu_floors"), (cls, t)
    # every reading of a class ran its path (a forced path says so in the reading's CPU); the quantized experts
    # take the CPU's best quantized path, which needs VNNI, not BF16: an avx2-class CPU may run them on VNNI
    paths = {"amx": ("avx512_bf16", "avx512_vnni"), "avx512_bf16": ("avx512_bf16", "avx512_vnni"),
             "avx512": ("avx512",), "avx2": ("avx2",)}
    for cls, ok in paths.items():
        for name, e in data["classes"][cls]["quick"].items():
            allowed = ok + ("avx512_vnni",) if name.startswith("quant_") else ok
            for x in e["readings"]:
                # the path's name before "+amx" or ":mode" (a prefix would let "avx512" pass "avx512_bf16")
                assert x.get("path") is None or re.split("[+:]", x["path"])[0] in allowed, (cls, name, x)
                assert cls != "avx2" or "+amx" not in (x.get("path") or ""), (cls, name, x)
                assert cls != "avx512_bf16" or "+amx" not in (x.get("path") or ""), (cls, name, x)


def _mark_report_only(regress, name: str, why: str) -> None:
    """The fake suite's reading of `name` marked report_only, as a benchmark marks a ratio its path makes meaningless."""
    real = regress.run_suite

    def suite(*a, **kw):
        ratios, skipped, rc = real(*a, **kw)
        return [{**r, "report_only": why} if r["name"] == name else r for r in ratios], skipped, rc

    regress.run_suite = suite


def test_a_report_only_ratio_is_recorded_and_printed_but_never_floored(regress, capsys):
    """kernel_vs_limit at 64+ tokens on vdpbf16ps reads the compute peak, not the stream: its benchmark
    marks it report_only, and no reading, however low, fails or seeds a floor."""
    regress.readings["values"] = {"k_up": 1.0, "p_down": 0.1, "k_limit": 0.09}
    _mark_report_only(regress, "k_limit", "compute-bound on avx512_bf16 from 64 tokens")
    for _ in range(3):
        assert regress.main(["--quick", "--update", "--class", "avx512_bf16"]) == 0
    f = yaml.safe_load(regress.FLOORS.read_text())["classes"]["avx512_bf16"]["quick"]
    assert f["k_limit"]["floor"] is None and "k_limit" not in (f["k_limit"].get("cpu_floors") or {})
    assert len(f["k_limit"]["readings"]) == 3 and f["k_up"]["floor"] is not None
    capsys.readouterr()
    regress.readings["values"] = {"k_up": 1.0, "p_down": 0.1, "k_limit": 0.001}
    assert regress.main(["--quick", "--class", "avx512_bf16"]) == 0
    out = capsys.readouterr().out
    assert "report" in out and "reported, not floored: compute-bound on avx512_bf16 from 64 tokens" in out
    assert regress.readings["reruns"] == []


def test_a_floored_ratio_that_its_path_makes_report_only_loses_its_floor_at_the_next_update(regress, capsys):
    """kernel_vs_limit at 16+ tokens on the AVX2 path had floors before its benchmark marked it report_only there:
    --update drops them (the class's and every CPU's own) and says so, rather than keep a floor nothing reads."""
    regress.readings["values"] = {"k_up": 1.0, "p_down": 0.1, "k_limit": 0.09}
    for _ in range(3):
        assert regress.main(["--quick", "--update", "--class", "avx2"]) == 0
    f = yaml.safe_load(regress.FLOORS.read_text())["classes"]["avx2"]["quick"]
    assert f["k_limit"]["floor"] is not None and f["k_limit"]["cpu_floors"]
    capsys.readouterr()
    _mark_report_only(regress, "k_limit", "compute-bound on avx2 from 16 tokens")
    assert regress.main(["--quick", "--update", "--class", "avx2"]) == 0
    assert "k_limit: floor 0.0765 -> None (reported, not floored: compute-bound on avx2" in capsys.readouterr().out
    f = yaml.safe_load(regress.FLOORS.read_text())["classes"]["avx2"]["quick"]
    assert f["k_limit"]["floor"] is None and "cpu_floors" not in f["k_limit"] and len(f["k_limit"]["readings"]) == 4
    assert f["k_up"]["floor"] is not None


def test_a_cpu_without_floors_of_its_own_goes_straight_to_one_side_by_side_run(regress, capsys, monkeypatch):
    """A CPU judged by its class's floors that reads below one is another CPU of the class, not a busy
    moment: re-reading it ratio by ratio (CI spent 1114 s so) tells nothing; one side-by-side run does."""
    regress.readings["git"]["status"] = ""
    for _ in range(3):
        regress.main(["--quick", "--update", "--class", "avx512_bf16"])
    capsys.readouterr()
    monkeypatch.setattr(regress, "cpu_name", lambda: "New CPU")
    regress.readings["values"] = {"k_up": 0.6, "p_down": 0.1}
    regress.readings["ref_values"] = {"k_up": 0.61, "p_down": 0.1}
    assert regress.main(["--quick", "--class", "avx512_bf16"]) == 0
    assert regress.readings["reruns"] == [] and "pauses" not in regress.readings  # no re-reading
    assert len(regress.readings["ref_runs"]) == regress.AB_ROUNDS
    assert "k_up only side by side with the reference build" in capsys.readouterr().out
    regress.readings["ref_values"] = {"k_up": 0.9, "p_down": 0.1}  # the same CPU read higher on the reference
    assert regress.main(["--quick", "--class", "avx512_bf16"]) == 1
    assert regress.readings["reruns"] == [] and "FAILED k_up = 0.6 < floor 0.85" in capsys.readouterr().err


def test_a_class_without_floors_says_so(regress, capsys):
    assert regress.main(["--quick", "--class", "generic"]) == 0
    cap = capsys.readouterr()
    assert "the class generic (quick) has no floors yet" in cap.err and "2 without a floor" in cap.out


def test_a_ratio_on_another_kernel_path_fails_without_a_second_reading(regress, capsys, monkeypatch):
    regress.readings["paths"] = {"k_up": "avx512_vnni:a8"}
    for _ in range(3):
        regress.main(["--quick", "--update", "--class", "avx512"])
    capsys.readouterr()
    regress.readings["paths"] = {"k_up": "avx2:a8"}  # a fallback that still clears the floor
    regress.readings["values"] = {"k_up": 1.0, "p_down": 0.1}
    assert regress.main(["--quick", "--class", "avx512"]) == 1
    cap = capsys.readouterr()
    assert "FAILED k_up ran path avx2:a8" in cap.err and "the readings on this CPU ran avx512_vnni:a8" in cap.out
    assert regress.readings["reruns"] == []  # a path change is not noise: nothing is re-measured
    monkeypatch.setattr(regress, "cpu_name", lambda: "Other CPU")  # no readings of this CPU: nothing to compare
    assert regress.main(["--quick", "--class", "avx512"]) == 0


def test_measure_prints_one_json_line_of_the_ratios_and_judges_nothing(regress, capsys, tmp_path):
    """--measure is scripts/ab.py's command: the ratios of one run (of another tree with --root), no floors."""
    calls = []
    real = regress.run_suite

    def spy(quick, select, nodes=None, rounds=None, root=regress.ROOT):
        calls.append((quick, nodes, root))
        return real(quick, select, nodes, rounds, regress.ROOT)

    regress.run_suite = spy
    (tmp_path / "tree" / "benchmarks").mkdir(parents=True)
    node = "benchmarks/test_x.py::test_k_up"
    assert regress.main(["--quick", "--measure", "k_up", "--node", node, "--root", str(tmp_path / "tree")]) == 0
    cap = capsys.readouterr()
    line = json.loads(cap.out.strip().splitlines()[-1])
    assert line["k_up"] == 1.0 and "p_down" not in line and line["root"] == str((tmp_path / "tree").resolve())
    assert calls == [(True, [node], (tmp_path / "tree").resolve())] and "k_up = 1 in" in cap.err
    assert not regress.FLOORS.exists()  # nothing recorded
    regress.readings["values"] = {"k_up": 0.01}  # far below any floor: still only measured
    assert regress.main(["--measure", "k_up"]) == 0 and json.loads(capsys.readouterr().out.strip())["k_up"] == 0.01
    regress.readings["skipped"] = [{"ratios": ["p_down"], "reason": "no llama.cpp"}]
    assert regress.main(["--measure", "k_up,p_down"]) == 2
    assert "not measured: p_down (skipped: no llama.cpp)" in capsys.readouterr().err
    assert regress.main(["--measure", "k_up", "--root", str(tmp_path)]) == 2  # no benchmarks/ there
    assert "has no benchmarks/" in capsys.readouterr().err
    for bad in (["--node", node], ["--root", str(tmp_path)], ["--measure", "k_up", "--update"]):
        with pytest.raises(SystemExit):
            regress.main(bad)


def test_a_cpus_own_floor_judges_it_and_a_cpu_without_one_meets_the_class_floor(regress, monkeypatch):
    args = ["--quick", "--update", "--class", "avx512"]
    for _ in range(3):
        regress.main(args)  # Test CPU at 1.0: class floor and its own 0.85
    monkeypatch.setattr(regress, "cpu_name", lambda: "Slow CPU")
    regress.readings["values"] = {"k_up": 0.6, "p_down": 0.1}
    for _ in range(2):
        regress.main(args)
    assert "Slow CPU" not in floors(regress)["k_up"]["cpu_floors"]  # two readings seed nothing
    regress.main(args)
    f = floors(regress)["k_up"]
    assert f["floor"] == pytest.approx(0.51)  # the class floor is its slowest CPU's: every CPU of it passes
    assert f["cpu_floors"] == {"Test CPU": pytest.approx(0.85), "Slow CPU": pytest.approx(0.51)}
    monkeypatch.setattr(regress, "cpu_name", lambda: "Test CPU")
    regress.readings["values"] = {"k_up": 0.7, "p_down": 0.1}
    assert regress.main(["--quick", "--class", "avx512"]) == 1  # above the class floor, below its own 0.85
    monkeypatch.setattr(regress, "cpu_name", lambda: "Slow CPU")
    regress.readings["values"] = {"k_up": 0.55, "p_down": 0.1}
    assert regress.main(["--quick", "--class", "avx512"]) == 0  # its own floor
    regress.readings["values"] = {"k_up": 0.45, "p_down": 0.1}
    assert regress.main(["--quick", "--class", "avx512"]) == 1  # below its own floor, every reading
    monkeypatch.setattr(regress, "cpu_name", lambda: "New CPU")
    regress.readings["values"] = {"k_up": 0.55, "p_down": 0.1}
    assert regress.main(["--quick", "--class", "avx512"]) == 0  # no floor of its own: the class's 0.51
    regress.readings["values"] = {"k_up": 0.45, "p_down": 0.1}
    assert regress.main(["--quick", "--class", "avx512"]) == 1
    assert regress.main(["--quick", "--class", "avx512", "--lower", "k_up=0.5", "--reason", "a trade-off"]) == 0
    f = floors(regress)["k_up"]
    assert f["floor"] == 0.5 and f["cpu_floors"] == {"Test CPU": 0.5, "Slow CPU": pytest.approx(0.5)}


def test_a_forced_kernel_path_records_and_is_judged_under_its_own_name(regress, monkeypatch):
    monkeypatch.setenv("FIDDLER_KERNEL_ISA", "avx2")
    for _ in range(3):
        regress.main(["--quick", "--update", "--class", "avx2"])
    f = yaml.safe_load(regress.FLOORS.read_text())["classes"]["avx2"]["quick"]["k_up"]
    assert set(f["cpu_floors"]) == {"Test CPU (FIDDLER_KERNEL_ISA=avx2)"}
    assert {x["cpu"] for x in f["readings"]} == {"Test CPU (FIDDLER_KERNEL_ISA=avx2)"}


def test_the_cpu_name_tells_cpus_of_one_model_name_apart():
    spec = importlib.util.spec_from_file_location("regress_name", ROOT / "scripts" / "regress.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not Path("/proc/cpuinfo").exists():
        pytest.skip("no /proc/cpuinfo")
    text = Path("/proc/cpuinfo").read_text()
    if "cpu family" not in text:
        pytest.skip("/proc/cpuinfo without a cpu family (not x86)")
    family = next(l.split(":", 1)[1].strip() for l in text.splitlines() if l.startswith("cpu family"))
    assert f"(family {family} model " in mod.cpu_name()
