"""Each mutated module's mutation score, from the results mutmut left in ``mutants/`` (one ``.meta`` file
per source file: every mutant's exit code), and the survivors by module. A mutant killed by a failing test
or a timeout (a mutant that runs forever) counts as killed; one with no test to run counts as survived.

    python scripts/mutation_scores.py [--min 0.9]     # exits 1 when a module scores under the minimum
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

KILLED = {1, 3, 24, -24, 36, 152, 255, 37}  # failing tests, a pytest error, timeouts, caught by type check
SURVIVED = {0, 5, 33}  # no test failed, or no test covers it


def scores(mutants: Path) -> dict[str, Counter[str]]:
    out: dict[str, Counter[str]] = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        module = str(meta.relative_to(mutants)).removesuffix(".meta")
        codes = json.loads(meta.read_text()).get("exit_code_by_key", {})
        tally: Counter[str] = Counter()
        for code in codes.values():
            tally["killed" if code in KILLED else "survived" if code in SURVIVED else "other"] += 1
        out[module] = tally
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mutants", default="mutants")
    ap.add_argument("--min", type=float, default=0.9, help="the score every module must reach")
    args = ap.parse_args(argv)
    found = scores(Path(args.mutants))
    if not found:
        print("no mutation results under", args.mutants, file=sys.stderr)
        return 2
    print(f"{'module':58} {'killed':>7} {'surv.':>6} {'other':>6} {'score':>7}")
    low = []
    total: Counter[str] = Counter()
    for module, t in found.items():
        n = t["killed"] + t["survived"]
        total.update(t)
        if not n:  # nothing decided: no mutant, or none run yet
            flag = "  not run" if t["other"] else ""
            low += [module] if flag else []
            print(f"{module:58} {t['killed']:7} {t['survived']:6} {t['other']:6} {'-':>7}{flag}")
            continue
        score = t["killed"] / n
        flag = "" if score >= args.min else "  < min"
        low += [module] if flag else []
        print(f"{module:58} {t['killed']:7} {t['survived']:6} {t['other']:6} {score:7.1%}{flag}")
    n = total["killed"] + total["survived"]
    overall = f"{total['killed'] / n:7.1%}" if n else f"{'-':>7}"
    print(f"{'all':58} {total['killed']:7} {total['survived']:6} {total['other']:6} {overall}")
    return 1 if low else 0


if __name__ == "__main__":
    sys.exit(main())
