"""guidellm's own command line (`guidellm run ...`), with its Poisson schedule's origin set before its workers
start: `python -m runners.serving.guidellm_main run ...`, what workload=serving runs.

Why: guidellm 0.8.1's AsyncPoissonStrategy.init_processes_start releases the workers (the base class sets the
start event) before it writes the schedule's origin (`_offset`, -1.0 until then). A worker that wakes first
reads -1.0 and schedules every request at -1 + the sum of the exponential gaps: a time long past, so all of them
go out at once. Measured on an Intel Xeon (2 cores, small_mixtral): a 0.329 requests/s level twice sent its 64
requests within 0.3 s (227-295 requests/s, TTFT p99 85 s), and the first try of 0.164 did the same; the retry
of 0.164 went out at 0.143. Whether the worker or the writer wins is a race, so some levels keep their
schedule and some burst. Setting the origin first leaves nothing to race; everything else is guidellm's.
"""
from __future__ import annotations

import sys


def fix_poisson_origin() -> bool:
    """Make AsyncPoissonStrategy write its origin before it releases the workers. False where this guidellm has
    no such strategy or no `_offset` (a version that schedules otherwise: left as it is)."""
    from guidellm.scheduler import strategies

    poisson = getattr(strategies, "AsyncPoissonStrategy", None)
    base = getattr(strategies, "ThroughputStrategy", None)
    if poisson is None or base is None or "_offset" not in getattr(poisson, "__private_attributes__", {}):
        return False

    def init_processes_start(self, start_time: float) -> None:
        if self._offset is None:
            raise RuntimeError("init_processes_start called before init_processes_timings")
        with self._offset.get_lock():
            self._offset.value = start_time
        base.init_processes_start(self, start_time)  # sets the start time and releases the workers

    poisson.init_processes_start = init_processes_start
    return True


def main() -> None:
    fix_poisson_origin()
    from guidellm.cli import cli

    sys.argv[0] = "guidellm"
    sys.exit(cli())


if __name__ == "__main__":
    main()
