"""Validation of the simulator (issue 12): what mode=simulate predicts against what was measured.

1. This host: `environment=local` simulated vs executed on small_mixtral, fiddler and llama_cpp
   (decode tok/s within 20%, TTFT within 30%): (1a) the committed execute records of this host class,
   each simulated with the read limit its run measured (deterministic); (1b) executed now (unless
   --no-host; needs a quiet machine: run it under /tmp/quiet.sh or alone).
2. RTX 6000 Ada: simulated DeepSpeed ZeRO-Inference and Mixtral-Offloading on paper_env2 vs the Fiddler
   authors' measurements (results/reference/baseline-runs/ada6000/; decode tok/s and TTFT within 30%).
3. The paper's Fig. 4 (paper_env1 / paper_env2, input 32, output 256): every pairwise ordering of the four
   systems as in the paper (results/reference/paper/paper-reported.csv), each value with its ratio.

    python -m runners.validate_sim --out results/paper/validation.md [--no-host]

Each check returns rows (plain dicts) and whether it passed; `report()` renders them as Markdown. The exit
status is 1 when a bound is not met (this project's Mixtral-Offloading re-implementation is shown beside the
released code's model in (2) but does not decide it: the measurements ran the released code).
"""
from __future__ import annotations

import argparse
import csv
import io
import itertools
import sys
import tempfile
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

from fiddler.sim.efficiency import cpu_class_of
from runners import table_format
from runners.records import PROJECT_ROOT
from systems import paths
from systems.registry import system_classes

CONF = paths.conf_dir()
ADA = paths.reference_dir() / "baseline-runs" / "ada6000"
PAPER_CSV = paths.reference_dir() / "paper" / "paper-reported.csv"
BOUNDS = {"host_decode": 0.20, "host_ttft": 0.30, "ada_decode": 0.30, "ada_ttft": 0.30}
# The systems as the paper ran them (Fiddler's released code, the 2024 llama.cpp, Mixtral-Offloading's released
# code, ZeRO-Inference), by the paper's name for each: the config classes' paper_name (systems/base.py). Their
# orderings are reported beside, with every miss named; they do not all match yet (validation.md section 3b)
FIG4_ORIGINAL = {c.paper_name: name for name, c in sorted(system_classes().items(), key=lambda kv: kv[1].paper_row or 0)
                 if c.paper_name is not None}
# The check's four systems (it decides the exit status): the paper's rule on this project's engine, today's
# llama.cpp, and the other two as the paper ran them
FIG4_SYSTEMS = {**FIG4_ORIGINAL, "fiddler": "fiddler_paper", "llama_cpp": "llama_cpp"}
# also reported beside the paper's values (not part of the orderings): this project's variants
FIG4_EXTRA = {"fiddler": "fiddler", "mixtral_offloading": "mixtral_offloading"}
# the measured Ada 6000 systems and the simulated configurations compared with them; the configurations that
# model the code that was measured decide the check, this project's re-implementation is shown beside them
ADA_SYSTEMS = (("deepspeed_mii", "deepspeed_mii"), ("mixtral_offloading", "mixtral_offloading_original"),
               ("mixtral_offloading", "mixtral_offloading"))
# Settings of the measured runs, where they differ from what the simulator derives from the budget.
# Mixtral-Offloading's cache: the Fiddler authors set `offload_per_layer = 5` of 8 experts (3 cached per
# layer) in their baseline script (github.com/efeslab/fiddler, branch batched_baseline,
# benchmarks/eval-baseline.py at 8cc24c7 of 2024-05-20 and 6f1356e of 2024-05-21 23:02, the commits that
# bracket the Ada 6000 prefill runs eval-2024-05-21-20-{04,14}-*.csv; the earlier 7471143 and the later
# 852250f set 7). The derived size (4 on 48 GB) is what the budget allows, not what ran. With 7 (1 cached)
# the released code's swaps could not reach the measured times: simulated TTFT 6.5 s vs 4.6-5.0 s measured,
# decode 0.66 vs 1.0 tok/s; with 5 both are within 10% (validation.md).
ADA_RUN_SETTINGS = {"mixtral_offloading_original": ("system.cache_size=3",)}
ADA_INFORMATIONAL = ("mixtral_offloading",)


def run(*overrides: str, quiet: bool = True) -> list[dict[str, Any]]:
    """Records of one harness job (run_job through Hydra's compose API), in a scratch directory and index."""
    import runners  # noqa: F401  (registers schemas and resolvers)
    from hydra import compose, initialize_config_dir

    from runners.main import run_job

    with tempfile.TemporaryDirectory(prefix="validate-sim-") as tmp:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("config", overrides=[*overrides, "run.progress=false", "run.force=true",
                                               f"run.index_path={tmp}/index.jsonl"])
        sink = io.StringIO()
        if quiet:
            with redirect_stdout(sink):
                return run_job(cfg, Path(tmp) / "run")
        return run_job(cfg, Path(tmp) / "run")


def simulate(*overrides: str) -> list[dict[str, Any]]:
    return run("mode=simulate", *overrides)


def _ratio(sim: float | None, ref: float | None) -> float | None:
    return sim / ref if sim and ref else None


def _cpu(rec: dict) -> str:
    h = rec.get("host") or {}
    return f"{h.get('cpu_name')} ({h.get('cpu_isa')}{', AMX' if h.get('cpu_amx_bf16') else ''}, {h.get('cpu_cores')} cores)"


def _within(ratio: float | None, bound: float) -> bool:
    return ratio is not None and abs(ratio - 1) <= bound


# ---------------------------------------------------------------- (1) this host

def check_host(systems=("fiddler", "llama_cpp"), input_len: int = 64, output_len: int = 32,
               repetitions: int = 2, model: str = "small_mixtral") -> tuple[list[dict], bool]:
    """Execute and simulate the same configurations on environment=local (one process: the same measured
    read limit for both)."""
    point = (f"workload.input_lens=[{input_len}]", f"workload.output_lens=[{output_len}]",
             f"workload.repetitions={repetitions}", "workload.warmup=1")
    rows, ok = [], True
    for system in systems:
        common = (f"system={system}", f"model={model}", "environment=local", *point)
        # a child process, as the harness runs a system: its process_env (OMP_WAIT_POLICY) set before torch loads
        (ex,) = run("mode=execute", "run.isolation=process", *common)
        (sim,) = simulate(*common)
        if ex["status"] != "ok" or sim["status"] != "ok":
            rows.append({"system": system, "status": f"execute {ex['status']}, simulate {sim['status']}",
                         "reason": ex.get("reason") or sim.get("reason")})
            ok = False
            continue
        for metric, bound in (("decode_tok_s", BOUNDS["host_decode"]), ("ttft_s", BOUNDS["host_ttft"])):
            r = _ratio(sim["metrics"][metric], ex["metrics"][metric])
            passed = _within(r, bound)
            ok &= passed
            rows.append({"system": system, "metric": metric, "measured": ex["metrics"][metric],
                         "simulated": sim["metrics"][metric], "ratio": r, "bound": f"±{bound:.0%}",
                         "pass": passed, "cpu": _cpu(ex),
                         "limit_gbps": ex["config"]["environment"]["cpu"]["mem_bandwidth_gbps"]})
    return rows, ok


MEASURED_SWEEP = PROJECT_ROOT / "results" / "measured" / "2026-12-01-intel-xeon-small_mixtral-3systems"


def check_host_records(folder: Path = MEASURED_SWEEP, systems=("fiddler", "llama_cpp")) -> tuple[list[dict], bool]:
    """(1) against committed measurements of this host class: each execute record of `folder` simulated
    with the read limit that run measured (environment=local, its cpu.mem_bandwidth_gbps), deterministic.
    llama.cpp's CPU factors were derived from these same runs (systems/llama_cpp/sim.py): for it this
    checks the model's consistency, for fiddler (factors from kernel benchmarks) it is a prediction."""
    import json

    rows, ok = [], True
    for path in sorted(folder.glob("records-*.jsonl")):
        for line in path.read_text().splitlines():
            ex = json.loads(line)
            if ex.get("system") not in systems or ex.get("status") != "ok":
                continue
            env, p, host = ex["config"]["environment"], ex["point"], ex.get("host") or {}
            # the CPU class of the host that measured the record, not of the host checking it now (an AMD host
            # checking Intel records would take AMD factors)
            cpu_class = cpu_class_of(host.get("cpu_name") or env["cpu"]["name"], host.get("cpu_isa") or env["cpu"]["isa"],
                                     host.get("cpu_amx_bf16"))
            (sim,) = simulate(f"system={ex['system']}", f"model={ex['model']}", "environment=local",
                              f"sim.cpu_class={cpu_class}",
                              f"environment.cpu.mem_bandwidth_gbps={env['cpu']['mem_bandwidth_gbps']}",
                              f"environment.cpu.cores={env['cpu']['cores']}", "environment.gpu.memory_gb=0",
                              f"workload.input_lens=[{p['input_len']}]", f"workload.output_lens=[{p['output_len']}]")
            for metric, bound in (("decode_tok_s", BOUNDS["host_decode"]), ("ttft_s", BOUNDS["host_ttft"])):
                r = _ratio(sim["metrics"][metric] if sim["status"] == "ok" else None, ex["metrics"][metric])
                ok &= _within(r, bound)
                rows.append({"record": f"{folder.name}/{path.name}", "system": ex["system"], "metric": metric,
                             "measured": ex["metrics"][metric], "simulated": r and sim["metrics"][metric],
                             "ratio": r, "bound": f"±{bound:.0%}", "pass": _within(r, bound),
                             "cpu": _cpu(ex),
                             "limit_gbps": env["cpu"]["mem_bandwidth_gbps"]})
    return rows, ok


# ---------------------------------------------------------------- (2) RTX 6000 Ada

def _read_csv(path: Path) -> list[dict[str, float]]:
    with open(path) as f:
        return [{k.strip(): float(v) for k, v in row.items()} for row in csv.DictReader(f, skipinitialspace=True)]


def ada_reference() -> dict[tuple[str, str], list[dict[str, float]]]:
    """(system, workload) -> measured rows with input_len, output_len, ttft_s, decode_tok_s."""
    out = {}
    for system, stem in (("deepspeed_mii", "deepspeed-zero3-offload"), ("mixtral_offloading", "mixtral-offloading")):
        single = [{"input_len": r["input_token"], "output_len": r["output_token"], "ttft_s": r["prefill_time"],
                   "decode_tok_s": r["output_token"] / r["decode_time"]}
                  for r in _read_csv(ADA / f"{stem}_single-batch.csv")]
        longp = [{"input_len": r["input_token"], "output_len": 1, "ttft_s": r["time"], "decode_tok_s": None}
                 for r in _read_csv(ADA / f"{stem}_long-prefill.csv")]
        out[(system, "single_batch")], out[(system, "long_prefill")] = single, longp
    return out


def check_ada6000() -> tuple[list[dict], dict[str, bool]]:
    """Per simulated configuration (system=<conf>): every measured configuration of its system simulated on
    paper_env2; passed per (metric, configuration) as "<conf> <metric>"."""
    rows, passed = [], {}
    reference = ada_reference()
    for (system, conf_name), workload in itertools.product(ADA_SYSTEMS, ("single_batch", "long_prefill")):
        ref = reference[(system, workload)]
        ins = sorted({int(r["input_len"]) for r in ref})
        outs = sorted({int(r["output_len"]) for r in ref})
        recs = simulate(f"system={conf_name}", *ADA_RUN_SETTINGS.get(conf_name, ()), "model=mixtral_8x7b",
                        "environment=paper_env2",
                        f"workload={workload}", f"workload.input_lens=[{','.join(map(str, ins))}]",
                        f"workload.output_lens=[{','.join(map(str, outs))}]")
        by_point = {(r["point"]["input_len"], r["point"]["output_len"]): r for r in recs}
        for m in ref:
            rec = by_point[(int(m["input_len"]), int(m["output_len"]))]
            for metric, bound in (("ttft_s", BOUNDS["ada_ttft"]), ("decode_tok_s", BOUNDS["ada_decode"])):
                if m[metric] is None:
                    continue
                sim = rec["metrics"][metric] if rec["status"] == "ok" else None
                r = _ratio(sim, m[metric])
                key = f"{conf_name} {metric}"
                passed[key] = passed.get(key, True) and _within(r, bound)
                config = " ".join((f"system={conf_name}", *ADA_RUN_SETTINGS.get(conf_name, ())))
                rows.append({"system": system, "config": config, "workload": workload, "input": int(m["input_len"]),
                             "output": int(m["output_len"]), "metric": metric, "measured": m[metric],
                             "simulated": sim, "ratio": r, "pass": _within(r, bound)})
    return rows, passed


# ---------------------------------------------------------------- (3) the paper's Fig. 4

def paper_fig4() -> dict[tuple[str, str], float]:
    with open(PAPER_CSV) as f:
        return {(r["environment"], r["system"]): float(r["value"]) for r in csv.DictReader(f)
                if r["figure"] == "fig4" and r["metric"] == "e2e_tok_s"}


def check_fig4(systems: dict[str, str] | None = None, extra: dict[str, str] | None = None
               ) -> tuple[list[dict], list[dict], bool]:
    """(values with ratios, pairwise orderings, all orderings match) of `systems` (default FIG4_SYSTEMS, with
    FIG4_EXTRA's values beside)."""
    systems = FIG4_SYSTEMS if systems is None else systems
    extra = FIG4_EXTRA if extra is None else extra
    paper = paper_fig4()
    values, orders, ok = [], [], True
    for env in sorted({e for e, _ in paper}):
        sim = {}
        for system, conf_name in systems.items():
            (rec,) = simulate(f"system={conf_name}", "model=mixtral_8x7b", f"environment={env}",
                              "workload=single_batch", "workload.input_lens=[32]", "workload.output_lens=[256]")
            sim[system] = rec["metrics"]["e2e_tok_s"] if rec["status"] == "ok" else None
            values.append({"environment": env, "system": system, "config": f"system={conf_name}",
                           "paper_e2e_tok_s": paper.get((env, system)), "simulated_e2e_tok_s": sim[system],
                           "ratio": _ratio(sim[system], paper.get((env, system))), "in_orderings": True})
        for system, conf_name in extra.items():
            (rec,) = simulate(f"system={conf_name}", "model=mixtral_8x7b", f"environment={env}",
                              "workload=single_batch", "workload.input_lens=[32]", "workload.output_lens=[256]")
            v = rec["metrics"]["e2e_tok_s"] if rec["status"] == "ok" else None
            values.append({"environment": env, "system": system, "config": f"system={conf_name}",
                           "paper_e2e_tok_s": paper.get((env, system)), "simulated_e2e_tok_s": v,
                           "ratio": _ratio(v, paper.get((env, system))), "in_orderings": False})
        for a, b in itertools.combinations(systems, 2):
            pa, pb, sa, sb = paper[(env, a)], paper[(env, b)], sim[a], sim[b]
            match = sa is not None and sb is not None and (pa > pb) == (sa > sb)
            ok &= match
            orders.append({"environment": env, "pair": f"{a} vs {b}", "paper": ">" if pa > pb else "<",
                           "simulated": "?" if not match and (sa is None or sb is None) else (">" if sa > sb else "<"),
                           "match": match})
    return values, orders, ok


# ---------------------------------------------------------------- report

def _table(rows: list[dict]) -> str:
    return table_format.records(rows) + "\n"


def _host_bounds(ok: bool) -> str:
    return (f"Bounds: decode tok/s ±{BOUNDS['host_decode']:.0%}, TTFT ±{BOUNDS['host_ttft']:.0%}. "
            f"All within: **{'yes' if ok else 'no'}**. ")


def report(host: tuple | None, ada: tuple, fig4: tuple, host_records: tuple | None = None,
           fig4_original: tuple | None = None) -> str:
    out = ["# Simulator validation (mode=simulate vs measurements)", "",
           "Generated by `python -m runners.validate_sim`; every simulated number comes from fiddler/sim with the "
           "efficiency factors of its hardware class (fiddler/sim/efficiency.py, systems/llama_cpp/sim.py: "
           "each factor states its source) and the routing of the real Mixtral-8x7B profiles with temporal "
           "reuse 0.26 (fiddler/sim/routing.py). Nothing is fitted per cell.", ""]
    if host_records is not None:
        rows, ok = host_records
        out += ["## 1a. This host class: committed execute records, simulated with each run's own read limit", "",
                _host_bounds(ok) + f"Records: {MEASURED_SWEEP.relative_to(PROJECT_ROOT)} "
                "(small_mixtral, input 128, output 64, Intel Xeon with Sapphire Rapids flags, 2 cores, quiet "
                "machine). llama.cpp's CPU factors were derived from these runs, so its rows check consistency; "
                "fiddler's factors come from kernel benchmarks, so its rows are predictions.", "", _table(rows)]
    if host is not None:
        rows, ok = host
        out += ["## 1b. This host, live: environment=local, simulated vs executed now (small_mixtral)", "",
                _host_bounds(ok) + "The executed numbers are measured on this host "
                "(CPU in the `cpu` column); both sides use the same read limit, measured once at the start. "
                "llama.cpp's CPU factors come from an earlier sweep at input 128 / output 64; this check runs "
                "another point.", "", _table(rows)]
    else:
        out += ["## 1b. This host, live", "", "Not run (--no-host): executing small_mixtral needs a quiet machine.",
                ""]
    rows, passed = ada
    out += ["## 2. RTX 6000 Ada (paper_env2): simulated vs the Fiddler authors' baseline runs", "",
            f"Bounds: decode tok/s and TTFT ±{BOUNDS['ada_decode']:.0%}. All within, per configuration and "
            "metric: " + ", ".join(f"{s} **{'yes' if p else 'no'}**" for s, p in passed.items()) + ". "
            "`mixtral_offloading_original` models the released code the measurements ran (each miss a swap "
            "with a write-back on the same stream, no prefetch) with the cache the authors' script set "
            "(`offload_per_layer = 5`: 3 experts per layer cached; efeslab/fiddler batched_baseline, "
            "benchmarks/eval-baseline.py); `mixtral_offloading` is this project's re-implementation "
            "(prefetch, no write-back, cache derived from the budget).", "", _table(rows)]
    values, orders, ok = fig4
    out += ["## 3. The paper's Fig. 4 (input 32, output 256, end-to-end tok/s)", "",
            f"Every pairwise ordering as in the paper: **{'yes' if ok else 'no'}**. Paper values are read from "
            "its figure (second-hand, results/reference/paper/paper-reported.csv).", "", _table(values), "",
            _table(orders)]
    if fig4_original is not None:
        values, orders, ok = fig4_original
        n = sum(o["match"] for o in orders)
        out += ["", "## 3b. Fig. 4 with the systems as the paper ran them", "",
                f"`fiddler_original` and `llama_cpp_original` in place of this project's engine and today's llama.cpp: "
                f"{n} of {len(orders)} pairwise orderings as in the paper"
                + ("." if ok else f"; the others (**no** below) are a stated miss, not yet explained by a cited "
                                  "cause (summary.md)."), "", _table([v for v in values if v["in_orderings"]]), "",
                _table(orders)]
    out += ["", "## 4. Citations of the systems as the paper ran them (`*_original`)", "",
            "Every modelling parameter of `fiddler_original` and `llama_cpp_original` with its source "
            "(systems/citations.py: code lines at a commit, the paper, a measurement of this project, or a "
            "stated assumption); tests/test_original_citations.py fails on any without one.", "",
            _table(original_citations())]
    return "\n".join(out)


def original_citations() -> list[dict]:
    from systems.citations import table
    from systems.fiddler.original_sim import PARAMS as FIDDLER_PARAMS
    from systems.llama_cpp.original_sim import PARAMS as LLAMA_PARAMS

    rows = [{"system": "fiddler_original", **r} for r in table(FIDDLER_PARAMS)]
    rows += [{"system": "llama_cpp_original", **r} for r in table(LLAMA_PARAMS)]
    return rows


def failures(host, ada, fig4, host_records) -> list[str]:
    """The checks whose bounds were not met (what the exit status reports)."""
    out = []
    if host_records is not None and not host_records[1]:
        out.append("(1a) committed host records")
    if host is not None and not host[1]:
        out.append("(1b) live host run")
    out += [f"(2) {k}" for k, ok in ada[1].items() if not ok and k.split()[0] not in ADA_INFORMATIONAL]
    if not fig4[2]:
        out.append("(3) Fig. 4 orderings")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="Markdown file to write (default: print)")
    ap.add_argument("--no-host", action="store_true",
                    help="skip (1b), which executes small_mixtral on this host now (measured, so not reproducible "
                         "byte for byte; it needs a quiet machine); (1a) against committed records always runs")
    args = ap.parse_args(argv)
    host = None if args.no_host else check_host()
    ada, fig4, host_records = check_ada6000(), check_fig4(), check_host_records()
    text = report(host, ada, fig4, host_records, check_fig4(FIG4_ORIGINAL, {}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(text)
    failed = failures(host, ada, fig4, host_records)
    for f in failed:
        print(f"validation: bound not met: {f}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
