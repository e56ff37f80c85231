"""The sequential rule of decided studies, simulated (docs/pipeline.md, "Deciding in rounds"): how often its claims
are wrong, and how much each trained cell settles, on synthetic cells with known accuracies (the simulation of
tests/test_sequential.py, at 1,000 repetitions).

    python benchmarks/decide_simulation.py --json reports/benchmarks/decide_simulation.json   # about 15 min

Two tables, every row on the same cells for the rules it compares:
- **Unequal seed spreads** (`UNEQUAL`, a setting on the tolerance's edge where a claim about it is wrong): the worst
  wrong-claim rate over the settings, under each pair's own seed spread (the reports' rule) and under the settings'
  pooled spread alone.
- **Where the seeds go** (the default studies' seed spreads, and `UNEQUAL` with a "yes" on the edge wrong): rule 2,
  the next seeds only where they can settle something (`layertune.rounds.allocate`), against rule 1, the next seeds
  to every setting not shown worse: wrong claims, comparisons settled, cells trained, settled per cell.

It exits with status 1, naming the row, if a claim of the reports' rule is wrong more often than 5% beyond the
simulation noise, if the pooled spread never is, or if rule 2 settles fewer comparisons per cell than rule 1.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src"), str(Path(__file__).resolve().parent)]

REPETITIONS = 1000


def unequal_row(case: str, claim: str, repetitions: int) -> dict:
    from layertune.statistics import pooled_spread
    from tests.test_sequential import wrong_claims

    own = wrong_claims(case, claim, repetitions)
    pooled = wrong_claims(case, claim, repetitions, spread_of=pooled_spread)
    return {"case": case, "wrong_claim": claim, "own_edge": own[0], "own_worst": own[1], "pooled_edge": pooled[0],
            "pooled_worst": pooled[1]}


def allocation_row(case: str, repetitions: int) -> dict:
    from tests.test_sequential import allocations_compared

    return {"case": case, **{("rule_1" if "rule 1" in name else "rule_2"): row
                             for name, row in allocations_compared(case, repetitions).items()}}


def main() -> int:
    from layertune.io import write_json
    from machine_speed import describe, reference
    from tests.test_sequential import DEFAULT_STUDIES, EDGE, UNEQUAL, within_noise

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, default=REPETITIONS)
    parser.add_argument("--jobs", type=int, default=2, help="processes (each row is one)")
    parser.add_argument("--json", type=Path, help="write the tables here")
    args = parser.parse_args()
    machine, started = reference(), time.perf_counter()
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        unequal = [pool.submit(unequal_row, case, claim, args.repetitions) for case in UNEQUAL for claim in EDGE]
        allocation = [pool.submit(allocation_row, case, args.repetitions) for case in [*DEFAULT_STUDIES, *UNEQUAL]]
        unequal, allocation = [job.result() for job in unequal], [job.result() for job in allocation]

    print(f"{args.repetitions:,} repetitions each, on {describe(machine)}, in {time.perf_counter() - started:.0f} s\n")
    print("| seed spreads | wrong claim | worst wrong, each pair's own spread | worst wrong, pooled spread |")
    print("|---|---|---:|---:|")
    for row in unequal:
        print(f"| {row['case']} | {row['wrong_claim']} | {row['own_worst']:.1%} | {row['pooled_worst']:.1%} |")
    print("\n| seed spreads | rule | worst wrong | settled | cells | settled per 100 cells |")
    print("|---|---|---:|---:|---:|---:|")
    for row in allocation:
        for rule in ("rule_1", "rule_2"):
            found = row[rule]
            print(f"| {row['case']} | {rule.replace('_', ' ')} | {found['wrong']:.1%} | {found['settled']:.2f} | "
                  f"{found['cells']:.1f} | {100 * found['settled_per_cell']:.2f} |")

    failed = [f"{row['case']}, a wrong {row['wrong_claim']}: {row['own_worst']:.1%} under each pair's own spread"
              for row in unequal if not within_noise(row["own_worst"], args.repetitions)]
    failed += [f"{row['case']}: {row['rule_2']['wrong']:.1%} wrong under rule 2" for row in allocation
               if not within_noise(row["rule_2"]["wrong"], args.repetitions)]
    failed += [f"{row['case']}: rule 2 settles {row['rule_2']['settled_per_cell']:.4f} a cell, rule 1 "
               f"{row['rule_1']['settled_per_cell']:.4f}" for row in allocation
               if row["rule_2"]["settled_per_cell"] <= row["rule_1"]["settled_per_cell"]]
    if max(row["pooled_worst"] for row in unequal) <= 0.1:
        failed.append("the pooled spread alone is never wrong more than 10% of the time")
    if args.json:
        write_json(args.json, {"machine": machine, "repetitions": args.repetitions, "unequal_spreads": unequal,
                               "allocation": allocation, "failed": failed})
    for line in failed:
        print(f"FAIL: {line}", file=sys.stderr)
    print("PASS" if not failed else f"{len(failed)} check(s) failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
