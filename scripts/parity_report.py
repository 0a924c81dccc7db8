"""Run every parity layout of tests/test_parity.py and print its largest differences from one process.

    python scripts/parity_report.py [--only name,name]

Per layout: the largest relative difference of the loss and of the gradient norm over the
iterations, of a final parameter tensor (the key bias left out, see tests/parity_oracle.py) and
of all final parameters as one vector; then the run time.
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.parity_oracle import RTOL, relative_distance, without_key_bias  # noqa: E402
from tests.runs import train_run  # noqa: E402
from tests.test_parity import LAYOUTS, RUN, STEPS, model_overrides  # noqa: E402


def differences(got: dict, want: dict) -> tuple[float, float, float, float]:
    """(loss, grad_norm, worst parameter tensor, all parameters) relative differences."""
    per_iteration = [max(abs(g - w) / abs(w) for g, w in zip(got[key], want[key])) for key in ("loss", "grad_norm")]
    final, reference, heads = got["params"][STEPS], want["params"][STEPS], want["heads"]
    tensors = max(relative_distance(without_key_bias(k, final[k], heads), without_key_bias(k, reference[k], heads)) for k in reference)
    whole = relative_distance(torch.cat([final[k].flatten() for k in reference]), torch.cat([reference[k].flatten() for k in reference]))
    return per_iteration[0], per_iteration[1], tensors, whole


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated layout names")
    args = parser.parse_args()
    names = [n for n in LAYOUTS if not args.only or n in args.only.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        references: dict[tuple, dict] = {}
        print(f"{'layout':28s} {'ranks':>5s} {'loss':>9s} {'grad_norm':>9s} {'tensor':>9s} {'params':>9s} {'seconds':>8s}")
        worst = 0.0
        for name in names:
            ranks, overrides, _ = LAYOUTS[name]
            model_args = tuple(model_overrides(overrides))
            if model_args not in references:  # e.g. an untied model has its own reference
                path = Path(tmp) / f"single_{len(references)}"
                path.mkdir()
                references[model_args] = train_run(path, RUN + list(model_args), name="single")
            start = time.perf_counter()
            path = Path(tmp) / name
            path.mkdir()
            diffs = differences(train_run(path, RUN + overrides, nproc=ranks), references[model_args])
            worst = max(worst, *diffs)
            print(f"{name:28s} {ranks:5d} " + " ".join(f"{d:9.2e}" for d in diffs) + f" {time.perf_counter() - start:8.1f}", flush=True)
    print(f"worst relative difference over {STEPS} iterations: {worst:.2e} (tolerance {RTOL:g})")
    return 0 if worst <= RTOL else 1


if __name__ == "__main__":
    sys.exit(main())
