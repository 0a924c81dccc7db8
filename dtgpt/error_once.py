"""One `error:` line per problem, however many ranks meet it.

Under torchrun every rank reads the same config and checkpoint, so a refusal is found by each of
them at once; N copies of one line bury it. The rank that says it is whichever gets there first:
an exclusive create of a marker file named after the launch and the line (`O_CREAT | O_EXCL` is
atomic on a local file system) decides, with no process group (none may exist yet) and no rank
that must be alive to speak. Lines that differ (an error naming its rank) are all printed. One
node's ranks share a marker; each node of a multi-node job prints its own copy.

Every rank still exits 2, and torchrun then prints its ChildFailedError report: its agent
(torch.distributed.elastic.agent.server.api, `_invoke_run` and `launch_agent`) turns any worker
exit other than 0 into that report and an exit of 1, whatever the code or the error file says,
and exiting 0 would tell a script the run succeeded. The error line is the first thing printed,
and the report's root cause names exit code 2 (a refusal, not a crash).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile


def print_error(message: str) -> None:
    """Print `error: message` to stderr as one write. Every rank of a job shares the same
    stderr pipe; print() writes the text and the newline separately, so two ranks failing at
    once could glue their lines together. A single write of at most PIPE_BUF bytes is atomic."""
    sys.stderr.flush()
    line = f"error: {message}\n".encode(errors="replace")
    os.write(sys.stderr.fileno(), line)


def print_error_once(message: str, command: str = "") -> None:
    """print_error, by one rank of this launch (every rank when not launched by torchrun).
    `command`: what the rank was asked to run (one launch may run several commands in turn)."""
    if "RANK" not in os.environ or first_to_say(message, command):
        print_error(message)


def first_to_say(message: str, command: str = "") -> bool:
    """True for the first process of this launch (and restart) to claim `message`. A launch is
    its launcher process (the parent of every local rank) and its rendezvous."""
    names = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")
    launch = [str(os.getppid()), *(os.environ.get(k, "") for k in names), command]
    digest = hashlib.sha256("\0".join([*launch, message]).encode(errors="replace")).hexdigest()[:24]
    marker = os.path.join(tempfile.gettempdir(), f"dtgpt-said-{digest}")
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except OSError:
        return os.environ.get("RANK") == "0"  # no writable temp dir: rank 0 speaks
    return True
