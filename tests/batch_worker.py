"""Several train.py runs in one launch, one after another on the same processes.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/batch_worker.py RUNS.json
    python tests/batch_worker.py RUNS.json                  # one-process runs

RUNS.json is a list of {"key": ..., "cwd": DIR, "argv": [...]}. Each run goes through train.py's
own entry (dtgpt.cli.run_main with train.py's providers), so it takes the path `torchrun train.py`
takes, less the process start-up (importing torch and dtgpt costs each process seconds, most of
a tiny run). Each run builds and destroys its own process group; the attempt store gives every
one a fresh prefix (dtgpt/faults/attempt_store.py), so no run reads another's keys. After a run
rank 0 writes DIR/KEY.rc (its exit status), and each rank's DIR/KEY.rankR.out holds what it printed
during the run (Python's stdout and stderr; the ranks' lines interleave in the launch's own
output, and one rank may start the next run before another has printed its last). A run that raises ends the launch at once
(os._exit): its peers may be blocked in a collective, and the launcher stops them when this
process exits; the runs after it have no .rc file.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # train.py, when run as a script

import torch  # noqa: E402

import train  # noqa: E402
from dtgpt.cli import exit_process, run_main  # noqa: E402


class Tee(io.TextIOBase):
    """A text stream that writes to another one and to a file."""

    def __init__(self, stream, file):
        self.stream, self.file = stream, file

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.file.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.file.flush()

    def fileno(self) -> int:
        return self.stream.fileno()

    def isatty(self) -> bool:
        return self.stream.isatty()


def forget_earlier_meshes() -> None:
    """Empty DTensor's caches of sharding and redistribution plans. A DeviceMesh compares equal to
    another of the same ranks and dimension names whatever its process groups, so a plan cached
    by an earlier run would hand this run's DTensors that run's mesh: its groups are destroyed,
    and as group names restart with every default group, its names may now be other groups'
    ("Could not resolve the process group registered under the name 25"). A process of its own
    starts with them empty."""
    from torch.distributed.tensor import _redistribute, _sharding_prop
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    _sharding_prop.ShardingPropagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute.clear_redistribute_planner_cache()
    _redistribute._gen_transform_infos.cache_clear()


def entry(run: dict):
    """What a run calls with its argv: train.py's entry, or the function it names."""
    if "call" not in run:
        return lambda argv: run_main(argv, train.model_provider, train.datasets_provider)
    module, function = run["call"].split(":")
    return getattr(importlib.import_module(module), function)


def main() -> None:
    runs = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    for run in runs:
        print(f"=== run {run['key']} ===", flush=True)
        os.chdir(run["cwd"])
        torch._dynamo.reset()  # a compiled run starts from a clean slate, as in a process of its own
        forget_earlier_meshes()
        with open(f"{run['key']}.rank{rank}.out", "w") as out, contextlib.redirect_stdout(Tee(sys.stdout, out)), \
                contextlib.redirect_stderr(Tee(sys.stderr, out)):  # fmt: skip
            try:
                status = entry(run)(run["argv"])
            except BaseException:
                traceback.print_exc()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
        sys.stdout.flush()
        if rank == 0:
            Path(run["cwd"], f"{run['key']}.rc").write_text(str(status))
    exit_process(0)  # as train.py ends


if __name__ == "__main__":
    main()
