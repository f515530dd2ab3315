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

Which steps are "skipped": without guard flags, the steps the guard skips given what
the log records: ``Gradient Norm > Threshold`` outside an idle-free phase, and every
NaN/Inf norm (such a step changes no weight: the guard or the GradScaler drops it).
With guard flags (``--skip_grad_norm``, ``--grad_guard_preset ...``, the trainers' own
definitions) the decisions and thresholds are replayed with the trainers' decision code
(``tools/replay_grad_guard.py``) and those are drawn instead.

Several logs are overlaid, one colour each. Reading is vectorised (a 100,000-row log
loads and plots in a few seconds); drawing is headless (matplotlib's Agg backend).
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import csv  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Sequence  # noqa: E402

import numpy as np  # noqa: E402

from library import grad_guard  # noqa: E402
from library.errors import UserError, exit_on_user_error  # noqa: E402
from library.grad_log import BASE_COLUMNS  # noqa: E402

THRESH_OFF_SHADES = {1: ("#f4c542", "ThreshOff=1 (threshold NaN)"), 2: ("#7fb3e6", "ThreshOff=2 (idle-free phase)")}


@dataclass
class GradientLogData:
    """The numeric columns of one gradient log (float64; NaN where a value is empty/unparsable).
    ``scale``/``cosine`` are None when the log has no such column."""

    name: str
    epoch: np.ndarray
    step: np.ndarray
    norm: np.ndarray
    threshold: np.ndarray
    loss: np.ndarray
    thresh_off: np.ndarray
    scale: np.ndarray | None = None
    cosine: np.ndarray | None = None
    skipped: np.ndarray = field(default=None)  # bool per row, set by mark_skipped

    def __len__(self) -> int:
        return len(self.step)

    def select(self, mask_or_slice) -> GradientLogData:
        """The rows picked by a boolean mask or a slice."""
        pick = lambda values: None if values is None else values[mask_or_slice]  # noqa: E731
        return GradientLogData(self.name, *(pick(getattr(self, name)) for name in
                                            ("epoch", "step", "norm", "threshold", "loss", "thresh_off",
                                             "scale", "cosine", "skipped")))


def _column(rows_by_column: Sequence[Sequence[str]], index: int) -> np.ndarray:
    """One CSV column as float64: empty -> NaN; 'nan'/'inf' understood; junk -> NaN."""
    values = np.asarray(rows_by_column[index], dtype=object).astype(str)
    values = np.char.strip(values)
    values[values == ""] = "nan"
    try:
        return values.astype(np.float64)
    except ValueError:  # rare: a damaged cell; fall back to a per-value parse
        def parse(text: str) -> float:
            try:
                return float(text)
            except ValueError:
                return np.nan
        return np.fromiter((parse(text) for text in values), dtype=np.float64, count=len(values))


def read_gradient_log(path: str | Path) -> GradientLogData:
    """Read a ``gradient_logs+*.txt`` CSV. Torn rows (wrong field count) are dropped.
    Raises ``UserError`` when the file is missing or not a gradient log."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8", newline="") as file:
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
        return _column(columns, header.index(name))

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
    data.skipped = logged_skips(data)
    return data


def logged_skips(data: GradientLogData) -> np.ndarray:
    """Steps without a weight update, from what the log records: NaN/Inf norm, or norm above the
    logged threshold outside an idle-free phase (a NaN threshold compares False, as in the guard)."""
    with np.errstate(invalid="ignore"):
        above = (data.norm > data.threshold) & (data.thresh_off != 2)
    return ~np.isfinite(data.norm) | above


def replay_skips(data: GradientLogData, config: grad_guard.GuardConfig) -> None:
    """Replace ``skipped``, ``threshold`` and ``thresh_off`` by the trainers' decisions under ``config``."""
    guard = grad_guard.GradGuard(config, announce=lambda line: None)
    decisions = [guard.decide(int(step), float(norm)) for step, norm in zip(data.step, data.norm)]
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


def _shade_runs(ax, steps: np.ndarray, mask: np.ndarray, color: str, label: str | None) -> None:
    """Shade the step spans where ``mask`` holds (vectorised: one artist per run boundary set)."""
    if not mask.any():
        return
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1
    step_gap = np.median(np.diff(steps)) if len(steps) > 1 else 1.0
    for number, (start, end) in enumerate(zip(starts, ends)):
        ax.axvspan(steps[start] - step_gap / 2, steps[end] + step_gap / 2, color=color, alpha=0.3, lw=0,
                   label=label if number == 0 else None)


def plot_logs(logs: Sequence[GradientLogData], out: str | Path, *, smooth: int | None = None,
              title: str | None = None, dpi: int = 100, width_in: float = 12.0) -> Path:
    """Draw ``logs`` into one PNG at ``out`` (parents created); returns the path."""
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

    for index, log in enumerate(logs):
        color = colors[index % len(colors)]
        label = log.name if many else None
        steps = log.step
        ax = axes["norm"]
        positive = np.isfinite(log.norm) & (log.norm > 0)
        ax.plot(steps[positive], log.norm[positive], color=color, lw=0.6, label=log.name if many else "gradient norm")
        ax.plot(steps, np.where(np.isfinite(log.threshold), log.threshold, np.nan), color=color, lw=1.0, ls="--",
                alpha=0.9, label=f"threshold ({log.name})" if many else "threshold")
        skipped_finite = log.skipped & positive
        if skipped_finite.any():
            ax.scatter(steps[skipped_finite], log.norm[skipped_finite], marker="x", s=22, color="red", lw=1.0,
                       zorder=5, label="skipped" if index == 0 else None)
        if index == 0:
            for value, (shade, shade_label) in THRESH_OFF_SHADES.items():
                _shade_runs(ax, steps, log.thresh_off == value, shade, shade_label)
        elif any((log.thresh_off == value).any() for value in THRESH_OFF_SHADES):
            for value, (shade, _) in THRESH_OFF_SHADES.items():
                _shade_runs(ax, steps, log.thresh_off == value, shade, None)

        ax = axes["naninf"]
        nan_rows, inf_rows = np.isnan(log.norm), np.isinf(log.norm)
        row = 2 * index
        ax.scatter(steps[nan_rows], np.full(nan_rows.sum(), row + 1), marker="|", s=60, color=color)
        ax.scatter(steps[inf_rows], np.full(inf_rows.sum(), row), marker="|", s=60, color=color)

        ax = axes["loss"]
        window = smooth or max(10, len(log) // 200)
        ax.plot(steps, log.loss, color=color, lw=0.4, alpha=0.35)
        ax.plot(steps, moving_average(log.loss, window), color=color, lw=1.4,
                label=f"loss, mean of {window} steps" + (f" ({log.name})" if many else ""))

        if with_scale and log.scale is not None:
            with np.errstate(divide="ignore", invalid="ignore"):
                ax_scale_values = np.log2(np.where(log.scale > 0, log.scale, np.nan))
            axes["scale"].plot(steps, ax_scale_values, color=color, lw=1.0, drawstyle="steps-post", label=label)
        if with_cosine and log.cosine is not None:
            axes["cosine"].plot(steps, log.cosine, color=color, lw=0.5, label=label)

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
    skipped_total = ", ".join(f"{log.name}: {int(log.skipped.sum())} of {len(log)} skipped" for log in logs)
    figure.suptitle(title or skipped_total, fontsize="medium")
    figure.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=dpi)
    plt.close(figure)
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
    replay_config = grad_guard.GuardConfig.from_args(args) if explicit & guard_dests else None
    for flag in ("last", "smooth", "dpi"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag} must be a positive integer (got {value})")
    low, high = parse_step_range(args.steps)
    logs = []
    for path in args.logs:
        log = read_gradient_log(path)
        if replay_config is not None:  # replay needs every row from step 1, so it runs before the cut
            replay_skips(log, replay_config)
        log = log.select((log.step >= low) & (log.step <= high))
        if args.last is not None:
            log = log.select(slice(max(len(log) - args.last, 0), None))
        if len(log) == 0:
            raise UserError(f"{path}: no rows to plot" + (f" in --steps {args.steps}" if args.steps else ""))
        logs.append(log)
    out = Path(args.out) if args.out else Path(args.logs[0]).with_suffix(".png")
    plot_logs(logs, out, smooth=args.smooth, title=args.title, dpi=args.dpi)
    print(f"wrote {out} ({', '.join(f'{log.name}: {len(log)} rows, {int(log.skipped.sum())} skipped' for log in logs)})")
    return out


if __name__ == "__main__":
    exit_on_user_error(main)
