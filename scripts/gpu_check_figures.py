"""The figures scripts/gpu_check.py reads back from each step's output: pytest's last line, the
benchmark's JSON (also a partial one, written after each size), a training run's metrics."""

from __future__ import annotations

import json
from pathlib import Path


def suite_figures(log: Path) -> str:
    """pytest's last line: `12 passed, 3 skipped in 80.1s`."""
    if not log.exists():
        return ""
    lines = [ln.strip("= ") for ln in log.read_text(errors="replace").splitlines() if " in " in ln and ("passed" in ln or "failed" in ln)]
    return lines[-1] if lines else ""


def _results(path: Path) -> tuple[dict, list[str]]:
    """(results per size, the sizes asked for) of bench.py's --json, ({}, []) if there is none."""
    if not path.exists():
        return {}, []
    report = json.loads(path.read_text())
    results = report.get("results", {})
    return results, report.get("sizes", list(results))


def bench_figures(path: Path) -> str:
    """tokens/s ratio and dtgpt's MFU per size, and the sizes not reached."""
    results, sizes = _results(path)
    parts = []
    for size, res in results.items():
        ratio, mfu = res.get("ratio"), res.get("dtgpt", {}).get("mfu")
        parts.append(f"{size}: ratio {ratio:.3f}" if ratio is not None else f"{size}: failed")
        if mfu is not None:
            parts[-1] += f", MFU {mfu:.1%}"
    parts += [f"{size}: not reached" for size in sizes if size not in results]
    return "; ".join(parts)


def _pair(a, b, spec: str) -> str:
    return " / ".join("-" if v is None else format(v, spec) for v in (a, b))


def bench_table(path: Path, compile_label: str) -> list[str]:
    """Rows of docs/performance.md's benchmark table, one per size bench.py finished."""
    results, _ = _results(path)
    rows = []
    for size, res in results.items():
        d, r = res.get("dtgpt", {}), res.get("reference", {})
        dp, rp = d.get("profile") or {}, r.get("profile") or {}
        ratio = res.get("ratio")
        cells = [
            size,
            compile_label,
            "-" if d.get("tokens_per_s") is None else f"{d['tokens_per_s']:,.0f}",
            "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:,.0f}",
            "-" if ratio is None else f"**{ratio:.3f}**",
            _pair(None if d.get("mfu") is None else 100 * d["mfu"], None if r.get("mfu") is None else 100 * r["mfu"], ".1f") + " %",
            _pair(dp.get("kernels"), rp.get("kernels"), ",.0f"),
            _pair(None if dp.get("busy") is None else 100 * dp["busy"], None if rp.get("busy") is None else 100 * rp["busy"], ".0f") + " %",
            _pair(dp.get("optimizer_ms"), rp.get("optimizer_ms"), ".2f"),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def train_figures(metrics: Path, first: int) -> str:
    """The first and last loss and the median tokens/s of a run's metrics from iteration `first`."""
    if not metrics.exists():
        return ""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("iteration", 0) >= first and "loss" in r]
    if not rows:
        return ""
    speeds = sorted(r["tokens_per_s"] for r in rows if r.get("tokens_per_s"))
    speed = f", {speeds[len(speeds) // 2]:,.0f} tokens/s" if speeds else ""
    return f"iterations {rows[0]['iteration']}-{rows[-1]['iteration']}, loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}{speed}"
