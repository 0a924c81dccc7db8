"""What `python -m dtgpt.run` tells its workers: environment variables and keys in the agent's store.

Imported by the launcher and by training; it needs nothing but the standard library.

Environment of every worker the launcher starts:

- `DTGPT_LAUNCHER=dtgpt.run`: a failed worker of this job is replaced, so a survivor may wait
  for its replacement instead of exiting.
- `DTGPT_REPLACEMENT=<n>` (replacements only, n >= 1): this process is the n-th replacement of
  its local rank in the current round, and joins a job that is already running. Everything else
  (RANK, LOCAL_RANK, GROUP_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*) is what
  the worker it replaces had, `TORCHELASTIC_RESTART_COUNT` included: whatever is armed on
  "restart count 0" (the `[faults]` injections) fires again in a replacement unless it also
  looks at `DTGPT_REPLACEMENT`.

Keys, set by the agent in the store the workers reach at MASTER_ADDR:MASTER_PORT (the agent's
store, `TORCHELASTIC_USE_AGENT_STORE=True`), without any prefix, i.e. what a worker reads with
`dist.TCPStore(MASTER_ADDR, MASTER_PORT, is_master=False)`, or the first store of
`dist.rendezvous("env://")`:

- `dtgpt/launcher/replacing/<rank>` = `<n>`: global rank `<rank>` died and its n-th replacement
  is being started (set before the process starts).
- `dtgpt/launcher/no_replacement/<rank>` = a reason: global rank `<rank>` died and no replacement
  will come (restarts exhausted, several workers failed at once, or a replacement still joining
  failed); the launcher stops every worker (SIGTERM, then SIGKILL after
  `--shutdown-timeout`) and restarts them all if restarts remain, as torchrun does.
- `dtgpt/launcher/recovered/<rank>` = `<n>`: set by training, not the launcher, once the n-th
  replacement of `<rank>` has joined and the job runs again. Until then a further failure on
  that node (survivors that could not recover, or the replacement itself) gets a full restart.
- `dtgpt/launcher/started/<rank>` = `1`: set by training when `<rank>` starts its first
  iteration. A worker that fails without it failed at start-up (a config error, missing data):
  a restart or a replacement would fail the same way, so the launcher stops the job instead.
- `dtgpt/launcher/deaths` = a count (`store.add`): bumped by the agent each time it handles
  failed workers (replaced or not), at once: every survivor's failure watch (dtgpt/faults/detect.py)
  leaves its collectives when it grows, whether or not a collective of its own has failed.
- `dtgpt/launcher/stop` = a one-line reason: set by training when the job must stop and not be
  restarted (a rank raised an error and no rank died: a bug, which a restart would repeat). The
  launcher neither replaces nor restarts, and exits with the failed worker's exit code.

(`dtgpt/<token>/...`, `dtgpt/hello/...` and `dtgpt/reply/...` are attempt_store.py's; a token is
hex, so the names cannot meet.) The agent deletes the keys of its ranks when it stops its
workers, so a new round never reads the last one's. Without the agent's store
(`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: rank 0 hosts the store, and may be the one that died)
no key is set and no worker is replaced: torchrun's behaviour.
"""

from __future__ import annotations

import os

LAUNCHER_ENV = "DTGPT_LAUNCHER"
LAUNCHER_NAME = "dtgpt.run"
REPLACEMENT_ENV = "DTGPT_REPLACEMENT"
KEY_ROOT = "dtgpt/launcher"


def replacing_key(rank: int) -> str:
    return f"{KEY_ROOT}/replacing/{rank}"


def no_replacement_key(rank: int) -> str:
    return f"{KEY_ROOT}/no_replacement/{rank}"


def recovered_key(rank: int) -> str:
    return f"{KEY_ROOT}/recovered/{rank}"


def started_key(rank: int) -> str:
    return f"{KEY_ROOT}/started/{rank}"


STOP_KEY = f"{KEY_ROOT}/stop"
DEATHS_KEY = f"{KEY_ROOT}/deaths"


def replacement_number() -> int:
    """This process's `DTGPT_REPLACEMENT` (0: an original worker, or not under dtgpt.run)."""
    return int(os.environ.get(REPLACEMENT_ENV, "0"))
