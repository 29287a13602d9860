#!/usr/bin/env python
"""The tables of this folder's README from the runs' records (runs/<system>/records.jsonl):
python summarize.py [RUNS_DIR] > summary.md"""
import json
import sys
from pathlib import Path

RUNS = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "runs"
ORDER = ["fiddler", "vllm", "llama_cpp_server", "hf_transformers", "llama_cpp"]


def f(x, scale=1.0, nd=2):
    return "-" if x is None else f"{x * scale:.{nd}f}"


def records():
    for s in ORDER:
        p = RUNS / s / "records.jsonl"
        if p.exists():
            yield s, [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def main():
    print("## Concurrency levels\n")
    print("| system | streams | status | N (failed) | out tok/s | req/s | TTFT p50 / p99 s | TPOT p50 / p99 ms "
          "| ITL p50 / p99 ms (N gaps) | server ITL p50 / p99 ms | loadgen CPU s (guidellm / aiperf) |")
    print("|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|")
    heads, trials = [], []
    for s, recs in records():
        for r in sorted(recs, key=lambda r: r["point"].get("concurrency") or 0):
            m, c = r.get("metrics") or {}, r["point"].get("concurrency")
            if c is None:
                continue
            if r["status"] != "ok":
                print(f"| {s} | {c} | {r['status']}: {(r.get('reason') or '')[:120]} | | | | | | | | |")
                continue
            print(f"| {s} | {c} | ok | {m['requests']} ({m.get('failed_requests', 0)}) | {f(m['output_tok_s'], nd=1)} "
                  f"| {f(m['request_throughput'], nd=3)} | {f(m['ttft_p50_s'])} / {f(m['ttft_p99_s'])} "
                  f"| {f(m['tpot_p50_s'], 1e3, 0)} / {f(m['tpot_p99_s'], 1e3, 0)} "
                  f"| {f(m.get('itl_p50_s'), 1e3, 1)} / {f(m.get('itl_p99_s'), 1e3, 1)} ({m.get('itl_n', '-')}) "
                  f"| {f(m.get('itl_server_p50_s'), 1e3, 1)} / {f(m.get('itl_server_p99_s'), 1e3, 1)} "
                  f"| {f(m.get('load_generator_cpu_s'), nd=1)} / {f(m.get('itl_load_generator_cpu_s'), nd=1)} |")
            search = (r.get("serving") or {}).get("rate_search")
            if search:
                heads.append((s, search, m))
                trials += [(s, t) for t in search.get("trials", [])]
    print("\n## Rate search (Poisson arrivals, seeded; each rate 64 requests or 600 s)\n")
    print("| system | rate req/s | sent at req/s | N (failed) | achieved req/s | out tok/s | TTFT p50 / p99 s "
          "| TPOT p50 / p99 ms | within MLPerf | within scaled |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|---|---|")
    for s, t in trials:
        print(f"| {s} | {t['rate']:.3f} | {f(t.get('arrival_rate_req_s'), nd=3)} | {t['requests']} "
              f"({t.get('failed_requests', 0)}) "
              f"| {f(t.get('request_throughput'), nd=3)} | {f(t.get('output_tok_s'), nd=1)} "
              f"| {f(t.get('ttft_p50_s'))} / {f(t['ttft_p99_s'])} | {f(t.get('tpot_p50_s'), 1e3, 0)} / "
              f"{f(t['tpot_p99_s'], 1e3, 0)} | {'yes' if t['within']['mlperf'] else 'no'} "
              f"| {'yes' if t['within'].get('scaled') else 'no'} |")
    print("\n## Headline: the highest Poisson rate within each set of p99 limits\n")
    print("| system | capacity at 16 streams req/s | scaled limits (TTFT s, TPOT ms) | highest rate within scaled "
          "| lowest beyond | highest rate within MLPerf (2 s, 200 ms) | lowest beyond | trials |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|")
    for s, search, m in heads:
        if "error" in search:
            print(f"| {s} | | | error: {search['error'][:150]} | | | | |")
            continue
        sc = next((x for x in search["slos"] if x["name"] == "scaled"), None)
        hi, lo = search["highest_rate_within"], search["lowest_rate_beyond"]
        print(f"| {s} | {search['capacity_req_s']:.3f} | "
              f"{'-' if sc is None else '%.2f, %.0f' % (sc['ttft_p99_s'], sc['tpot_p99_s'] * 1e3)} "
              f"| {f(hi.get('scaled'), nd=3)} | {f(lo.get('scaled'), nd=3)} | {f(hi['mlperf'], nd=3)} "
              f"| {f(lo['mlperf'], nd=3)} | {len(search['trials'])} |")


if __name__ == "__main__":
    main()
