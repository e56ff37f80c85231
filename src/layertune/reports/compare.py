"""Two builds of the same studies' reports, compared as the reproducibility contract has it.

On one machine a rebuild is bit for bit the same (`.ci/repro-check.sh` compares two builds byte for byte). Across
machines (another CPU, another BLAS) floating-point sums may round differently: STS-B's Spearman moved by 1.8e-6.
So across machines every score must agree within `TOLERANCE` (absolute, in metric units, as written: rounded to 4
digits, so one unit of the last digit) and everything else must be equal: the recommendations, verdicts, seed
counts and keys. A difference that changes an answer is never within tolerance. Projections (`PROJECTIONS`: what
would settle an undecided answer) are not compared: they are no results, and a whole number of seeds or examples
projected from a score may move by one when the score moves in its last digit.

``python -m layertune.reports.compare EXPECTED ACTUAL`` compares every ``<study>.json`` and ``<study>/details.json``
below two report folders and prints each difference by its key; exit status 1 if there is one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

TOLERANCE = 1e-4
PROJECTIONS = frozenset({"what_would_settle"})  # keys of details.json that are estimates of a next study
_SLACK = 1e-9  # 0.6235 - 0.6234 is 1.0000000000065512e-04 in binary: one unit of the last digit must pass


def differences(expected: Any, actual: Any, tolerance: float = TOLERANCE, key: str = "") -> list[str]:
    """Every difference between two JSON values, by key: floats beyond ``tolerance``, anything else unequal."""
    where = key or "(top)"
    if isinstance(expected, dict) and isinstance(actual, dict):
        expected, actual = ({k: v for k, v in side.items() if k not in PROJECTIONS} for side in (expected, actual))
        inner = {k: f"{key}.{k}" if key else str(k) for k in expected.keys() | actual.keys()}
        found = [f"{inner[k]}: missing" for k in expected if k not in actual]
        found += [f"{inner[k]}: not expected" for k in actual if k not in expected]
        for k in expected.keys() & actual.keys():
            found += differences(expected[k], actual[k], tolerance, inner[k])
        return sorted(found)
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, tolerance,
                                                                                      f"{key}[{i}]")]
    if isinstance(expected, float) and isinstance(actual, float):  # scores; counts and layer numbers are ints
        if abs(expected - actual) <= tolerance + _SLACK:
            return []
        return [f"{where}: {expected!r} expected, {actual!r} built (differs by {abs(expected - actual):.2g}, "
                f"more than {tolerance:g})"]
    if type(expected) is not type(actual) or expected != actual:
        return [f"{where}: {expected!r} expected, {actual!r} built"]
    return []


def report_files(folder: Path) -> list[Path]:
    """The metrics and details files of every study in a reports folder, relative to it."""
    files = []
    for metrics in sorted(folder.glob("*.json")):
        files += [Path(metrics.name), Path(metrics.stem) / "details.json"]
    return files


def compare_reports(expected: str | Path, actual: str | Path, tolerance: float = TOLERANCE) -> list[str]:
    """Every difference between the reports below ``expected`` and ``actual`` (see `differences`)."""
    expected, actual = Path(expected), Path(actual)
    wanted, built = report_files(expected), report_files(actual)
    found = [f"{name}: expected, not built" for name in wanted if not (actual / name).is_file()]
    found += [f"{name}: built, not expected" for name in built if name not in wanted and (actual / name).is_file()]
    for name in wanted:
        if (expected / name).is_file() and (actual / name).is_file():
            found += [f"{name}: {d}" for d in differences(json.loads((expected / name).read_text()),
                                                          json.loads((actual / name).read_text()), tolerance)]
        elif not (expected / name).is_file():
            found.append(f"{name}: missing from the expected reports")
    return found


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m layertune.reports.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("expected", type=Path, help="a folder of reports: <study>.json and <study>/details.json")
    parser.add_argument("actual", type=Path, help="the reports of the build to check")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help=f"on each score (default {TOLERANCE:g})")
    args = parser.parse_args(argv)
    for folder in (args.expected, args.actual):
        if not report_files(folder):
            print(f"compare: no <study>.json in {folder}", file=sys.stderr)
            return 2
    found = compare_reports(args.expected, args.actual, args.tolerance)
    for line in found:
        print(line, file=sys.stderr)
    studies = ", ".join(p.stem for p in sorted(args.expected.glob("*.json")))
    print(f"compare: {studies}: " + (f"{len(found)} difference(s)" if found else
                                      f"equal within {args.tolerance:g} on every score, every answer the same"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
