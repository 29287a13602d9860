#!/usr/bin/env python
"""One run of issue 47's five-system sweep on the tree in the current directory (scripts/ab.py runs it on each
side): `python run.py -m system=fiddler,hf_transformers,llama_cpp,mixtral_offloading,deepspeed_mii
model=small_mixtral workload=single_batch 'workload.input_lens=[64]' 'workload.output_lens=[32]'`, into a
scratch sweep folder with a fresh index (so no earlier record resumes), then one JSON line: each system's
status and e2e / decode tok/s, read from that index. Every record is appended to raw_<side>.jsonl beside
this file (AB_SIDE, AB_ROUND from scripts/ab.py). Kept as data with the commit it ran at."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

SYSTEMS = "fiddler,hf_transformers,llama_cpp,mixtral_offloading,deepspeed_mii"
HERE = Path(__file__).resolve().parent

with tempfile.TemporaryDirectory() as tmp:
    index = Path(tmp) / "index.jsonl"
    res = subprocess.run([sys.executable, "run.py", "-m", f"system={SYSTEMS}", "model=small_mixtral",
                          "workload=single_batch", "workload.input_lens=[64]", "workload.output_lens=[32]",
                          f"hydra.sweep.dir={tmp}/sweep", f"run.index_path={index}", "run.progress=false"],
                         capture_output=True, text=True)
    recs = [json.loads(line) for line in index.read_text().splitlines() if line.strip()] if index.exists() else []
if not recs:
    sys.exit(f"no records (exit {res.returncode}): {res.stderr[-2000:]}")
with open(HERE / f"raw_{os.environ.get('AB_SIDE', 'x')}.jsonl", "a") as f:
    for r in recs:
        f.write(json.dumps({"round": os.environ.get("AB_ROUND"), **r}) + "\n")
out = {"status": {}, "e2e_tok_s": {}, "decode_tok_s": {}}
for r in recs:
    s = r["system"]
    out["status"][s] = r["status"]
    m = r.get("metrics") or {}
    for k in ("e2e_tok_s", "decode_tok_s"):
        if m.get(k) is not None:
            out[k][s] = m[k]
print(json.dumps(out))
