"""Benchmark entry point: `python run.py system=fiddler workload=beam` (see README); `python run.py --help`
lists the choices. The command line itself is runners/cli.py (installed: the `fiddler-bench` command)."""
from runners.cli import run

if __name__ == "__main__":
    run()
