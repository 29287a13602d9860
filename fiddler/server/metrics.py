"""/metrics in Prometheus' text format (0.0.4), written here: a few counters and two histograms do not need a
client library."""

from __future__ import annotations

import bisect
import threading

TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)


class Histogram:
    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.n = tuple(buckets), [0] * len(buckets), 0.0, 0

    def observe(self, v: float) -> None:
        i = bisect.bisect_left(self.buckets, v)
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum += v
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.sum}", f"{name}_count {self.n}"]
        return out


class Metrics:
    """What the server counts as it happens (requests by outcome, tokens sent, TTFT, each engine step's
    tokens through `watch`); the batch engine's gauges and totals (running, waiting, tokens by phase,
    decisions by kind) are read when rendering."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}  # (route, outcome) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS_S)
        self.itl = Histogram(ITL_BUCKETS_S)  # between consecutive tokens of a request, as the engine made them
        self.step_tokens = Histogram(STEP_TOKEN_BUCKETS)

    def watch(self, batch_engine) -> None:
        """Count each of the engine's steps as it ends."""
        batch_engine.step_observers.append(self.step_done)

    def step_done(self, step) -> None:
        with self._lock:
            self.step_tokens.observe(step.tokens)

    def request_done(self, route: str, outcome: str, prompt_tokens: int = 0, generation_tokens: int = 0,
                     ttft_s: float | None = None, token_times: list[float] = ()) -> None:
        """token_times: when each token sent was made (time.perf_counter): their gaps are the ITLs."""
        with self._lock:
            for a, b in zip(token_times, token_times[1:]):
                self.itl.observe(b - a)
            self.requests[(route, outcome)] = self.requests.get((route, outcome), 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += generation_tokens
            if ttft_s is not None:
                self.ttft.observe(ttft_s)

    def render(self, batch_engine) -> str:
        with self._lock:
            lines = ["# HELP fiddler_requests_total Finished HTTP generation requests by route and outcome.",
                     "# TYPE fiddler_requests_total counter"]
            for (route, outcome), n in sorted(self.requests.items()):
                lines.append(f'fiddler_requests_total{{route="{route}",outcome="{outcome}"}} {n}')
            lines += ["# HELP fiddler_prompt_tokens_total Prompt tokens of finished requests.",
                      "# TYPE fiddler_prompt_tokens_total counter", f"fiddler_prompt_tokens_total {self.prompt_tokens}",
                      "# HELP fiddler_generation_tokens_total Tokens generated for finished requests.",
                      "# TYPE fiddler_generation_tokens_total counter",
                      f"fiddler_generation_tokens_total {self.generation_tokens}",
                      "# HELP fiddler_time_to_first_token_seconds Submit to first token, per request.",
                      "# TYPE fiddler_time_to_first_token_seconds histogram",
                      *self.ttft.lines("fiddler_time_to_first_token_seconds"),
                      "# HELP fiddler_inter_token_latency_seconds Time between consecutive tokens of a request.",
                      "# TYPE fiddler_inter_token_latency_seconds histogram",
                      *self.itl.lines("fiddler_inter_token_latency_seconds")]
            if batch_engine is not None:
                t = batch_engine.totals
                lines += ["# HELP fiddler_requests_running Requests holding a slot.", "# TYPE fiddler_requests_running gauge",
                          f"fiddler_requests_running {len(batch_engine.scheduler.running)}",
                          "# HELP fiddler_requests_waiting Requests queued for a slot.",
                          "# TYPE fiddler_requests_waiting gauge",
                          f"fiddler_requests_waiting {len(batch_engine.scheduler.waiting)}",
                          "# HELP fiddler_step_tokens Tokens per engine step.", "# TYPE fiddler_step_tokens histogram",
                          *self.step_tokens.lines("fiddler_step_tokens"),
                          "# HELP fiddler_engine_tokens_total Tokens the engine ran, by phase.",
                          "# TYPE fiddler_engine_tokens_total counter",
                          f'fiddler_engine_tokens_total{{phase="decode"}} {t["decode_tokens"]}',
                          f'fiddler_engine_tokens_total{{phase="prefill"}} {t["prefill_tokens"]}',
                          "# HELP fiddler_prefix_cache_tokens_total Prompt tokens of admitted requests: copied from "
                          "the prefix cache (hit) or left to compute (miss; counted only with the cache on).",
                          "# TYPE fiddler_prefix_cache_tokens_total counter",
                          f'fiddler_prefix_cache_tokens_total{{result="hit"}} {t["prefix_hit_tokens"]}',
                          f'fiddler_prefix_cache_tokens_total{{result="miss"}} {t["prefix_miss_tokens"]}',
                          "# HELP fiddler_expert_decisions_total Experts run, by the planner's decision (a: resident "
                          "on the GPU, b: copied in, c: on the CPU).",
                          "# TYPE fiddler_expert_decisions_total counter",
                          *(f'fiddler_expert_decisions_total{{kind="{k}"}} {t["experts"].get(k, 0)}' for k in "abc")]
        return "\n".join(lines) + "\n"
