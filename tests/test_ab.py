"""scripts/ab.py: the noise rule (`verdict`) on given readings, and the tool end to end on a toy git repository
whose command prints a number it reads from its tree (the base commits one value, the working tree another),
so every ratio is known in advance: nothing here is a timing."""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

spec = importlib.util.spec_from_file_location("ab_under_test", ROOT / "scripts" / "ab.py")
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)


# ---------------------------------------------------------------- the rule, on injected readings


def test_identical_sides_are_within_noise():
    v = ab.verdict([10, 11, 9, 10.5, 10], [10, 11, 9, 10.5, 10])
    assert not v["changed"] and v["verdict"] == "within noise" and v["median_ratio"] == 1 and v["direction"] is None


def test_a_clear_shift_is_changed_in_either_direction():
    base = [100, 101, 99, 100, 100.5]
    up = ab.verdict(base, [b * 1.2 for b in base])
    assert up["changed"] and up["verdict"] == "changed (head/base higher)" and up["median_ratio"] == pytest.approx(1.2)
    assert up["agree"] == 5 and up["agree_needed"] == 5
    down = ab.verdict(base, [b * 0.8 for b in base])
    assert down["changed"] and down["verdict"] == "changed (head/base lower)" and down["direction"] == "lower"


def test_a_shift_smaller_than_the_sides_own_scatter_is_within_noise():
    base = [100, 110, 90, 105, 95]  # about 7% robust scatter
    head = [b * 1.03 for b in base]  # every round 3% higher: consistent, but smaller than the noise
    v = ab.verdict(base, head)
    assert v["agree"] == 5 and not v["changed"] and v["band"] > 0.03 and "<= band" in v["why"]


def test_ratios_that_scatter_more_than_the_sides_predict_are_within_noise():
    base = [100, 100, 100, 90, 108]  # three equal readings on each side: no scatter of either side's own
    head = [120, 105, 110, 110, 110]
    v = ab.verdict(base, head)
    assert v["noise"]["base"] == 0 and v["noise"]["head"] == 0 and v["agree"] == 5
    # the ratios (1.2, 1.05, 1.1, 1.22, 1.02) scatter by about 11%: a median 10% up is within that
    assert v["median_ratio"] == pytest.approx(1.1) and v["noise"]["ratio"] == pytest.approx(0.1098, abs=1e-3)
    assert not v["changed"] and v["band"] == v["noise"]["ratio"]


def test_one_disagreeing_round_of_five_is_within_noise():
    base = [100.0] * 5
    head = [120, 120, 120, 120, 99]  # a large shift, but one round says the opposite
    v = ab.verdict(base, head)
    assert v["median_ratio"] == pytest.approx(1.2) and v["agree"] == 4 and not v["changed"]
    assert "only 4 of 5 rounds higher" in v["why"]
    v10 = ab.verdict([100.0] * 10, [120.0] * 9 + [99.0])  # with 10 rounds, 9 agreeing is enough
    assert v10["agree_needed"] == 9 and v10["changed"]


def test_sign_test_thresholds():
    assert [ab.rounds_needed(n) for n in range(1, 11)] == [None, None, None, None, 5, 6, 7, 7, 8, 9]
    assert ab.min_rounds() == 5
    assert ab.rounds_needed(4, alpha=0.125) == 4  # a looser alpha lets fewer rounds decide


def test_one_round_or_too_few_rounds_never_say_changed():
    v = ab.verdict([100], [200])
    assert not v["changed"] and v["median_ratio"] == 2 and "too few" in v["why"] and v["band"] == 0
    v = ab.verdict([1, 1, 1, 1], [2, 2, 2, 2])
    assert not v["changed"] and "too few" in v["why"]


def test_tolerance_widens_the_band():
    base = [100.0] * 5
    head = [102.0] * 5  # deterministic: no scatter, so 2% is beyond the noise ...
    assert ab.verdict(base, head)["changed"]
    v = ab.verdict(base, head, tolerance=0.05)  # ... but not beyond "within 5%"
    assert not v["changed"] and v["band"] == 0.05


def test_zeros():
    assert ab.verdict([0.0] * 5, [0.0] * 5)["median_ratio"] == 1  # both zero: equal
    v = ab.verdict([0.0] * 5, [1.0] * 5)  # from zero: an infinite ratio, changed
    assert v["median_ratio"] == math.inf and v["changed"] and v["direction"] == "higher"
    v = ab.verdict([1.0] * 5, [0.0] * 5)
    assert v["median_ratio"] == 0 and v["changed"] and v["direction"] == "lower"
    v = ab.verdict([0, 0, 0, 1, 2], [5, 5, 5, 5, 5])  # some rounds divide by zero: the ratios have no scale
    assert v["noise"]["base"] == 0 and v["median_ratio"] == math.inf and v["band"] == math.inf and not v["changed"]
    v = ab.verdict([0, 1, 0, 2, 3], [1, 1, 1, 1, 1])  # a median of 1 but a 100% scatter: within noise
    assert v["noise"]["base"] == pytest.approx(1.4826) and not v["changed"]


def test_bad_readings_raise():
    for base, head in (([], []), ([1, 2], [1]), ([1, -1], [1, 1]), ([1, float("nan")], [1, 1]),
                       ([1, 1], [1, float("inf")])):
        with pytest.raises(ValueError):
            ab.verdict(base, head)


def test_reading_parses_numbers_and_json_keys():
    assert ab.reading("warming up\n3.5\nthe end\n", None) == 3.5
    assert ab.reading("1\n2\n", None) == 2
    assert ab.reading("no number\nnan\n", None) is None
    out = '{"x": 1}\n{"ratio": 0.9, "nested": {"v": 7}}\nnoise {"ratio": 5}\n{"other": 2}\n'
    assert ab.reading(out, "ratio") == 0.9  # the last JSON object line that holds the key
    assert ab.reading(out, "nested.v") == 7
    assert ab.reading('{"a.b": 3, "a": {"b": 4}}', "a.b") == 3  # a literal dotted key wins
    assert ab.reading('{"ratio": true}\n{"ratio": "1"}', "ratio") is None and ab.reading("", "ratio") is None


# ---------------------------------------------------------------- the tool, on a toy repository

# Prints the number in the tree's `value` file, times a deterministic factor per round ("noise" that both
# sides share in a round, as a busy machine would), plus an optional per-side offset from AB_SIDE.
TOY = """import json, os, sys
v = float(open("value").read()) * [1.0, 1.04, 0.97, 1.02, 0.99, 1.01, 0.98][int(os.environ["AB_ROUND"]) % 7]
import toymod
print("toy run", os.environ["AB_SIDE"], toymod.SIDE)
if os.environ.get("TOY_JSON"):
    print(json.dumps({"m": {"v": v}, "other": 1}))
    print("trailing noise")
else:
    print(v)
"""


@pytest.fixture
def toy(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "value").write_text("100\n")
    (repo / "toy.py").write_text(TOY)
    (repo / "toymod.py").write_text('SIDE = "committed"\n')
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "base"], check=True)
    (repo / "toymod.py").write_text('SIDE = "working tree"\n')  # proves each side imports its own tree's code
    monkeypatch.delenv("TOY_JSON", raising=False)
    return repo


def run_ab(toy, capsys, *args, value=None, cmd=None):
    if value is not None:
        (toy / "value").write_text(f"{value}\n")
    rc = ab.main(["--base", "HEAD", "--repo", str(toy), *args, "--", *(cmd or [sys.executable, "toy.py"])])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def final_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_same_value_is_within_noise(toy, capsys):
    rc, out, err = run_ab(toy, capsys, "--json", value=100)
    assert rc == 0, err
    assert "verdict: within noise" in out
    j = final_json(out)
    assert j["median_ratio"] == pytest.approx(1.0) and not j["changed"] and j["rounds"] == 5
    # the shared per-round factor moves both sides alike: the ratios stay 1 while the readings move
    assert j["base"]["readings"] == j["head"]["readings"] and len(set(j["base"]["readings"])) > 1
    assert j["head"]["uncommitted"] == 1 and j["base"]["commit"] == subprocess.run(
        ["git", "-C", str(toy), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()


def test_a_changed_value_is_changed_both_directions(toy, capsys):
    rc, out, err = run_ab(toy, capsys, "--json", value=110)
    assert rc == 0, err
    assert "verdict: changed (head/base higher)" in out
    j = final_json(out)
    assert j["median_ratio"] == pytest.approx(1.1) and j["direction"] == "higher" and j["agree"] == 5
    assert all(r == pytest.approx(1.1) for r in j["ratios"])
    rc, out, _ = run_ab(toy, capsys, "--json", "--fail-on-change", value=80)
    assert rc == 1 and "verdict: changed (head/base lower)" in out
    assert final_json(out)["median_ratio"] == pytest.approx(0.8)
    rc, out, _ = run_ab(toy, capsys, "--tolerance", "25", value=80)  # within 25%: not a change
    assert rc == 0 and "verdict: within noise" in out and "tolerance 25%" in out


def test_rounds_alternate_abba_with_each_sides_tree(toy, capsys, tmp_path):
    log = tmp_path / "order.log"
    cmd = [f'echo "$AB_ROUND $AB_SIDE $(cat value) $(pwd -P) $AB_BASE_TREE $AB_HEAD_TREE '
           f'$(python -c "import toymod; print(toymod.SIDE)")" >> {log}; echo 1']
    rc, out, err = run_ab(toy, capsys, "--rounds", "4", cmd=cmd, value=7)
    assert rc == 0, err
    lines = [l.split(" ", 6) for l in log.read_text().splitlines()]
    assert [(r, s) for r, s, *_ in lines] == [("1", "base"), ("1", "head"), ("2", "head"), ("2", "base"),
                                             ("3", "base"), ("3", "head"), ("4", "head"), ("4", "base")]
    base_tree = Path(lines[0][4])
    for _, side, value, pwd, base, head, mod in lines:
        assert (Path(base), Path(head)) == (base_tree, toy.resolve())
        if side == "head":
            assert (value, Path(pwd), mod) == ("7", toy.resolve(), "working tree")
        else:
            assert (value, Path(pwd).resolve(), mod) == ("100", base_tree.resolve(), "committed")
    assert not base_tree.exists()  # the export is removed afterwards
    assert "cannot be 'changed'" in err  # 4 rounds: the sign test cannot decide


def test_key_reads_the_json_line(toy, capsys, monkeypatch):
    monkeypatch.setenv("TOY_JSON", "1")
    rc, out, err = run_ab(toy, capsys, "--key", "m.v", "--json", value=50)
    assert rc == 0, err
    j = final_json(out)
    assert j["median_ratio"] == pytest.approx(0.5) and j["key"] == "m.v" and j["verdict"] == "changed (head/base lower)"
    rc, _, err = run_ab(toy, capsys, "--key", "missing")
    assert rc == 2 and "printed no reading (a JSON object line with 'missing')" in err and "round 1" in err



def test_several_keys_are_each_judged_from_the_same_runs(toy, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("TOY_JSON", "1")
    log = tmp_path / "runs.log"
    cmd = [f"echo run >> {log}; {sys.executable} toy.py"]
    rc, out, err = run_ab(toy, capsys, "--key", "m.v", "--key", "other", "--json", "--fail-on-change", value=50,
                          cmd=cmd)
    assert len(log.read_text().splitlines()) == 10  # 5 rounds x 2 sides, read for both keys
    finals = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    assert [(j["key"], j["verdict"]) for j in finals] == [("m.v", "changed (head/base lower)"),
                                                           ("other", "within noise")]
    assert finals[1]["median_ratio"] == pytest.approx(1.0) and "== other" in out
    assert rc == 1  # one key changed

def test_a_failing_command_names_side_round_exit_code_and_stderr(toy, capsys):
    cmd = ['if [ "$AB_SIDE" = head ] && [ "$AB_ROUND" = 2 ]; then echo "boom: head broke" >&2; exit 3; fi; echo 1']
    rc, out, err = run_ab(toy, capsys, cmd=cmd)
    assert rc == 2
    assert "the head command (round 2" in err and "exit code 3" in err and "boom: head broke" in err
    assert "verdict" not in out
    rc, _, err = run_ab(toy, capsys, cmd=["echo no number here"])
    assert rc == 2 and "the base command (round 1" in err and "printed no reading" in err and "no number here" in err
    rc, _, err = run_ab(toy, capsys, cmd=["echo -5"])
    assert rc == 2 and ">= 0" in err


def test_bad_rev_and_bad_usage_exit_2(toy, capsys):
    rc = ab.main(["--base", "no-such-rev", "--repo", str(toy), "--", "echo", "1"])
    assert rc == 2 and "bad --base: 'no-such-rev' is not a commit" in capsys.readouterr().err
    assert ab.main(["--base", "HEAD", "--repo", str(toy)]) == 2 and "no command" in capsys.readouterr().err
    assert ab.main(["--repo", str(toy), "--", "echo", "1"]) == 2  # --base is required
    assert ab.main(["--base", "HEAD", "--rounds", "0", "--repo", str(toy), "--", "echo", "1"]) == 2
    capsys.readouterr()


def test_export_build_builds_where_there_is_a_setup_py(toy, tmp_path, capsys):
    """setup.py here is a stand-in that writes a file (what build_ext --inplace is to the real kernel); a
    failing one is a build failure, exit 2. The real kernel's build is exercised by scripts/regress.py's
    side-by-side check, not here (minutes of compiling)."""
    git = ["git", "-C", str(toy), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    (toy / "setup.py").write_text("import sys, pathlib\nassert sys.argv[1:] == ['build_ext', '--inplace']\n"
                                  "pathlib.Path('built').write_text('1')\n")
    subprocess.run(git + ["add", "setup.py"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "setup"], check=True)
    dest = tmp_path / "export"
    dest.mkdir()
    assert ab.export_build("HEAD", dest, toy) is None
    assert (dest / "built").read_text() == "1" and (dest / "value").read_text() == "100\n"
    assert (dest / "toymod.py").read_text() == 'SIDE = "committed"\n'  # the commit, not the working tree
    assert "git archive nope failed" in ab.export_build("nope", tmp_path / "x", toy)
    rc, out, _ = run_ab(toy, capsys, "--rounds", "1", cmd=["cat built"])
    assert rc == 0 and (toy / "built").exists()  # the head is built too
    rc, out, _ = run_ab(toy, capsys, "--rounds", "1", "--no-build", cmd=["echo 1"])
    assert rc == 0 and "and built" not in out
    (toy / "setup.py").write_text("import sys\nsys.exit('no compiler here')\n")
    rc, _, err = run_ab(toy, capsys, "--rounds", "1", cmd=["echo 1"])
    assert rc == 2 and "building the head (working tree) failed: no compiler here" in err


def test_regress_reference_build_is_ab_export_build():
    spec = importlib.util.spec_from_file_location("regress_for_ab", ROOT / "scripts" / "regress.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.export_build.__code__.co_filename == str(ROOT / "scripts" / "ab.py")
    assert "git archive" not in Path(ROOT / "scripts" / "regress.py").read_text().split("def reference_build")[1][:400]
