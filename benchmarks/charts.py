"""The bench commands' pictures (matplotlib, Agg backend, small PNGs)."""

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import ListedColormap  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from conveyor.engine.core.step_trace import StepRecord, assign_slots  # noqa: E402

COLOURS = {"idle": "#f2f2f2", "prefill": "#d95f02", "decode": "#1b9e77", "padding": "#9e9e9e"}


def _cdf(ax: Any, values: list[float], title: str) -> None:
    if values:
        x = np.sort(np.asarray(values) * 1000)
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), lw=1.6)
        for q, style in ((50, ":"), (99, "--")):
            ax.axvline(np.percentile(x, q), color="grey", ls=style, lw=0.8, label=f"p{q} {np.percentile(x, q):.0f} ms")
        ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("ms", fontsize=8)
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def serve_chart(result: dict[str, Any], path: Path) -> None:
    ok = [r for r in result["requests"] if r["ok"]]
    s = result["summary"]
    fig, axes = plt.subplots(2, 2, figsize=(9, 6), dpi=80)
    _cdf(axes[0, 0], [r["ttft_s"] for r in ok if r["ttft_s"] is not None], "TTFT CDF")
    _cdf(axes[0, 1], [x for r in ok for x in r["itl_s"]], "ITL CDF")
    _cdf(axes[1, 0], [r["e2e_s"] for r in ok if r["e2e_s"] is not None], "E2E latency CDF")
    ax = axes[1, 1]
    times = [t for r in ok for t in r["chunk_times_s"]]
    if times:
        width = max(s["duration_s"] / 40, 0.05)
        bins = np.arange(0, max(times) + width, width)
        ends = [r["start_s"] + r["e2e_s"] for r in ok]
        tokens = np.zeros(len(bins) - 1)
        for r in ok:  # each request's tokens spread over its content chunks
            per = r["output_tokens"] / max(1, len(r["chunk_times_s"]))
            idx = np.clip(np.digitize(r["chunk_times_s"], bins) - 1, 0, len(tokens) - 1)
            np.add.at(tokens, idx, per)
        ax.plot(bins[:-1], tokens / width, drawstyle="steps-post", label="output tok/s")
        ax2 = ax.twinx()
        done, _ = np.histogram(ends, bins)
        ax2.plot(bins[:-1], done / width, drawstyle="steps-post", color="#d95f02", lw=1, label="finished req/s")
        ax2.set_ylabel("req/s", fontsize=8)
        ax.legend(fontsize=7, loc="upper left")
        ax2.legend(fontsize=7, loc="upper right")
    ax.set_title("Throughput over time", fontsize=9)
    ax.set_xlabel("s", fontsize=8)
    ax.grid(alpha=0.3)
    cfg = result["config"]
    fig.suptitle(
        f"bench serve {cfg['model']}: {s['completed']} requests, {s['request_throughput']:.2f} req/s, "
        f"{s['output_throughput']:.0f} output tok/s",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def throughput_chart(result: dict[str, Any], path: Path) -> None:
    rows = result["results"]
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * len(workloads), 3.6), dpi=80)
    width = 0.8 / len(policies)
    for j, policy in enumerate(policies):
        xs, ys, labels = [], [], []
        for i, w in enumerate(workloads):
            r = next((r for r in rows if r["workload"] == w and r["policy"] == policy), None)
            if r is not None:
                xs.append(i + (j - (len(policies) - 1) / 2) * width)
                ys.append(r["tok_per_s"])
                labels.append(f"{r['tok_per_s']:.0f}\n{r['steps']} steps")
        bars = ax.bar(xs, ys, width, label=policy)
        ax.bar_label(bars, labels, fontsize=7)
    ax.set_xticks(range(len(workloads)), workloads, fontsize=8)
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"bench throughput: {result['config']['model']} ({result['config']['dtype']})", fontsize=10)
    ax.legend(fontsize=8)
    ax.margins(y=0.18)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def slot_grid(records: list[StepRecord]) -> np.ndarray:
    """rows = batch slots, columns = steps; 0 idle, 1 prefill, 2 decode, 3 padding."""
    slots = assign_slots(records)
    grid = np.zeros((max(slots.values(), default=-1) + 1, len(records)), dtype=int)
    code = {"prefill": 1, "decode": 2, "padding": 3}
    for i, r in enumerate(records):
        for w in r.work:
            grid[slots[(i, w.req_id)], i] = code[w.kind]
    return grid


def timeline_chart(traces: dict[str, list[StepRecord]], path: Path, title: str) -> None:
    """One column per policy: the batch-slot grid over steps, KV-cache use beneath."""
    names = list(traces)
    steps = max(len(t) for t in traces.values())
    fig, axes = plt.subplots(
        2,
        len(names),
        figsize=(5.2 * len(names), 4.6),
        dpi=80,
        sharex="col",
        gridspec_kw={"height_ratios": [3, 1]},
        squeeze=False,
    )
    cmap = ListedColormap([COLOURS[k] for k in ("idle", "prefill", "decode", "padding")])
    for j, name in enumerate(names):
        rec = traces[name]
        grid = slot_grid(rec)
        ax = axes[0, j]
        ax.imshow(
            grid,
            aspect="auto",
            interpolation="nearest",
            cmap=cmap,
            vmin=0,
            vmax=3,
            extent=(0.5, len(rec) + 0.5, grid.shape[0] - 0.5, -0.5),
        )
        tokens = sum(r.tokens() for r in rec)
        ax.set_title(f"{name}: {len(rec)} steps, {sum(r.duration_s for r in rec):.1f} s, {tokens} tokens", fontsize=9)
        ax.set_ylabel("batch slot", fontsize=8)
        ax.set_xlim(0.5, steps + 0.5)
        kv = axes[1, j]
        used = [r.kv_blocks_used for r in rec]
        kv.fill_between(range(1, len(rec) + 1), used, step="mid", color="#7570b3", alpha=0.7)
        total = rec[0].kv_blocks_total if rec else 1
        top = min(total, 1.15 * max(used, default=1))
        kv.set_ylim(0, max(1, top))
        if top >= total:
            kv.axhline(total, color="black", lw=0.8, ls="--")
        kv.set_ylabel(f"KV blocks used\n(of {total})", fontsize=8)
        kv.set_xlabel("engine step", fontsize=8)
        kv.grid(alpha=0.3)
    fig.legend(
        handles=[Patch(color=COLOURS[k], label=k) for k in ("prefill", "decode", "padding", "idle")],
        loc="upper right",
        ncol=4,
        fontsize=8,
    )
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path)
    plt.close(fig)
