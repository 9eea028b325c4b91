"""``miles report RUN_DIR``: the curves that matter as PNGs, and one self-contained HTML page.

Reads ``metrics.jsonl`` (and ``eval.jsonl`` when there is one) as they are, so it works on a
running run as well as a finished one. Each panel below draws the metrics its ``keep``
accepts; a panel with none of them (a run without a critic has no value loss) is left out.
The page embeds every image (base64) and the run's ``config.yaml``: it can be mailed or
attached to an issue as one file. matplotlib is needed (``pip install matplotlib``).
"""

from __future__ import annotations

import base64
import html
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from miles.tracking.curves import Curves, read_rows

REPORT_DIR = "report"
PAGE = "index.html"


def _prefix(*prefixes: str) -> Callable[[str], bool]:
    return lambda name: name.startswith(prefixes)


def _matches(pattern: str) -> Callable[[str], bool]:
    regex = re.compile(pattern)
    return lambda name: regex.search(name) is not None


def _top_phase(name: str) -> bool:
    """``time/<phase>_s`` of a phase the step's time splits into (parts ``time/a/b_s`` add up elsewhere)."""
    return name.startswith("time/") and name.endswith("_s") and name.count("/") == 1 and name != "time/step_s"


@dataclass(frozen=True)
class Panel:
    file: str
    title: str
    ylabel: str
    keep: Callable[[str], bool]
    stacked: bool = False  # an area per series, stacked (parts of a whole)


PANELS = (
    Panel(
        "reward.png",
        "reward and exact-answer rate",
        "reward / fraction",
        _matches(r"^rollout/(reward_mean|full_reward_frac)$|^eval/.*(pass_rate|score)$"),
    ),
    Panel("loss.png", "loss", "loss", _matches(r"^(train/loss|loss/(?!clipfrac).*)$")),
    Panel(
        "mismatch.png",
        "KL, TIS ratio and clip fraction",
        "value",
        _matches(r"(^|/|_)kl($|_|/)|^correction/|clipfrac|clip_frac"),
    ),
    Panel("response_length.png", "response length", "tokens", _prefix("rollout/response_len")),
    Panel("step_time.png", "step time by phase", "seconds per step", _top_phase, stacked=True),
    Panel("staleness.png", "staleness", "weight versions", _matches(r"stale|version_lag|off_policy")),
    Panel(
        "throughput.png",
        "engine throughput",
        "per second",
        _matches(r"tok(ens)?_per_s|tok/s|throughput|samples_per_s"),
    ),
)


@dataclass
class Report:
    """What ``build_report`` wrote: the page, the images by panel title, and the steps seen."""

    page: str
    images: dict[str, str] = field(default_factory=dict)
    steps: int = 0


def build_report(run_dir: str, out_dir: str | None = None) -> Report:
    """Draw the run's panels into ``out_dir`` (default ``RUN_DIR/report``) and write the page."""
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(metrics_path):
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl (is it a Miles run directory?)")
    out_dir = out_dir or os.path.join(run_dir, REPORT_DIR)
    os.makedirs(out_dir, exist_ok=True)
    rows = read_rows(metrics_path)
    eval_path = os.path.join(run_dir, "eval.jsonl")
    if os.path.isfile(eval_path):  # evaluations, at the step whose weights they measured
        rows = rows + [r for r in read_rows(eval_path) if isinstance(r.get("step"), int)]
    images: dict[str, str] = {}
    for panel in PANELS:
        curves = Curves.from_rows(rows, panel.keep)
        if curves.series:
            path = os.path.join(out_dir, panel.file)
            _draw(curves, panel, path)
            images[panel.title] = path
    steps = len({r["step"] for r in read_rows(metrics_path) if isinstance(r.get("step"), int)})
    page = os.path.join(out_dir, PAGE)
    _write_page(run_dir, page, images, steps, rows)
    return Report(page, images, steps)


def _draw(curves: Curves, panel: Panel, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no window, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
    try:
        names = curves.names()
        if panel.stacked:
            steps = sorted({s for n in names for s in curves.series[n][0]})
            layers = []
            for name in names:
                by_step = dict(zip(*curves.series[name], strict=True))
                layers.append([by_step.get(s, 0.0) for s in steps])
            labels = [n.removeprefix("time/").removesuffix("_s") for n in names]
            ax.stackplot(steps, layers, labels=labels, alpha=0.85)
        else:
            for name in names:
                steps_, values = curves.series[name]
                ax.plot(steps_, values, "o-" if len(steps_) < 20 else "-", label=name, markersize=3, lw=1.3)
        ax.set_xlabel("training step")
        ax.set_ylabel(panel.ylabel)
        ax.set_title(panel.title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best", ncol=2 if len(names) > 6 else 1)
        fig.tight_layout()
        tmp = path + ".tmp"
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)  # a reader (a browser refreshing) never sees half an image
    finally:
        plt.close(fig)


def _read_text(path: str) -> str:
    if not os.path.isfile(path):
        return ""
    with open(path, encoding="utf-8") as f:
        return f.read()


def _write_page(
    run_dir: str, page: str, images: dict[str, str], steps: int, rows: list[dict[str, object]]
) -> None:
    marker: dict[str, object] = {}
    marker_text = _read_text(os.path.join(run_dir, "miles-run.json"))
    if marker_text:
        try:
            marker = json.loads(marker_text)
        except json.JSONDecodeError:
            marker = {}
    name = os.path.basename(os.path.normpath(run_dir))
    last = next((r for r in reversed(rows) if "time/step_s" in r), {})
    facts = [("run", name), ("steps logged", str(steps))]
    facts += [(k, str(v)) for k, v in marker.items() if isinstance(v, str | int | float)]
    headline = [
        (k, f"{v:.4g}")
        for k, v in last.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and any(p.keep(k) for p in PANELS)
    ]
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>Miles run {html.escape(name)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:960px}img{max-width:100%;"
        "border:1px solid #ddd;margin:.5em 0}td{padding:2px 12px}pre{background:#f6f6f6;padding:1em;"
        "overflow:auto}</style></head><body>",
        f"<h1>Miles run {html.escape(name)}</h1><table>",
        *(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in facts),
        "</table>",
    ]
    if headline:
        parts.append(f"<h2>last step ({last.get('step')})</h2><table>")
        parts += [f"<tr><td>{html.escape(k)}</td><td>{v}</td></tr>" for k, v in headline]
        parts.append("</table>")
    for title, path in images.items():
        with open(path, "rb") as f:
            data = base64.b64encode(f.read()).decode("ascii")
        parts.append(
            f"<h2>{html.escape(title)}</h2><img alt='{html.escape(title)}' src='data:image/png;base64,{data}'>"
        )
    if not images:
        parts.append("<p>No metrics to plot yet.</p>")
    config = _read_text(os.path.join(run_dir, "config.yaml"))
    parts.append(f"<h2>config</h2><pre>{html.escape(config) or '(no config.yaml)'}</pre></body></html>")
    tmp = page + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
    os.replace(tmp, page)
