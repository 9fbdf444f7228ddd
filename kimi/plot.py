"""The training curve: train and eval loss against the optimizer step, read from a run's metrics.jsonl (the numbers
stay there; this is the picture). matplotlib is imported when a plot is made, so `import kimi` stays light."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(metrics_path: Path) -> list[dict]:
    """The records of a metrics.jsonl, one dict a line."""
    return [json.loads(line) for line in Path(metrics_path).read_text().splitlines() if line.strip()]


def loss_figure(records: list[dict], *, log_scale: bool = False, title: str | None = None):
    """A matplotlib Figure (Agg canvas, no window, no pyplot state) of the records' 'loss' (train) and 'eval_loss'
    against 'step'; `log_scale`: a logarithmic loss axis, where a long run's late progress stays visible."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogFormatter

    train = [(m["step"], m["loss"]) for m in records if "loss" in m]
    evals = [(m["step"], m["eval_loss"]) for m in records if "eval_loss" in m]
    fig = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        ax.plot(*zip(*train), color="tab:blue", linewidth=1.2, label="train loss",
                marker="." if len(train) < 50 else None)
    if evals:
        ax.plot(*zip(*evals), color="tab:red", linewidth=1.2, marker="o", markersize=4, label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats per label token)")
    if log_scale:
        ax.set_yscale("log")
        # plain numbers (6, not 6 x 10^0), on the in-between ticks too when the axis spans less than two decades
        ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
        ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
    ax.set_title(title or "training loss")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend()
    return fig


def plot_metrics(metrics_path: Path, png_path: Path, *, log_scale: bool = False):
    """Write the loss curve of `metrics_path` to `png_path` and return its Figure; None (and no file) when the
    metrics hold no loss yet."""
    records = read_metrics(metrics_path)
    if not any("loss" in m or "eval_loss" in m for m in records):
        return None
    fig = loss_figure(records, log_scale=log_scale)
    fig.savefig(png_path)
    return fig
