"""CI: regenerate a few cells of the committed paper reproduction (the Fig. 4 cell, input 32 x output 256, of
the systems as the paper ran them on the paper's two machines) with `run.py -m` in simulate mode, render them
with the same code as scripts/reproduce_paper.py, and check every regenerated row is byte-identical to a line of
the committed results/paper/single_batch.csv (a stale commit of results/paper/ fails here)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_fig4_cells_regenerate_byte_identical(tmp_path):
    sys.path.insert(0, str(ROOT))
    from runners import paper
    from runners.records import collect

    cmd = [sys.executable, "run.py", "-m", "+experiment=paper_single_batch", "workload.input_lens=[32]",
           "workload.output_lens=[256]", "environment=paper_env1,paper_env2",
           "system=fiddler_original,llama_cpp_original,mixtral_offloading_original,deepspeed_mii",
           f"hydra.sweep.dir={tmp_path / 'sweep'}", f"run.index_path={tmp_path / 'index.jsonl'}", "run.resume=false",
           "run.progress=false"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    recs = collect([tmp_path / "sweep"])
    assert len(recs) == 8
    reported = paper.load_reported(ROOT / "results" / "reference" / "paper" / "paper-reported.csv")
    long = paper.figure_long(paper.frame(recs), paper.FIGURES["single_batch"], reported)
    lines = paper.to_csv(long).splitlines()
    committed = (ROOT / "results" / "paper" / "single_batch.csv").read_text().splitlines()
    assert lines[0] == committed[0]
    missing = [line for line in lines[1:] if line not in committed]
    assert not missing, f"regenerated rows not in the committed single_batch.csv: {missing}"
