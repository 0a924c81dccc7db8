"""`python -m dtgpt.run` (`dtgpt-run`): torchrun, except that failed workers are replaced alone
(several at once when they die together), and a worker that fails at start-up, or a job that
stops on a bug, is neither restarted nor replaced.

Same flags as torchrun (torch's own parser) and the same launch path (`torch.distributed.run.run`:
rendezvous, configuration, the failure report); only the agent differs
(dtgpt/run/agent.py). What the workers are told: dtgpt/run/keys.py.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.launcher import api as launcher_api

from dtgpt.run.agent import ReplacingAgent

PROG = "python -m dtgpt.run"


def parse_launcher_args(argv: list[str]):
    parser = torchrun.get_args_parser()
    parser.prog = PROG

    def one_line_error(message: str):
        parser.exit(2, f"{PROG}: error: {message}\n")

    parser.error = one_line_error
    args = parser.parse_args(argv)
    try:  # what torch's config_from_args would assert, said in one line before anything starts
        min_nodes, max_nodes = torchrun.parse_min_max_nnodes(args.nnodes)
        workers = torchrun.determine_local_world_size(args.nproc_per_node)
    except ValueError as error:
        parser.error(str(error))
    if workers < 1:  # torch's WorkerSpec asserts it, a bare AssertionError at launch
        parser.error(f"--nproc-per-node={args.nproc_per_node}: must be >= 1")
    if not 0 < min_nodes <= max_nodes:
        parser.error(f"--nnodes={args.nnodes}: need 0 < min <= max")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts={args.max_restarts}: must be >= 0")
    return args


@contextmanager
def _replacing_agent():
    """torch's `launch_agent` names its agent class; this swaps in ours for the launch."""
    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = ReplacingAgent
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original


@record
def launch(argv: list[str] | None = None) -> None:
    args = parse_launcher_args(sys.argv[1:] if argv is None else argv)
    with _replacing_agent():
        torchrun.run(args)


if __name__ == "__main__":
    launch()
