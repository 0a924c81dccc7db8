"""A toy worker for tests/test_launcher.py: no training, only what the launcher must get right.

Usage: replace_worker.py OUT_DIR MODE. Every process writes OUT_DIR/start-<rank>-<restart>-<replacement>.json
(its pid and environment). Rank 3 of the first round (its original process) SIGKILLs itself;
then, by MODE:

- `kill-once`: the survivors wait for the launcher's `replacing` key and the replacement's file,
  record the key, and exit 0; the replacement exits 0.
- `survivors-fail`: as kill-once, but in the first round the survivors then exit 1 (they "could
  not recover"); in the next round everyone exits 0.
- `kill-always`: every rank-3 process of every round SIGKILLs itself; the survivors wait until
  the launcher stops them, and on its SIGTERM record the `no_replacement` key if it is set.
- `sleep`: nobody dies; every rank waits until the launcher stops it (SIGTERM recorded).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

from torch.distributed import TCPStore

from dtgpt.run.keys import no_replacement_key, replacement_number, replacing_key, started_key

VICTIM = 3
WAIT_S = 240
"""How long a survivor waits for what the launcher does next (a replacement, or SIGTERM): a safety
net under the test's 300 s, far beyond two worker start-ups (importing torch) on a loaded machine."""


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    replacement = replacement_number()
    me = f"{rank}-{restart}-{replacement}"
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)

    def on_sigterm(signum, frame):
        key = no_replacement_key(VICTIM)
        seen = store.get(key).decode() if store.check([key]) else None
        (out / f"sigterm-{me}.json").write_text(json.dumps({"no_replacement": seen}))
        sys.exit(1)

    signal.signal(signal.SIGTERM, on_sigterm)
    (out / f"start-{me}.json").write_text(json.dumps({"pid": os.getpid(), "env": dict(os.environ)}))
    store.set(started_key(rank), "1")  # as training does at its first iteration: a failure now is no start-up error
    if rank == VICTIM and mode != "sleep":
        if mode == "kill-always" or (restart == 0 and replacement == 0):
            os.kill(os.getpid(), signal.SIGKILL)
        return
    if mode in ("kill-always", "sleep"):
        time.sleep(WAIT_S)
        return
    if restart > 0:  # survivors-fail's second round: everyone exits 0
        return
    deadline = time.monotonic() + WAIT_S  # polled: a signal handler cannot run inside store.wait
    while not store.check([replacing_key(VICTIM)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = store.get(replacing_key(VICTIM)).decode()
    while not (out / f"start-{VICTIM}-0-1.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    (out / f"saw-{me}.json").write_text(json.dumps({"pid": os.getpid(), "replacing": seen}))
    if mode == "survivors-fail":
        sys.exit(1)


if __name__ == "__main__":
    main()
