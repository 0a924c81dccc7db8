"""Checkpoint throughput: DCP save/load vs torch.save/torch.load of the same tensors, and how long
an async save blocks training compared with a synchronous one. One process, one run.

    python scripts/bench_checkpoint.py --gb 1.0 --dir /tmp/bench_ckpt [--repeat 3] [--device cpu]

The model is a dtgpt GPT sized so that parameters + AdamW state (exp_avg, exp_avg_sq) take about
--gb gigabytes in fp32. Saves go through dtgpt's Checkpointer (the training path: state dicts,
DCP, fsync of every file, marker, pointer); torch.save is timed with an fsync too, so both reach
the disk. Loads read files the saves just wrote, usually from the page cache: they measure the
software path, not the disk. Prints a Markdown table; the best of --repeat runs counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dtgpt.checkpoint import Checkpointer, layout  # noqa: E402
from dtgpt.config import load_config  # noqa: E402
from dtgpt.api import build_model, build_train_state, init_distributed  # noqa: E402
from dtgpt.model_size import num_parameters  # noqa: E402
from dtgpt.state import Progress  # noqa: E402

VOCAB = 32768
HIDDEN = 1024
BYTES_PER_PARAM = 12  # fp32 parameter + exp_avg + exp_avg_sq


def model_overrides(gb: float, device: str) -> list[str]:
    """Layers so that parameters + AdamW state come to about `gb` GB (at least one layer)."""
    probe = load_config(None, [f"--model.hidden_size={HIDDEN}", "--data.mock_data=true"]).model
    fixed = num_parameters(dataclasses.replace(probe, num_layers=0), VOCAB)
    per_layer = num_parameters(dataclasses.replace(probe, num_layers=1), VOCAB) - fixed
    layers = max(1, round((gb * 1e9 / BYTES_PER_PARAM - fixed) / per_layer))
    return [
        f"--model.num_layers={layers}", f"--model.hidden_size={HIDDEN}", "--model.num_attention_heads=16",
        "--model.seq_length=128", "--data.mock_data=true", "--data.tokenizer_type=NullTokenizer",
        f"--data.vocab_size={VOCAB}", f"--training.device={device}",
    ]  # fmt: skip


def build_run(overrides: list[str]) -> tuple:
    """(cfg, runtime, state) of a trained-once model: its AdamW state exists."""
    cfg = load_config(None, overrides)
    runtime = init_distributed(cfg)
    state = build_train_state(cfg, build_model(cfg, runtime, VOCAB))
    for p in state.model.parameters():  # one zero-gradient step creates the AdamW state
        p.grad = torch.zeros_like(p)
    state.optimizer.step()
    state.optimizer.zero_grad()
    state.progress = Progress(iteration=1, consumed_samples=8)
    return cfg, runtime, state


def tensors_of(state: dict) -> dict[str, torch.Tensor]:
    """The tensors of a nested save state, flat (what torch.save is given)."""
    return {f"{s}.{k}": v for s, d in state.items() for k, v in d.items() if isinstance(v, torch.Tensor)}


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def torch_save_synced(obj, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def bench(run: tuple, root: Path, repeat: int) -> dict[str, float]:
    full_cfg, runtime, state = run
    cfg = full_cfg.checkpoint
    flat = tensors_of(state.state_dict())
    nbytes = sum(t.numel() * t.element_size() for t in flat.values())
    results = {"bytes": nbytes, "dcp_save": 1e9, "dcp_load": 1e9, "torch_save": 1e9, "torch_load": 1e9,
               "async_first": 1e9, "async_blocked": 1e9, "async_total": 1e9}  # fmt: skip
    for r in range(repeat):
        shutil.rmtree(root, ignore_errors=True)
        cfg.save, cfg.async_save = str(root / "sync"), False
        ckpt = Checkpointer(state, full_cfg, runtime)
        results["dcp_save"] = min(results["dcp_save"], timed(lambda: ckpt.save(1)))
        directory = layout.iteration_dir(root / "sync", 1)
        request = {s: d for s, d in state.state_dict().items() if s in ("model", "optimizer")}
        results["dcp_load"] = min(results["dcp_load"], timed(lambda: dcp.load(request, checkpoint_id=str(directory), no_dist=True)))

        cfg.save, cfg.async_save = str(root / "async"), True
        ackpt = Checkpointer(state, full_cfg, runtime)
        start = time.perf_counter()
        ackpt.save(1)  # the first save also allocates the CPU staging buffers
        ackpt.wait()
        results["async_total"] = min(results["async_total"], time.perf_counter() - start)
        results["async_first"] = min(results["async_first"], ackpt.blocked_s[-1])
        ackpt.save(2)  # later saves reuse them
        results["async_blocked"] = min(results["async_blocked"], ackpt.blocked_s[-1])
        ackpt.finalize()

        path = root / "torch.pt"
        results["torch_save"] = min(results["torch_save"], timed(lambda: torch_save_synced(flat, path)))
        results["torch_load"] = min(results["torch_load"], timed(lambda: torch.load(path, map_location=runtime.device)))
        print(f"repeat {r + 1}/{repeat} done", file=sys.stderr)
    shutil.rmtree(root, ignore_errors=True)
    return results


def table(res: dict[str, float], device: str) -> str:
    gb = res["bytes"] / 1e9
    rows = [
        ("DCP save (Checkpointer, sync)", res["dcp_save"]), ("torch.save (+ fsync)", res["torch_save"]),
        ("DCP load", res["dcp_load"]), ("torch.load", res["torch_load"]),
    ]  # fmt: skip
    lines = [f"state: {gb:.2f} GB (fp32 parameters + AdamW state), device {device}", "",
             "| operation | seconds | GB/s |", "|---|---:|---:|"]  # fmt: skip
    lines += [f"| {name} | {s:.3f} | {gb / s:.2f} |" for name, s in rows]
    frac = res["async_blocked"] / res["dcp_save"]
    lines += ["", "| async save | seconds |", "|---|---:|",
              f"| training blocked, first save (allocates staging buffers) | {res['async_first']:.3f} |",
              f"| training blocked, later saves | {res['async_blocked']:.3f} |",
              f"| until complete (marker + pointer) | {res['async_total']:.3f} |",
              f"| blocked (later saves) / synchronous save | {100 * frac:.1f}% |"]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0, help="size of parameters + optimizer state")
    parser.add_argument("--dir", default="/tmp/dtgpt_bench_checkpoint", help="scratch directory (deleted after)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    run = build_run(model_overrides(args.gb, args.device))
    print(table(bench(run, Path(args.dir), args.repeat), args.device))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
