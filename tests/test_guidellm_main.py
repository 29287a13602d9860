"""runners/serving/guidellm_main.py: guidellm's Poisson schedule gets its origin before its workers are released
(guidellm 0.8.1 releases them first, and a worker reading the unset origin sends every request at once)."""
import asyncio
import importlib.util
import subprocess
from multiprocessing import get_context

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("guidellm") is None,
                                reason="guidellm (the serving extra) is not installed")


def origin_at_release(strategy) -> list[float]:
    """The schedule's origin as the workers see it at the moment they are released."""
    strategy.init_processes_timings(worker_count=1, max_concurrency=1, mp_context=get_context("spawn"))
    event, seen = strategy._processes_init_event, []
    release = event.set
    event.set = lambda: (seen.append(strategy._offset.value), release())
    strategy.init_processes_start(1000.0)
    return seen


def test_the_poisson_origin_is_set_before_the_workers_start(monkeypatch):
    from guidellm.scheduler.strategies import AsyncPoissonStrategy

    from runners.serving.guidellm_main import fix_poisson_origin

    monkeypatch.setattr(AsyncPoissonStrategy, "init_processes_start", AsyncPoissonStrategy.init_processes_start)
    assert origin_at_release(AsyncPoissonStrategy(rate=0.5)) == [-1.0]  # as shipped: the race a worker can win
    assert fix_poisson_origin()
    s = AsyncPoissonStrategy(rate=0.5, random_seed=3)
    assert origin_at_release(s) == [1000.0]
    times = [asyncio.run(s.next_request_time(0)) for _ in range(3)]
    assert 1000.0 < times[0] < times[1] < times[2]  # the schedule runs on from the origin, as guidellm means it


def test_the_wrapper_is_guidellms_command_line():
    from runners.serving.workload import guidellm_command

    cmd = guidellm_command()
    assert cmd[1:] == ["-m", "runners.serving.guidellm_main"]
    out = subprocess.run(cmd + ["run", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--profile" in out.stdout
