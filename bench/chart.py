"""Draws throughput and p99 per concurrency for each server from a results JSON.

Runs in the bench's tools environment (matplotlib lives there, not in the
project's): python chart.py RESULTS.json OUT.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib import ticker

MODELS = ("echo", "burn")
CONCURRENCIES = (1, 4, 16)
METRICS = (
    ("throughput", "throughput (infer/s)", "throughput_runs"),
    ("p99_ms", "p99 (ms)", "p99_ms_runs"),
)


def draw(results: dict[str, Any], out: Path) -> None:
    labels = {s["key"]: s["label"] for s in results["servers"]}
    cells = results["cells"]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for row, model in enumerate(MODELS):
        for col, (metric, title, runs_key) in enumerate(METRICS):
            ax = axes[row][col]
            # one colour per server in every panel, also where a server does not serve a model
            for i, (key, label) in enumerate(labels.items()):
                xs, ys, low, high = [], [], [], []
                for c in CONCURRENCIES:
                    found = cells.get(key, {}).get(model, {}).get(str(c))
                    if not found or found.get(metric) is None:
                        continue
                    runs = found.get(runs_key) or [found[metric]]
                    xs.append(c)
                    ys.append(found[metric])
                    low.append(found[metric] - min(runs))
                    high.append(max(runs) - found[metric])
                if xs:
                    ax.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=3, label=label,
                                color=f"C{i % 10}")  # fmt: skip
            ax.set_xscale("log", base=2)
            ax.set_xticks(CONCURRENCIES, [str(c) for c in CONCURRENCIES])
            ax.set_xlabel("concurrency")
            ax.set_title(f"{model}: {title}")
            ax.grid(True, alpha=0.3)
            if metric == "p99_ms":
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(ticker.ScalarFormatter())
                ax.yaxis.set_minor_formatter(ticker.NullFormatter())
            else:
                ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=8)
    meta = results.get("meta", {})
    fig.suptitle(
        f"poolserve bench, {meta.get('date', '')}, {meta.get('cores', '?')} cores, "
        f"median of {meta.get('runs', '?')} runs (bars: min-max)"
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    draw(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
