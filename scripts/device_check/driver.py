"""The device check's driver: the table of sections, one section's run, the files' check, the command line.

`scripts/device_check.sh` runs every section of SECTIONS in order, each under its own timeout, and each
writes `<out>/<NN>_<name>.json` the moment it ends, so a run cut short keeps what it measured. The same
code runs with `--dry-run` on a machine without a GPU: an emulated GPU (the CPU device stands in, as
`fiddler.gpu_side.GpuSide.emulated`), a scaled-down model, fewer threads; the JSON has the same fields
and says `"mode": "dry-run"`. README.md beside this file says what every number means and how each
factor carries to the paper's machines.

Every section's JSON holds `section`, `status` (ok | failed | skipped | timeout), `mode`, `seconds`, and
a `reason` whenever the status is not ok; a part of a section that cannot run here is a dict with
`{"skipped": "<why>"}` in place of its numbers. `--check DIR` verifies a finished run's files.

This is a harness script: it imports `fiddler` (the library) and nothing of runners/hydra, so a device
machine needs only torch, transformers, safetensors and gguf (hydra is carried for `pytest -m cuda`).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import sys
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # the dc_* modules beside this file

from dc_common import Ctx  # noqa: E402
from dc_cpu import section_llama_gpu, section_threads  # noqa: E402
from dc_gpu import section_env, section_h2d, section_races  # noqa: E402
from dc_offload import section_graphs, section_hf_offload, section_offload  # noqa: E402


# --------------------------------------------------------------------------------------------- the table

# name, function, timeout (s), fields an ok JSON must hold. The timeouts are the device estimates of README.md
# with some room; scripts/device_check.sh also stops starting sections when the run's budget is spent.
SECTIONS = [
    ("env", section_env, 20, ("gpu", "pcie", "cpu", "versions", "kernel_loaded")),
    ("races", section_races, 80, ("cuda_tests", "stress", "sanitizer")),
    ("h2d", section_h2d, 25, ("link_gbps", "alone", "with_cpu_kernel", "fraction_of_link", "cpu_kernel")),
    ("offload", section_offload, 110, ("model", "budget_bytes", "resident_experts", "prefill", "decode", "routing",
                                       "cuda_memory", "overlap_decode", "overlap_prefill", "makespan",
                                       "sync_census", "launches")),
    ("graphs", section_graphs, 70, ("captured_batch_sizes", "replays", "graph", "eager", "compare", "roofline")),
    ("hf_offload", section_hf_offload, 60, ("placement", "prefill", "decode", "max_memory_reserved")),
    ("threads", section_threads, 75, ("cores", "rows")),
    ("llama_gpu", section_llama_gpu, 10, ()),
]
COMMON = ("section", "status", "mode", "seconds")


def file_of(out: pathlib.Path, name: str) -> pathlib.Path:
    i = [s[0] for s in SECTIONS].index(name)
    return out / f"{i + 1:02d}_{name}.json"


def write(out: pathlib.Path, name: str, result: dict) -> None:
    p = file_of(out, name)
    tmp = p.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    os.replace(tmp, p)


def run_section(ctx: Ctx, name: str) -> int:
    fn = {s[0]: s[1] for s in SECTIONS}[name]
    t0 = time.perf_counter()
    try:
        res = fn(ctx)
    except Exception as e:  # noqa: BLE001 -- the section's file says what broke; the next sections still run
        res = {"status": "failed", "reason": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    ru = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    res = {"section": name, "status": res.pop("status", "ok"), "mode": ctx.mode,
           "seconds": time.perf_counter() - t0,
           "cpu_seconds": sum(r.ru_utime + r.ru_stime for r in ru),  # this process and its children, imports too
           **res}
    write(ctx.out, name, res)
    print(f"device_check: {name}: {res['status']} in {res['seconds']:.1f} s"
          + (f" ({res['reason']})" if res.get("reason") else ""), flush=True)
    return {"ok": 0, "skipped": 0}.get(res["status"], 1)


def record_stop(ctx: Ctx, name: str, status: str, reason: str) -> None:
    """The shell's note for a section whose process did not write its own file (timeout, crash)."""
    if file_of(ctx.out, name).exists():
        return
    write(ctx.out, name, {"section": name, "status": status, "mode": ctx.mode, "seconds": None, "reason": reason})


def check(out: pathlib.Path) -> list[str]:
    """Problems with a finished run's files: a missing section, a missing field, a non-ok one without why."""
    problems = []
    for name, _fn, _t, fields in SECTIONS:
        p = file_of(out, name)
        if not p.exists():
            problems.append(f"{p.name}: missing")
            continue
        d = json.loads(p.read_text())
        missing = [f for f in COMMON if f not in d]
        if d.get("status") not in ("ok", "failed", "skipped", "timeout"):
            problems.append(f"{p.name}: status {d.get('status')!r}")
        elif d["status"] != "ok":
            if not str(d.get("reason") or "").strip():
                problems.append(f"{p.name}: status {d['status']} without a reason")
        else:
            missing += [f for f in fields if f not in d]
            problems += [f"{p.name}: {where} is skipped without a reason" for where in _unexplained(d)]
        if missing:
            problems.append(f"{p.name}: missing {missing}")
    return problems


def _unexplained(d, where="") -> list[str]:
    """Paths of parts that are skipped with an empty reason."""
    if isinstance(d, dict):
        if "skipped" in d and not str(d["skipped"]).strip():
            return [where or "."]
        return [p for k, v in d.items() for p in _unexplained(v, f"{where}.{k}")]
    if isinstance(d, list):
        return [p for i, v in enumerate(d) for p in _unexplained(v, f"{where}[{i}]")]
    return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path(os.environ.get("OUT", "results/device_check")))
    ap.add_argument("--dry-run", action="store_true", help="emulated GPU, scaled-down model (any machine)")
    ap.add_argument("--cache", type=pathlib.Path,
                    default=pathlib.Path(os.environ.get("DEVICE_CHECK_CACHE", "/tmp/fiddler-device-check")))
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--list", action="store_true", help="print each section's name and timeout (s)")
    g.add_argument("--section", choices=[s[0] for s in SECTIONS])
    g.add_argument("--stopped", nargs=3, metavar=("SECTION", "STATUS", "REASON"),
                   help="record a section that ended without writing its file")
    g.add_argument("--check", action="store_true", help="check the files of a finished run in --out")
    a = ap.parse_args(argv)
    ctx = Ctx(a.out, a.dry_run, a.cache)
    if a.list:
        for name, _fn, timeout, _f in SECTIONS:
            print(name, timeout)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    if a.stopped:
        record_stop(ctx, *a.stopped)
        return 0
    if a.check:
        problems = check(a.out)
        for p in problems:
            print("device_check: check:", p)
        print(f"device_check: check: {len(SECTIONS) - len({p.split(':')[0] for p in problems})} of "
              f"{len(SECTIONS)} sections complete")
        return 1 if problems else 0
    return run_section(ctx, a.section)


if __name__ == "__main__":
    sys.exit(main())
