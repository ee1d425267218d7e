"""Pictures of a run for the Prefect UI: the loss curve and memory per stage, as markdown with PNG data URIs.

Prefect artifacts hold text only, and the UI's markdown renderer shows `![alt](data:image/png;base64,...)`
images inline (checked in headless Chromium by tests/test_ui.py), so a picture needs no file server. A
re-publish replaces the picture in the run's one artifact of that key (`slimtune.report.artifacts`).
"""

from __future__ import annotations

import base64
import io
import logging
from collections.abc import Sequence

from slimtune.memory.guard import GuardRecord
from slimtune.report.artifacts import publish_markdown, run_key

log = logging.getLogger(__name__)
_GIB = 1024**3
LOSS_CURVE_KIND = "loss-curve"
MEMORY_CHART_KIND = "memory-chart"


def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _figure(width: float = 6.0, height: float = 3.2):
    import matplotlib

    matplotlib.use("Agg")  # no display on workers; Agg is matplotlib's file-only backend
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height))


def loss_curve_png(train: Sequence[tuple[int, float]], evals: Sequence[tuple[int, float]] = ()) -> bytes:
    """Train loss (line) and eval loss (points) against the optimizer step."""
    fig, ax = _figure()
    if train:
        ax.plot(*zip(*train), label="train loss", color="tab:blue", marker="." if len(train) < 30 else None)
    if evals:
        ax.plot(*zip(*evals), label="eval loss", color="tab:orange", marker="o", linestyle="--")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    return _png(fig)


def memory_chart_png(records: Sequence[GuardRecord]) -> bytes:
    """Peak host RSS and (where there is a GPU) peak GPU allocated per stage, in GiB."""
    fig, ax = _figure()
    stages = [r.stage for r in records]
    series = [("peak host RSS", [r.peak_host_rss for r in records])]
    if any(r.peak_gpu_allocated is not None for r in records):
        series.append(("peak GPU allocated", [r.peak_gpu_allocated or 0 for r in records]))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series):
        xs = [k + (i - (len(series) - 1) / 2) * width for k in range(len(stages))]
        ax.bar(xs, [v / _GIB for v in values], width=width, label=label)
    ax.set_xticks(range(len(stages)), stages, rotation=20, ha="right")
    ax.set_ylabel("GiB")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    return _png(fig)


def image_markdown(title: str, png: bytes, alt: str) -> str:
    """A markdown document with `png` inline as a data URI."""
    return f"# {title}\n\n![{alt}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})\n"


def publish_image(key: str | None, title: str, png: bytes, description: str) -> None:
    """Publish a picture as the run's markdown artifact `key`, replacing an earlier one; does nothing outside a
    Prefect run and never fails the caller: a chart is a view of the run, not part of its result."""
    publish_markdown(key, image_markdown(title, png, title), description)


def publish_memory_chart(records: Sequence[GuardRecord], run_name: str) -> None:
    """The memory-per-stage chart of the stages finished so far, as the run's "<run>-memory-chart" artifact."""
    if not records:
        return
    try:
        png = memory_chart_png(records)
    except Exception as e:
        log.warning("could not draw the memory chart: %s", e)
        return
    publish_image(run_key(run_name, MEMORY_CHART_KIND), "Memory per stage", png, "Peak host and GPU memory per stage")
