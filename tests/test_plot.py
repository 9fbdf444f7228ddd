"""kimi/plot.py: loss.png is a readable PNG with labelled axes, a legend of the train and eval curves, and a log
scale on request; nothing is written before there is a loss."""

import json

import matplotlib.image

from kimi.plot import loss_figure, plot_metrics


def _metrics(path, steps: int = 30, every: int = 10):
    with open(path, "w") as f:
        for s in range(1, steps + 1):
            m = {"step": s, "loss": 5.0 / s ** 0.5, "lr": 1e-3, "grad_norm": 1.0}
            if s % every == 0:
                m["eval_loss"] = 5.5 / s ** 0.5
            f.write(json.dumps(m) + "\n")
        f.write(json.dumps({"step": steps, "eval_loss": 1.0}) + "\n")   # the final evaluation's own line


def test_png_has_axes_legend_and_both_curves(tmp_path):
    _metrics(tmp_path / "metrics.jsonl")
    fig = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    img = matplotlib.image.imread(tmp_path / "loss.png")
    assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 300 and img.std() > 0   # not a blank canvas
    (ax,) = fig.axes
    assert ax.get_xlabel() == "optimizer step" and "loss" in ax.get_ylabel() and ax.get_yscale() == "linear"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["train loss", "eval loss"]
    train, evals = ax.get_lines()
    assert list(train.get_xdata()) == list(range(1, 31)) and list(evals.get_xdata()) == [10, 20, 30, 30]
    assert len(ax.get_xticks()) > 2 and len(ax.get_yticks()) > 2


def test_log_scale_and_nothing_to_plot(tmp_path):
    _metrics(tmp_path / "metrics.jsonl")
    fig = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "log.png", log_scale=True)
    assert fig.axes[0].get_yscale() == "log" and (tmp_path / "log.png").is_file()
    (tmp_path / "empty.jsonl").write_text("")
    assert plot_metrics(tmp_path / "empty.jsonl", tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()
    only_train = loss_figure([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}])
    assert [t.get_text() for t in only_train.axes[0].get_legend().get_texts()] == ["train loss"]
