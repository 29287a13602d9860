#!/usr/bin/env python
"""Generate (or reuse) a random-weight Mixtral checkpoint and print its directory.

Examples:
  python scripts/make_tiny_model.py --preset tiny_mixtral
  python scripts/make_tiny_model.py --name my_moe --out /tmp/models --arch-json '{"hidden_size": 64}'
The printed path is the last stdout line, so shell callers can do DIR=$(... | tail -1).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # usable from a checkout without `pip install -e .`

from runners.synthetic import default_cache_root, ensure_synthetic_model  # noqa: E402
from runners.models import preset as load_preset, synthetic_presets  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=synthetic_presets(), help="named architecture (arch-json overrides keys)")
    p.add_argument("--name", help="model name, the directory prefix (default: the preset name)")
    p.add_argument("--out", help=f"cache root (default: {default_cache_root()})")
    p.add_argument("--arch-json", default="{}", help="Mixtral config keys as JSON, e.g. '{\"hidden_size\": 64}'")
    p.add_argument("--seed", type=int, default=None, help="weight seed (default: preset's, else 0)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"])
    p.add_argument("--shard-size-mb", type=int, default=None, help="max safetensors shard size in MB")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)

    arch, seed, dtype = load_preset(args.preset) if args.preset else ({}, 0, "bfloat16")
    arch.update(json.loads(args.arch_json))
    if args.seed is not None:
        seed = args.seed
    dtype = args.dtype or dtype
    name = args.name or args.preset
    if not name:
        p.error("give --name or --preset")
    path = ensure_synthetic_model(name, arch, seed, args.out or default_cache_root(), dtype=dtype,
                                  shard_size_mb=args.shard_size_mb, progress=not args.quiet)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
