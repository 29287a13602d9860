"""The noise rule: whether one side of a side-by-side measurement differs from the other beyond noise
(`verdict`). One place for every comparison this project makes: `scripts/ab.py` (A/B of two revisions),
`scripts/regress.py` (its side-by-side check) and `python -m runners.compare` (two record sets).
"""
from __future__ import annotations

import math
import statistics

SIGN_ALPHA = 0.10  # two-sided: the most a no-change could produce that many rounds on one side by luck
MAD_SIGMA = 1.4826  # MAD x this estimates the standard deviation of normally distributed readings


def _rel_spread(x: list[float]) -> float:
    """The scatter of readings (a side's, or the ratios'): their robust standard deviation (MAD_SIGMA x
    median absolute deviation) relative to their median. 0 when most agree; inf when their median is 0
    but they do not."""
    med = statistics.median(x)
    mad = statistics.median(abs(v - med) for v in x)
    if mad == 0:
        return 0.0
    return math.inf if med == 0 else MAD_SIGMA * mad / abs(med)


def _ratio(h: float, b: float) -> float:
    if b == 0:
        return 1.0 if h == 0 else math.inf
    return h / b


def rounds_needed(n: int, alpha: float = SIGN_ALPHA) -> int | None:
    """The fewest of n rounds that must fall on one side of 1 for a two-sided sign test to reject "no
    change" at alpha: the smallest k with 2 * P(X >= k) <= alpha, X ~ Binomial(n, 1/2). None when even n
    of n does not (n < 5 at alpha 0.10)."""
    for k in range(n // 2 + 1, n + 1):
        if 2 * sum(math.comb(n, j) for j in range(k, n + 1)) / 2**n <= alpha:
            return k
    return None


def verdict(base: list[float], head: list[float], tolerance: float = 0.0, alpha: float = SIGN_ALPHA) -> dict:
    """Whether head differs from base beyond noise, from readings paired by round (base[i] and head[i]
    were measured in the same round, next to each other).

    The rule:
    - ratio of round i: r_i = head[i] / base[i] (1 when both are 0, inf when only base is); the effect is
      their median m;
    - noise is scatter measured as s = 1.4826 x MAD / median (a robust standard deviation, relative; one
      wild round does not move it). Each side's own scatter predicts that a round's ratio scatters by about
      sqrt(s_base^2 + s_head^2); the ratios' own scatter s_ratio measures it directly (larger when the two
      sides move apart from round to round, smaller when a busy machine moves both alike). The noise band is
      the larger of the two (and at least `tolerance`, a fraction: 0.02 means "within 2%" even when the
      readings are steadier than that);
    - "changed" only if |m - 1| > band AND at least `rounds_needed(n)` of the n rounds have r_i on the
      same side of 1 as m (a two-sided sign test at `alpha`, default 10%: with 5 rounds all 5 must agree,
      with 10 rounds 9). Rounds with r_i == 1 count against. The first condition asks for an effect larger
      than one round's own noise, the second for an effect that is not one or two lucky rounds.
    With fewer than 5 rounds (at alpha 0.10) the sign test can never reject, so the answer is "within
    noise": too few rounds to tell, which `why` says.

    Returns {"rounds", "ratios", "median_ratio", "band", "noise": {"base", "head", "ratio"}, "tolerance", "agree",
    "agree_needed", "changed", "direction" ("higher" | "lower" | None: head/base), "verdict" ("within
    noise" | "changed (head/base higher)" | "changed (head/base lower)"), "why"}.
    Raises ValueError for no readings, unequal lengths, or a reading that is negative or not finite.
    """
    base, head = [float(v) for v in base], [float(v) for v in head]
    if not base or len(base) != len(head):
        raise ValueError(f"verdict needs paired readings, got {len(base)} base and {len(head)} head")
    bad = [v for v in base + head if not math.isfinite(v) or v < 0]
    if bad:
        raise ValueError(f"readings must be finite and >= 0 to be divided, got {bad[0]!r}")
    n = len(base)
    ratios = [_ratio(h, b) for b, h in zip(base, head)]
    m = statistics.median(ratios)
    sb, sh = _rel_spread(base), _rel_spread(head)
    if all(math.isfinite(r) for r in ratios):
        sr = _rel_spread(ratios)
    else:  # a base of 0 in some rounds: the ratios have no scale unless every one is the same
        sr = 0.0 if len(set(ratios)) == 1 else math.inf
    band = max(math.hypot(sb, sh), sr, tolerance)
    direction = "higher" if m > 1 else "lower" if m < 1 else None
    agree = sum(r > 1 for r in ratios) if m > 1 else sum(r < 1 for r in ratios) if m < 1 else 0
    need = rounds_needed(n, alpha)
    beyond = abs(m - 1) > band
    changed = bool(beyond and need is not None and agree >= need)
    if changed:
        why = (f"|{m:.4g} - 1| > band {band:.4g} and {agree} of {n} rounds {direction} "
               f"(a sign test needs {need})")
    elif not beyond:
        why = f"|{m:.4g} - 1| <= band {band:.4g}"
    elif need is None:
        why = f"{n} round{'s' if n != 1 else ''}: too few for a sign test at {alpha:g} to tell (needs >= {min_rounds(alpha)})"
    else:
        why = f"only {agree} of {n} rounds {direction} (a sign test at {alpha:g} needs {need})"
    return {"rounds": n, "ratios": ratios, "median_ratio": m, "band": band, "noise": {"base": sb, "head": sh, "ratio": sr},
            "tolerance": tolerance, "agree": agree, "agree_needed": need, "changed": changed,
            "direction": direction if changed else None,
            "verdict": f"changed (head/base {direction})" if changed else "within noise", "why": why}


def min_rounds(alpha: float = SIGN_ALPHA) -> int:
    """The fewest rounds with which `verdict` can say "changed" at alpha."""
    n = 1
    while rounds_needed(n, alpha) is None:
        n += 1
    return n
