"""Plot one or more gradient logs as one image of aligned panels over the step axis.

    python tools/plot_grad_log.py LOG [LOG ...] [--out PNG] [--last N] [--steps A:B]
                                  [--smooth N] [guard flags to replay]

Panels (top to bottom, sharing the step axis):

* gradient norm (log scale) with the logged threshold as a line; skipped steps marked
  with a red x; ``ThreshOff`` spans shaded (1 = threshold NaN, 2 = idle-free phase,
  two different shades);
* NaN/Inf norms, each on its own row;
* loss, raw (thin) and smoothed (trailing moving average over ``--smooth`` steps);
* loss scale (log2) when a log has the ``Scale`` column;
* cosine similarity to the previous step when a log has ``CosineSim``.

Self-healing events (the ``healing_log+<name>.txt`` beside a log): each rewind is a vertical line
at its step with the span back to the healthy point shaded, each quarantined image a marker on the
loss panel; the title counts them.

Which steps are "skipped": without guard flags, the steps the guard skips given what
the log records: ``Gradient Norm > Threshold`` outside an idle-free phase, and every
NaN/Inf norm (such a step changes no weight: the guard or the GradScaler drops it).
With guard flags (``--skip_grad_norm``, ``--grad_guard_preset ...``, the trainers' own
definitions) the decisions and thresholds are replayed with the trainers' decision code
(``tools/replay_grad_guard.py``) and those are drawn instead.

Several logs are overlaid, one colour each. A log of the original ``--skip_grad_norm``
fork (Step restarting at 0 every epoch, Epoch from 0) is drawn in file order, row i at
step i, said in one line on stdout; the fork wrote a row per micro-batch, so a replay of it
takes the fork run's ``--gradient_accumulation_steps`` and ``--initial_step``.

Speed (a 100,000-row log with ~16,000 ThreshOff runs draws in a few seconds, see
``benchmarks/bench_plot_grad_log.py``): reading is vectorised, all the ThreshOff spans of
one kind are one path, and long lines are decimated to the points with the smallest and
largest value per pixel column (spikes stay). Every skipped and NaN/Inf step keeps its
marker. Drawing is headless (matplotlib's Agg backend).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import csv  # noqa: E402
import io  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Sequence  # noqa: E402

import numpy as np  # noqa: E402

from library import atomic_files, grad_guard  # noqa: E402
from library.errors import UserError, exit_on_user_error  # noqa: E402
from library.tool_paths import check_output_path  # noqa: E402
from library.grad_log import (  # noqa: E402
    BASE_COLUMNS, add_fork_arguments, check_fork_arguments, events_path, fork_layout_note, fork_replay_config,
    is_fork_layout, parse_cell, read_events_for_tool,
)

FIGURE_WIDTH_IN = 12.0
MAX_DPI = 600
"""The largest --dpi: a 12 x ~9-inch figure at 600 dpi is about 40 million pixels (160 MB while drawn);
far larger ones exhaust the memory (--dpi 100000 would need terabytes)."""


def image_suffixes() -> tuple[str, ...]:
    """The file suffixes matplotlib writes (``--out``'s suffix picks the format)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return tuple(f".{suffix}" for suffix in FigureCanvasBase.get_supported_filetypes())


THRESH_OFF_SHADES = {1: ("#f4c542", "ThreshOff=1 (threshold NaN)"), 2: ("#7fb3e6", "ThreshOff=2 (idle-free phase)")}


@dataclass
class GradientLogData:
    """The numeric columns of one gradient log (float64; NaN where a value is empty/unparsable).
    ``scale``/``cosine`` are None when the log has no such column. ``fork_layout``: the log was
    in the original fork's layout and ``step`` is the 1-based row number (see ``read_gradient_log``)."""

    name: str
    epoch: np.ndarray
    step: np.ndarray
    norm: np.ndarray
    threshold: np.ndarray
    loss: np.ndarray
    thresh_off: np.ndarray
    scale: np.ndarray | None = None
    cosine: np.ndarray | None = None
    skipped: np.ndarray = field(default=None)  # bool per row, set by read_gradient_log / replay_skips
    fork_layout: bool = False
    events: list[list[str]] = field(default_factory=list)  # (Step, Event, Detail) of the healing log

    def event_steps(self, kind: str) -> list[tuple[float, str]]:
        """(step, detail) of this log's events of ``kind`` ("rewind", "quarantine", "healthy")."""
        return [(float(step), detail) for step, event, detail in self.events if event == kind]

    def __len__(self) -> int:
        return len(self.step)

    def select(self, mask_or_slice) -> GradientLogData:
        """The rows picked by a boolean mask or a slice."""
        pick = lambda values: None if values is None else values[mask_or_slice]  # noqa: E731
        return GradientLogData(self.name, *(pick(getattr(self, name)) for name in
                                            ("epoch", "step", "norm", "threshold", "loss", "thresh_off",
                                             "scale", "cosine", "skipped")), self.fork_layout, self.events)


def _column(values: Sequence[str]) -> np.ndarray:
    """One CSV column as float64: 'nan'/'inf' understood; empty or junk -> NaN."""
    try:  # Python's float is ~2x faster than numpy's string-to-float cast
        return np.fromiter(map(float, values), dtype=np.float64, count=len(values))
    except ValueError:  # an empty cell (a NaN threshold) or a damaged one: value by value
        return np.fromiter(map(parse_cell, values), dtype=np.float64, count=len(values))


def read_gradient_log(path: str | Path) -> GradientLogData:
    """Read a ``gradient_logs+*.txt`` CSV. Torn rows (wrong field count) are dropped. A log in the
    original fork's layout (:func:`library.grad_log.is_fork_layout`) gets steps 1..N in file order.
    Raises ``UserError`` when the file is missing or not a gradient log."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8-sig", newline="") as file:  # a spreadsheet may add a byte-order mark
            rows = list(csv.reader(file))
    except OSError as error:
        raise UserError(f"{path}: cannot read the gradient log ({error.strerror or error})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not a text CSV gradient log") from None
    if not rows:
        raise UserError(f"{path}: empty file, not a gradient log")
    header = [name.strip() for name in rows[0]]
    missing = [name for name in ("Step", "Gradient Norm") if name not in header]
    if missing:
        raise UserError(f"{path}: not a gradient log, missing column(s) {', '.join(missing)} "
                        f"(expected {','.join(BASE_COLUMNS)}[,Scale][,CosineSim])")
    body = [row for row in rows[1:] if len(row) == len(header)]
    columns = list(zip(*body)) if body else [() for _ in header]

    def get(name: str) -> np.ndarray | None:
        if name not in header:
            return None
        return _column(columns[header.index(name)])

    nan_column = np.full(len(body), np.nan)
    step = get("Step")
    data = GradientLogData(
        name=path.name,
        epoch=get("Epoch") if "Epoch" in header else nan_column.copy(),
        step=step,
        norm=get("Gradient Norm"),
        threshold=get("Threshold") if "Threshold" in header else nan_column.copy(),
        loss=get("Loss") if "Loss" in header else nan_column.copy(),
        thresh_off=np.nan_to_num(get("ThreshOff"), nan=0).astype(np.int64) if "ThreshOff" in header
        else np.zeros(len(body), dtype=np.int64),
        scale=get("Scale"),
        cosine=get("CosineSim"),
    )
    keep = np.isfinite(step)
    data = data.select(keep) if not keep.all() else data
    if is_fork_layout(data.step.tolist(), data.epoch.tolist()):
        data.step = np.arange(1, len(data) + 1, dtype=np.float64)
        data.fork_layout = True
    data.skipped = logged_skips(data)
    if not data.fork_layout:
        data.events = read_events_for_tool(events_path(path), str(events_path(path)))
    return data


def logged_skips(data: GradientLogData) -> np.ndarray:
    """Steps without a weight update, from what the log records: NaN/Inf norm, or norm above the
    logged threshold outside an idle-free phase (a NaN threshold compares False, as in the guard)."""
    with np.errstate(invalid="ignore"):
        above = (data.norm > data.threshold) & (data.thresh_off != 2)
    return ~np.isfinite(data.norm) | above


def replay_skips(data: GradientLogData, config: grad_guard.GuardConfig) -> None:
    """Replace ``skipped``, ``threshold`` and ``thresh_off`` by the trainers' decisions under ``config``."""
    rows = [(int(step), float(norm)) for step, norm in zip(data.step, data.norm)]
    decisions = [decision for *_, decision in
                 grad_guard.replay_decisions(rows, config, data.events, announce=lambda line: None)]
    data.skipped = np.fromiter((d.skip for d in decisions), dtype=bool, count=len(decisions))
    data.threshold = np.fromiter((d.threshold for d in decisions), dtype=np.float64, count=len(decisions))
    data.thresh_off = np.fromiter((d.thresh_off for d in decisions), dtype=np.int64, count=len(decisions))


def parse_step_range(text: str | None) -> tuple[float, float]:
    """``A:B`` (either side may be empty) -> inclusive (low, high)."""
    if text is None:
        return -np.inf, np.inf
    low, sep, high = text.partition(":")
    try:
        if not sep:
            raise ValueError
        bounds = (float(low) if low.strip() else -np.inf, float(high) if high.strip() else np.inf)
    except ValueError:
        raise UserError(f"--steps {text!r}: expected A:B, A: or :B with step numbers (e.g. 1000:2000)") from None
    if bounds[0] > bounds[1]:
        raise UserError(f"--steps {text!r}: the first step must not be after the last")
    return bounds


def moving_average(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean over the last ``window`` finite values' positions (NaN/Inf ignored)."""
    finite = np.isfinite(values)
    sums = np.concatenate([[0.0], np.cumsum(np.where(finite, values, 0.0))])
    counts = np.concatenate([[0], np.cumsum(finite)])
    index = np.arange(1, len(values) + 1)
    start = np.maximum(index - window, 0)
    count = counts[index] - counts[start]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, (sums[index] - sums[start]) / np.maximum(count, 1), np.nan)


def thresh_off_runs(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, last) row index of every run of consecutive rows where ``mask`` holds."""
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1


def shaded_spans(steps: np.ndarray, mask: np.ndarray, min_width: float) -> tuple[np.ndarray, np.ndarray]:
    """(left, right) step bounds of the shading of the rows where ``mask`` holds: each run of such
    rows spans from half a step gap before its first step to half a gap after its last, widened
    about its middle to ``min_width`` (one pixel column: a lone row stays visible on 100,000 steps),
    and overlapping spans merged."""
    starts, ends = thresh_off_runs(mask)
    half_gap = (np.median(np.diff(steps)) if len(steps) > 1 else 1.0) / 2
    left, right = steps[starts] - half_gap, steps[ends] + half_gap
    widen = np.maximum(min_width - (right - left), 0.0) / 2
    left, right = left - widen, right + widen
    # left and right stay increasing, so a span overlaps at most its neighbours.
    new_span = np.concatenate([[True], left[1:] > right[:-1]])
    return left[new_span], right[np.concatenate([new_span[1:], [True]])]


def _shade_runs(ax, steps: np.ndarray, mask: np.ndarray, min_width: float, color: str, label: str | None,
                gid: str):
    """Shade the :func:`shaded_spans` of ``mask`` over the full height of ``ax``. Returns the one
    PathPatch drawn (None when ``mask`` is all False): one closed rectangle (5 vertices) per span."""
    from matplotlib.patches import PathPatch
    from matplotlib.path import Path as DrawingPath

    if not mask.any():
        return None
    left, right = shaded_spans(steps, mask, min_width)
    rectangles = np.empty((len(left), 5, 2))
    rectangles[:, :, 0] = np.column_stack([left, left, right, right, left])
    rectangles[:, :, 1] = (0.0, 1.0, 1.0, 0.0, 0.0)
    codes = np.tile([DrawingPath.MOVETO, DrawingPath.LINETO, DrawingPath.LINETO, DrawingPath.LINETO,
                     DrawingPath.CLOSEPOLY], len(left))
    # One compound path, x in steps and y in axes fraction (the spans fill the panel whatever its log
    # y scale): drawing transforms it in one call. One axvspan per run (16,000 patches) took ~30 s,
    # and a PolyCollection still transforms each rectangle separately on a log axis.
    spans = PathPatch(DrawingPath(rectangles.reshape(-1, 2), codes), transform=ax.get_xaxis_transform(),
                      facecolor=color, alpha=0.3, linewidth=0, label=label, gid=gid)
    ax.add_artist(spans)  # not add_patch: the x limits come from the lines, and its per-segment limit
    return spans          # update is slow


def decimate(x: np.ndarray, y: np.ndarray, buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """The points of a line worth drawing when its x range is ``buckets`` (sub-)pixel columns wide.

    ``x`` (increasing) is cut into ``buckets`` equal spans; each span keeps its points with the
    smallest and the largest finite ``y`` (the first of equals), in x order, so every spike stays.
    A span without a finite ``y`` keeps one NaN point: the gap stays visible; shorter gaps are
    bridged. With at most 2 points per span all are kept. Non-finite ``y`` come back NaN."""
    finite = np.isfinite(y)
    y = np.where(finite, y, np.nan)
    if len(x) <= 2 * buckets:
        return x, y
    bucket = np.minimum(((x - x[0]) * (buckets / (x[-1] - x[0]))).astype(np.int64), buckets - 1)
    starts = np.flatnonzero(np.diff(bucket, prepend=-1))  # x is sorted: a bucket is a run of rows
    sizes = np.diff(starts, append=len(x))
    has_finite = np.add.reduceat(finite, starts, dtype=np.int64) > 0

    def first_extreme(key: np.ndarray, reduce: np.ufunc) -> np.ndarray:
        """Per bucket, the first row where ``key`` takes the bucket's ``reduce`` value."""
        hits = np.flatnonzero(key == np.repeat(reduce.reduceat(key, starts), sizes))
        return hits[np.diff(bucket[hits], prepend=-1) != 0]  # every bucket has a hit

    lowest = first_extreme(np.where(finite, y, np.inf), np.minimum)
    highest = first_extreme(np.where(finite, y, -np.inf), np.maximum)
    keep = np.unique(np.concatenate([lowest[has_finite], highest[has_finite], starts[~has_finite]]))
    return x[keep], y[keep]


def draw_logs(logs: Sequence[GradientLogData], *, smooth: int | None = None, title: str | None = None,
              dpi: int = 100, width_in: float = FIGURE_WIDTH_IN):
    """The figure of ``logs`` (matplotlib Agg; the caller saves and closes it). Artists tests look for
    carry a gid: ``skipped`` (red x per finite skipped step), ``nan``/``inf`` (one marker per such
    row; ``-<index>`` of the log appended), ``threshoff-1``/``threshoff-2`` (the shaded runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_scale = any(log.scale is not None for log in logs)
    with_cosine = any(log.cosine is not None for log in logs)
    panels = ["norm", "naninf", "loss"] + (["scale"] if with_scale else []) + (["cosine"] if with_cosine else [])
    heights = {"norm": 3.0, "naninf": 0.5 + 0.25 * len(logs), "loss": 2.0, "scale": 1.4, "cosine": 1.4}
    figure, axes_list = plt.subplots(len(panels), 1, sharex=True, figsize=(width_in, sum(heights[p] for p in panels)),
                                     gridspec_kw={"height_ratios": [heights[p] for p in panels]}, squeeze=False)
    axes = dict(zip(panels, axes_list[:, 0]))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    many = len(logs) > 1
    pixel_columns = int(width_in * dpi)  # at least the panels' width

    def line(ax, steps: np.ndarray, values: np.ndarray, **style) -> None:
        # Two buckets per pixel column: the zig-zag between each bucket's min and max then fills a
        # column as densely as the full line does.
        ax.plot(*decimate(steps, values, 2 * pixel_columns), **style)

    for index, log in enumerate(logs):
        color = colors[index % len(colors)]
        label = log.name if many else None
        steps = log.step
        ax = axes["norm"]
        positive = np.isfinite(log.norm) & (log.norm > 0)
        line(ax, steps[positive], log.norm[positive], color=color, lw=0.6,
             label=log.name if many else "gradient norm")
        line(ax, steps, log.threshold, color=color, lw=1.0, ls="--", alpha=0.9,
             label=f"threshold ({log.name})" if many else "threshold")
        skipped_finite = log.skipped & positive
        if skipped_finite.any():
            ax.scatter(steps[skipped_finite], log.norm[skipped_finite], marker="x", s=22, color="red", lw=1.0,
                       zorder=5, label="skipped" if index == 0 else None, gid="skipped" + (f"-{index}" if many else ""))
        pixel_steps = (steps[-1] - steps[0]) / pixel_columns  # about one pixel column, in steps
        for value, (shade, shade_label) in THRESH_OFF_SHADES.items():
            _shade_runs(ax, steps, log.thresh_off == value, pixel_steps, shade,
                        shade_label if index == 0 else None, gid=f"threshoff-{value}" + (f"-{index}" if many else ""))

        for ax in (axes["norm"], axes["loss"]):
            for step, to_step in log.event_steps("rewind"):
                ax.axvline(step, color="purple", lw=1.0, ls="-.", gid="rewind" + (f"-{index}" if many else ""),
                           label="rewind" if ax is axes["norm"] and index == 0 and step == log.event_steps(
                               "rewind")[0][0] else None)
                ax.axvspan(float(to_step), step, color="purple", alpha=0.08, lw=0)
        quarantined = log.event_steps("quarantine")
        if quarantined:
            at = np.array([step for step, _ in quarantined])
            finite_loss = log.loss[np.isfinite(log.loss)]
            level = float(np.nanmax(finite_loss)) if finite_loss.size else 1.0
            axes["loss"].scatter(at, np.full(len(at), level), marker="D", s=30, color="darkorange", zorder=5,
                                 label="quarantined image" if index == 0 else None,
                                 gid="quarantine" + (f"-{index}" if many else ""))

        ax = axes["naninf"]
        row = 2 * index
        for kind, rows, height in (("nan", np.isnan(log.norm), row + 1), ("inf", np.isinf(log.norm), row)):
            ax.scatter(steps[rows], np.full(rows.sum(), height), marker="|", s=60, color=color,
                       gid=kind + (f"-{index}" if many else ""))

        ax = axes["loss"]
        window = smooth or max(10, len(log) // 200)
        line(ax, steps, log.loss, color=color, lw=0.4, alpha=0.35)
        line(ax, steps, moving_average(log.loss, window), color=color, lw=1.4,
             label=f"loss, mean of {window} steps" + (f" ({log.name})" if many else ""))

        if with_scale and log.scale is not None:
            with np.errstate(divide="ignore", invalid="ignore"):
                log2_scale = np.log2(np.where(log.scale > 0, log.scale, np.nan))
            line(axes["scale"], steps, log2_scale, color=color, lw=1.0, drawstyle="steps-post", label=label)
        if with_cosine and log.cosine is not None:
            line(axes["cosine"], steps, log.cosine, color=color, lw=0.5, label=label)

    axes["norm"].set_yscale("log")
    axes["norm"].set_ylabel("gradient norm")
    axes["norm"].legend(loc="upper left", fontsize="small", ncol=3)
    naninf = axes["naninf"]
    naninf.set_yticks([tick for index in range(len(logs)) for tick in (2 * index, 2 * index + 1)])
    naninf.set_yticklabels([text for log in logs for text in
                            ((f"inf {log.name}", f"nan {log.name}") if many else ("inf", "nan"))], fontsize="small")
    naninf.set_ylim(-0.7, 2 * len(logs) - 0.3)
    naninf.set_ylabel("norm", fontsize="small")
    axes["loss"].set_ylabel("loss")
    axes["loss"].legend(loc="upper right", fontsize="small")
    if with_scale:
        axes["scale"].set_ylabel("log2(loss scale)")
    if with_cosine:
        axes["cosine"].set_ylabel("cosine to prev.")
        axes["cosine"].set_ylim(-1.05, 1.05)
        axes["cosine"].axhline(0.0, color="grey", lw=0.5)
    axes_list[-1, 0].set_xlabel("optimizer step")
    for ax in axes_list[:, 0]:
        ax.grid(True, alpha=0.3)
    skipped_total = ", ".join(
        f"{log.name}: {int(log.skipped.sum())} of {len(log)} skipped"
        + (f", {len(log.event_steps('rewind'))} rewinds" if log.event_steps("rewind") else "")
        + (f", {len(log.event_steps('quarantine'))} quarantined" if log.event_steps("quarantine") else "")
        for log in logs)
    figure.suptitle(title or skipped_total, fontsize="medium")
    figure.tight_layout()
    # tight_layout leaves a placeholder layout engine, which makes savefig draw everything twice.
    figure.set_layout_engine(None)
    return figure


def plot_logs(logs: Sequence[GradientLogData], out: str | Path, *, smooth: int | None = None,
              title: str | None = None, dpi: int = 100, width_in: float = FIGURE_WIDTH_IN) -> Path:
    """Draw ``logs`` (see :func:`draw_logs`) into one PNG at ``out`` (parents created); returns the path."""
    import matplotlib.pyplot as plt

    figure = draw_logs(logs, smooth=smooth, title=title, dpi=dpi, width_in=width_in)
    out = Path(out)
    image = io.BytesIO()
    try:
        figure.savefig(image, format=out.suffix.lstrip(".").lower() or "png", dpi=dpi)
    finally:
        plt.close(figure)
    atomic_files.write_file(out, image.getvalue())
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="plot_grad_log.py",
        description="Plot gradient logs (gradient_logs+<name>.txt): norm with threshold and skipped steps, "
                    "NaN/Inf steps, loss, loss scale and cosine similarity on one step axis.")
    parser.add_argument("logs", nargs="+", metavar="LOG", help="one or more gradient logs; several are overlaid")
    parser.add_argument("--out", default=None, metavar="PNG",
                        help="image to write. Default: the first log's name with .png, next to it")
    parser.add_argument("--last", type=int, default=None, metavar="N",
                        help="plot only the last N rows of each log (after --steps). Default: all")
    parser.add_argument("--steps", default=None, metavar="A:B",
                        help="plot only optimizer steps A..B inclusive (A: or :B leave a side open). Default: all")
    parser.add_argument("--smooth", type=int, default=None, metavar="STEPS",
                        help="window of the smoothed loss, in rows. Default: max(10, rows/200)")
    parser.add_argument("--title", default=None, help="figure title. Default: skipped counts per log")
    parser.add_argument("--dpi", type=int, default=100, help="image resolution in dots per inch. Default: 100")
    grad_guard.add_arguments(parser)
    add_fork_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> Path:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    explicit = grad_guard.explicit_dests(parser, argv)
    grad_guard.apply_preset(args, explicit)
    guard_parser = argparse.ArgumentParser(add_help=False)
    grad_guard.add_arguments(guard_parser)
    guard_dests = {action.dest for action in guard_parser._actions}
    check_fork_arguments(args)
    replay_config = grad_guard.GuardConfig.from_args(args) if explicit & guard_dests else None
    for flag in ("last", "smooth", "dpi"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag} must be a positive integer (got {value})")
    if args.dpi > MAX_DPI:
        raise UserError(f"--dpi {args.dpi}: at most {MAX_DPI} (a {FIGURE_WIDTH_IN:g}-inch-wide figure is then "
                        f"{int(FIGURE_WIDTH_IN * MAX_DPI)} pixels wide); e.g. --dpi 200 for a sharper image")
    out = Path(args.out) if args.out else Path(args.logs[0]).with_suffix(".png")
    inputs = [("LOG", path) for path in args.logs] + [("its events file", str(events_path(path)))
                                                              for path in args.logs]
    check_output_path("--out", str(out), inputs, suffixes=image_suffixes())
    low, high = parse_step_range(args.steps)
    logs = []
    for path in args.logs:
        log = read_gradient_log(path)
        config = replay_config
        if log.fork_layout:
            print(fork_layout_note(path, len(log), args.gradient_accumulation_steps, args.initial_step))
            if config is not None:
                config = fork_replay_config(config, log.epoch.tolist(), args.gradient_accumulation_steps,
                                            args.initial_step)
        if config is not None:  # replay needs every row from step 1, so it runs before the cut
            replay_skips(log, config)
        log = log.select((log.step >= low) & (log.step <= high))
        if args.last is not None:
            log = log.select(slice(max(len(log) - args.last, 0), None))
        if len(log) == 0:
            raise UserError(f"{path}: no rows to plot" + (f" in --steps {args.steps}" if args.steps else ""))
        logs.append(log)
    plot_logs(logs, out, smooth=args.smooth, title=args.title, dpi=args.dpi)
    print(f"wrote {out} ({', '.join(f'{log.name}: {len(log)} rows, {int(log.skipped.sum())} skipped' for log in logs)})")
    return out


if __name__ == "__main__":
    exit_on_user_error(main)
