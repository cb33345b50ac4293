"""What the default export budget keeps at 10, 100, 1,000 and 10,000 requests a second.

The exporter's own decision (``sampling.decide``'s reason, then ``ExportBudget.admit`` with the defaults
of ``Settings``), fed ten minutes of verdicts a second apart in virtual time: no server, so the figures are
exact and the same on every run. Two mixes: a healthy service (2 % slow, 3 % diagnosed, 0.5 % errors, the
default 10 % healthy share of the rest) and a saturated one (every trace slow and diagnosed, 0.5 % errors).
Eight signatures (two routes, two bottleneck stages, with and without a diagnosis), one of them rare.

    .venv/bin/python benchmarks/export_budget.py
"""

from __future__ import annotations

import math
import random
import sys
from collections import Counter

from stagetrace.exporter.budget import BudgetLimits, ExportBudget, signature_of
from stagetrace.exporter.keep import Keep
from stagetrace.settings import Settings

SECONDS = 600
SIGNATURES = [
    signature_of(route, route, stage, codes)
    for route in ("/predict", "/embed")
    for stage in ("decode", "infer")
    for codes in ((), ("GIL_CONTENTION",))
]


def reason(rng: random.Random, saturated: bool) -> Keep:
    draw = rng.random()
    if draw < 0.005:
        return Keep.ERROR
    if saturated:
        return Keep.SLOW
    if draw < 0.025:
        return Keep.SLOW
    if draw < 0.055:
        return Keep.DIAGNOSED
    return Keep.HEALTHY_SAMPLE if rng.random() < 0.1 else Keep.DROPPED


def run(load_per_s: int, saturated: bool, limits: BudgetLimits) -> dict[str, float]:
    rng = random.Random(load_per_s * 2 + saturated)
    budget = ExportBudget(limits, 0.0)
    wanted = kept = errors = errors_kept = 0
    rare_seen, rare_kept = Counter[int](), Counter[int]()
    for i in range(load_per_s * SECONDS):
        now = i / load_per_s
        keep = reason(rng, saturated)
        sig = SIGNATURES[-1] if rng.random() < 0.001 else rng.choice(SIGNATURES[:-1])
        final = budget.admit(keep, sig, rng.lognormvariate(5, 0.5), now)
        wanted += keep.kept
        kept += final.kept
        errors += keep is Keep.ERROR
        errors_kept += final is Keep.ERROR
        if sig == SIGNATURES[-1] and keep.kept:
            rare_seen[int(now // 60)] += 1
            rare_kept[int(now // 60)] += final.kept
    return {
        "wanted": wanted / SECONDS,
        "kept": kept / SECONDS,
        "errors": errors_kept / errors if errors else 1.0,
        # of the minutes in which the rare kind had a trace worth keeping, those in which one was kept
        "rare_minutes": sum(1 for m in rare_seen if rare_kept[m]) / len(rare_seen) if rare_seen else float("nan"),
    }


def _share(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0%}"


def main() -> None:
    limits = BudgetLimits.from_settings(Settings())
    loads = [int(a) for a in sys.argv[1:]] or [10, 100, 1000, 10_000]
    print(f"export budget {limits.per_s}/s (burst {limits.burst}), {limits.signature_per_s}/s per signature")
    print(
        "| service | req/s | worth keeping /s | exported /s | exported / budget | errors kept "
        "| minutes the rare kind was kept |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for saturated in (False, True):
        for load in loads:
            r = run(load, saturated, limits)
            print(
                f"| {'saturated' if saturated else 'healthy'} | {load:,} | {r['wanted']:.1f} | {r['kept']:.1f} | "
                f"{r['kept'] / (limits.per_s or 1):.2f} | {r['errors']:.0%} | {_share(r['rare_minutes'])} |"
            )


if __name__ == "__main__":
    main()
