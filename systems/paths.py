"""Where the harness's data is: conf/ and results/reference/ of the checkout this code sits in, or, in an
installed wheel (no checkout around it), the copies setup.py ships beside this module as systems/_data/.
Every module that reads conf/ or the reference data asks here, so both layouts work the same way."""
from __future__ import annotations

from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
SHIPPED = Path(__file__).resolve().parent / "_data"


def in_checkout() -> bool:
    return (CHECKOUT / "conf" / "config.yaml").is_file()


def conf_dir() -> Path:
    """The Hydra config tree (config.yaml and its groups)."""
    return CHECKOUT / "conf" if in_checkout() else SHIPPED / "conf"


def reference_dir() -> Path:
    """results/reference/: the paper's reported values, the authors' runs, the reference popularity profiles."""
    return CHECKOUT / "results" / "reference" if in_checkout() else SHIPPED / "reference"


def results_dir() -> Path:
    """Where records go by default: the checkout's results/, else results/ in the working directory (never
    inside an installed package)."""
    return CHECKOUT / "results" if in_checkout() else Path.cwd() / "results"
