"""How much of the oracle's gap can a policy that learns from one request's routing close at all, when routing has
no temporal locality (sim.reuse=0)? Cache contents only, no clock: every fill lands at once (no copy time, no
slot lost), one per layer call, after the prefill. Hit rates of decayed-LFU residency (fiddler.residency) with
its defaults and with no decay, placed from subject A, routed from subject B (ProfileRouting, reuse 0), against
static from A and the oracle static from B; 56 slots over Mixtral-8x7B's 32 x 8 (about rtx4090's).

    python learning_limit.py PROFILE_DIR OUTPUT_TOKENS
"""
import itertools
import statistics
import sys

import numpy as np

import fiddler.residency as R
from fiddler.popularity import Popularity
from fiddler.sim.routing import ProfileRouting

SLOTS = 56


def placement(pop):
    L, E = pop.shape
    m = [[False] * E for _ in range(L)]
    for l, e in pop.ranking()[:SLOTS]:
        m[l][e] = True
    return m


def hits(A, steps, resident, pol, **kw):
    L, E = A.shape
    res = [list(r) for r in resident]
    p = R.make_policy(pol, res, A.shares()) if not kw else R.DecayedLFUPolicy(res, A.shares(), **kw)
    h = t = 0
    for st in steps:
        for l in range(L):
            c = np.bincount(st.ids[l].ravel(), minlength=E).tolist()
            h += sum(n for n, r in zip(c, res[l]) if r)
            t += sum(c)
            p.observe(l, c, res[l])
            if st.prefill or not p.adaptive:
                continue
            e = p.candidate(l, c, res[l])
            v = p.victim(l, res) if e is not None else None
            if v is not None and p.admit(l, e, v):
                res[v[0]][v[1]], res[l][e] = False, True
                p.swapped(l, e, v)
    return h / t


def main():
    folder, out = sys.argv[1], int(sys.argv[2])
    subjects = sorted(p.rsplit("/", 1)[-1][:-5] for p in __import__("glob").glob(folder + "/*.json"))
    closed = {"lfu": [], "lfu, no decay": []}
    for a, b in itertools.permutations(subjects, 2):
        A = Popularity.load(f"{folder}/{a}.json", top_k=2)
        B = Popularity.load(f"{folder}/{b}.json", top_k=2)
        steps = list(ProfileRouting(B, reuse=0.0, seed=0).steps(64, out, 1))
        s, o = hits(A, steps, placement(A), "static"), hits(A, steps, placement(B), "static")
        for name, kw in (("lfu", {}), ("lfu, no decay", {"half_life": 1e9})):
            x = hits(A, steps, placement(A), "lfu", **kw)
            closed[name].append((x - s) / (o - s) if o > s else None)
    for name, c in closed.items():
        c = [v for v in c if v is not None]
        print(f"{name}: median share of the hit-rate gap closed {statistics.median(c):.2f} over {len(c)} pairs "
              f"({out} output tokens)")


if __name__ == "__main__":
    main()
