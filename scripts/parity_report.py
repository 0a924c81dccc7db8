"""Run every parity layout of tests/test_parity.py and print max loss difference and run time.

    python scripts/parity_report.py [--only name,name]
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.runs import train_losses  # noqa: E402
from tests.test_parity import LAYOUTS, RTOL, RUN, STEPS, model_overrides  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated layout names")
    args = parser.parse_args()
    names = [n for n in LAYOUTS if not args.only or n in args.only.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        references = {(): train_losses(Path(tmp), RUN, name="single")}
        print(f"{'layout':28s} {'ranks':>5s} {'max |rel diff|':>15s} {'seconds':>8s}")
        print(f"{'single process':28s} {1:5d} {'(reference)':>15s} {time.perf_counter() - start:8.1f}", flush=True)
        worst = 0.0
        for name in names:
            ranks, overrides, _ = LAYOUTS[name]
            model_args = tuple(model_overrides(overrides))
            if model_args not in references:  # e.g. an untied model has its own reference
                references[model_args] = train_losses(Path(tmp), RUN + list(model_args), name=f"single_{name}")
            start = time.perf_counter()
            losses = train_losses(Path(tmp), RUN + overrides, nproc=ranks, name=name)
            diff = max(abs(a - b) / abs(b) for a, b in zip(losses, references[model_args]))
            worst = max(worst, diff)
            print(f"{name:28s} {ranks:5d} {diff:15.2e} {time.perf_counter() - start:8.1f}", flush=True)
    print(f"worst relative difference over {STEPS} iterations: {worst:.2e} (tolerance {RTOL:g})")
    return 0 if worst <= RTOL else 1


if __name__ == "__main__":
    sys.exit(main())
