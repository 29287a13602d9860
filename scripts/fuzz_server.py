"""Fuzz `python -m fiddler.server` from its own OpenAPI schema (issue 55): schemathesis draws request bodies for
/v1/completions and /v1/chat/completions, valid ones (positive) and ones that break the schema (negative), and
every answer is checked: no 5xx but the documented 503 (with Retry-After), only documented status codes and
content types. Then the server must still answer a normal request.

    python scripts/fuzz_server.py [--examples 500] [--seed N]   # starts its own server on 127.0.0.1
    python scripts/fuzz_server.py --url http://127.0.0.1:8000              # or fuzzes one that runs

Prints the requests sent, the answers by status, and each distinct failure (status, route, the first line of
the answer) with one body that caused it; exits 1 if any. tests/test_server_fuzz.py runs a short, seeded
campaign through run_campaign on every pytest run.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ROUTES = "^/v1/(chat/)?completions$"


def _check_no_5xx(ctx, response, case):
    status = response.status_code
    if status >= 500 and not (status == 503 and "retry-after" in {k.lower() for k in response.headers}):
        raise AssertionError(f"unexpected {status}: {response.text[:300]}")


def run_campaign(base_url: str, examples: int, seed: int | None = 0) -> dict:
    """Fuzz both routes in both generation modes, `examples` cases each (seed None: random draws). Returns
    {"requests": n, "statuses": {status: n}, "failures": {key: (message, body)}}."""
    import hypothesis
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

    api = schemathesis.openapi.from_url(f"{base_url}/openapi.json").include(path_regex=ROUTES)
    statuses: collections.Counter = collections.Counter()
    failures: dict = {}
    for result in api.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def one(case):
                response = case.call(base_url=base_url, timeout=120)
                statuses[response.status_code] += 1
                try:
                    case.validate_response(response, checks=[_check_no_5xx, status_code_conformance,
                                                             content_type_conformance],
                                           excluded_checks=[not_a_server_error])
                except (Exception, BaseExceptionGroup) as e:  # noqa: BLE001 - each distinct failure is kept, and the
                    for sub in getattr(e, "exceptions", [e]):   # campaign goes on (schemathesis groups them)
                        first = (str(sub).strip().splitlines() or [type(sub).__name__])[0]
                        key = f"{response.status_code} {op.path} {type(sub).__name__}: {first[:120]}"
                        failures.setdefault(key, (str(sub)[:2000], case.body))

            (one if seed is None else hypothesis.seed(seed)(one))()
    return {"requests": sum(statuses.values()), "statuses": dict(sorted(statuses.items())), "failures": failures}


def normal_request_ok(base_url: str) -> bool:
    body = {"prompt": "after", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(f"{base_url}/v1/completions", method="POST", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=500, help="cases per route and generation mode")
    ap.add_argument("--seed", type=int, default=None, help="derandomized draws (default: random)")
    ap.add_argument("--url", default=None, help="fuzz this server instead of starting one")
    args = ap.parse_args(argv)
    if args.url:
        return report(args.url.rstrip("/"), args)
    from tests.server_helpers import running_server

    with running_server("--slots", "4", "--max-queue", "8", "--max-seq-len", "128") as (_, port):
        return report(f"http://127.0.0.1:{port}", args)


def report(base_url: str, args) -> int:
    t0 = time.monotonic()
    out = run_campaign(base_url, args.examples, args.seed)
    after = normal_request_ok(base_url)
    print(f"fuzz_server: {out['requests']} requests in {time.monotonic() - t0:.0f} s; by status: {out['statuses']}")
    print(f"fuzz_server: {len(out['failures'])} distinct failures; a normal request after: "
          f"{'answered' if after else 'FAILED'}")
    for key, (message, body) in out["failures"].items():
        print(f"\n== {key}\n{message}\nbody: {json.dumps(body)[:500] if body is not None else None}")
    return 0 if after and not out["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
