"""Several train.py runs in one launch, one after another on the same processes.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/batch_worker.py RUNS.json
    python tests/batch_worker.py RUNS.json                  # one-process runs

RUNS.json is a list of {"key": ..., "cwd": DIR, "argv": [...]}. Each run goes through train.py's
own entry (dtgpt.cli.run_main with train.py's providers), so it takes the path `torchrun train.py`
takes, less the process start-up (importing torch and dtgpt costs each process seconds, most of
a tiny run). Each run builds and destroys its own process group; the attempt store gives every
one a fresh prefix (dtgpt/faults/attempt_store.py), so no run reads another's keys. After a run
rank 0 writes DIR/KEY.rc (its exit status). A run that raises ends the launch at once
(os._exit): its peers may be blocked in a collective, and the launcher stops them when this
process exits; the runs after it have no .rc file.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # train.py, when run as a script

import torch  # noqa: E402

import train  # noqa: E402
from dtgpt.cli import run_main  # noqa: E402


def main() -> None:
    runs = json.loads(Path(sys.argv[1]).read_text())
    rank = int(os.environ.get("RANK", "0"))
    for run in runs:
        print(f"=== run {run['key']} ===", flush=True)
        os.chdir(run["cwd"])
        torch._dynamo.reset()  # a compiled run starts from a clean slate, as in a process of its own
        try:
            status = run_main(run["argv"], train.model_provider, train.datasets_provider)
        except BaseException:
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        sys.stdout.flush()
        if rank == 0:
            Path(run["cwd"], f"{run['key']}.rc").write_text(str(status))


if __name__ == "__main__":
    main()
