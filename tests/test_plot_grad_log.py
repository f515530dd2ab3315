"""tools/plot_grad_log.py: reads real gradient logs (any column variant) fast and writes one PNG."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from library import grad_guard
from library.errors import UserError
from library.grad_log import GradientLog
from tools import plot_grad_log

REPO_ROOT = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_log(path: Path, rows: int, *, with_scale: bool, with_cosine: bool, flags: list[str],
              seed: int = 0) -> list[int]:
    """A log as training writes it (GradientLog + GradGuard decisions); returns the skipped steps."""
    import argparse

    parser = argparse.ArgumentParser()
    grad_guard.add_arguments(parser)
    args = parser.parse_args(flags)
    grad_guard.apply_preset(args, grad_guard.explicit_dests(parser, flags))
    guard = grad_guard.GradGuard(grad_guard.GuardConfig.from_args(args), announce=lambda line: None)
    rng = np.random.default_rng(seed)
    norms = rng.lognormal(3.0, 0.3, size=rows)
    norms[rng.choice(rows, size=max(rows // 2000, 3), replace=False)] *= 50  # spikes
    norms[[rows // 3, rows // 2]] = math.nan
    norms[rows // 4] = math.inf
    losses = 0.1 + 0.05 * rng.random(rows)
    log = GradientLog(path, with_scale=with_scale, with_cosine=with_cosine, flush_every=10_000)
    log.start()
    skipped = []
    scale = 65536.0
    for step, norm in enumerate(norms.tolist(), 1):
        decision = guard.decide(step, norm)
        if decision.skip:
            skipped.append(step)
        if not math.isfinite(norm):
            scale /= 2
        log.append(epoch=1 + step // 1000, step=step, norm=norm, threshold=decision.threshold,
                   loss=float(losses[step - 1]), thresh_off=decision.thresh_off,
                   scale=scale if with_scale else None,
                   cosine=float(rng.uniform(-1, 1)) if with_cosine else None)
    log.flush()
    return skipped


@pytest.fixture(scope="module")
def big_log(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("big") / "gradient_logs+big.txt"
    write_log(path, 100_000, with_scale=True, with_cosine=True, flags=["--grad_guard_preset", "minimal"])
    return path


def test_plots_100k_rows(big_log, tmp_path):
    """End to end on a long log (its speed: benchmarks/bench_plot_grad_log.py)."""
    out = tmp_path / "big.png"
    plot_grad_log.main([str(big_log), "--out", str(out)])
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    assert out.stat().st_size > 20_000


@pytest.mark.parametrize("with_scale,with_cosine", [(False, False), (True, False), (False, True), (True, True)])
def test_column_variants_and_logged_skips(with_scale, with_cosine, tmp_path):
    """Every header variant reads; the skipped steps derived from the log are the guard's own
    decisions when immediate NaN/Inf skipping is on (the minimal preset)."""
    path = tmp_path / "gradient_logs+v.txt"
    skipped = write_log(path, 1200, with_scale=with_scale, with_cosine=with_cosine,
                        flags=["--grad_guard_preset", "minimal", "--skip_grad_norm_max", "60"])
    data = plot_grad_log.read_gradient_log(path)
    assert len(data) == 1200
    assert (data.scale is not None) == with_scale and (data.cosine is not None) == with_cosine
    assert np.flatnonzero(data.skipped).tolist() == [step - 1 for step in skipped]
    assert np.isnan(data.norm[400]) and np.isinf(data.norm[300])
    out = plot_grad_log.main([str(path), "--out", str(tmp_path / "v.png")])
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_replay_flags_reproduce_training_decisions(tmp_path):
    """With guard flags the tool replays with the trainers' decision code (stable preset: NaN does
    not get skipped by the guard, the threshold becomes NaN => ThreshOff=1 spans)."""
    path = tmp_path / "gradient_logs+s.txt"
    flags = ["--grad_guard_preset", "stable"]
    skipped = write_log(path, 900, with_scale=True, with_cosine=True, flags=flags)
    data = plot_grad_log.read_gradient_log(path)
    plot_grad_log.replay_skips(data, grad_guard.GuardConfig.from_args(
        _parsed(flags)))
    assert np.flatnonzero(data.skipped).tolist() == [step - 1 for step in skipped]
    assert (data.thresh_off == 1).any()
    plot_grad_log.main([str(path), *flags, "--out", str(tmp_path / "s.png")])
    assert (tmp_path / "s.png").stat().st_size > 0


def _parsed(flags):
    import argparse

    parser = argparse.ArgumentParser()
    grad_guard.add_arguments(parser)
    args = parser.parse_args(flags)
    grad_guard.apply_preset(args, grad_guard.explicit_dests(parser, flags))
    return args


def test_overlay_last_and_steps(big_log, tmp_path):
    other = tmp_path / "gradient_logs+other.txt"
    write_log(other, 3000, with_scale=False, with_cosine=False, flags=[], seed=3)
    out = tmp_path / "overlay.png"
    plot_grad_log.main([str(big_log), str(other), "--steps", "1000:2500", "--out", str(out)])
    assert out.stat().st_size > 0
    data = plot_grad_log.read_gradient_log(other)
    last = data.select(slice(len(data) - 50, None))
    assert last.step[0] == 2951 and len(last) == 50
    plot_grad_log.main([str(other), "--last", "50", "--out", str(tmp_path / "last.png")])


def test_torn_rows_and_empty_threshold(tmp_path):
    path = tmp_path / "gradient_logs+torn.txt"
    path.write_text("Epoch,Step,Gradient Norm,Threshold,Loss,ThreshOff\n"
                    "1,1,2.0,200000.0,0.5,0\n1,2,nan,,0.4,1\n1,3,inf,,0.3,1\n1,4,3.0\n")
    data = plot_grad_log.read_gradient_log(path)
    assert data.step.tolist() == [1, 2, 3]
    assert np.isnan(data.threshold[1:]).all()
    assert data.skipped.tolist() == [False, True, True]


def test_user_errors(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(UserError, match="missing column"):
        plot_grad_log.read_gradient_log(bad)
    with pytest.raises(UserError, match="cannot read"):
        plot_grad_log.read_gradient_log(tmp_path / "missing.txt")
    with pytest.raises(UserError, match="--steps"):
        plot_grad_log.parse_step_range("5-9")
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "plot_grad_log.py"), str(bad)],
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


def test_moving_average_ignores_nan():
    values = np.array([1.0, np.nan, 3.0, 5.0])
    assert plot_grad_log.moving_average(values, 2).tolist() == [1.0, 1.0, 3.0, 4.0]


def busy_log(rows: int, seed: int = 0) -> plot_grad_log.GradientLogData:
    """A log with many scattered NaN/Inf rows, skips and ThreshOff runs of both kinds (logged values)."""
    rng = np.random.default_rng(seed)
    norm = rng.lognormal(3.0, 0.3, size=rows)
    norm[rng.choice(rows, size=rows // 100, replace=False)] = np.nan
    norm[rng.choice(rows, size=rows // 100, replace=False)] = np.inf
    thresh_off = np.where(rng.random(rows) < 0.15, rng.integers(1, 3, size=rows), 0)
    threshold = np.where(thresh_off == 1, np.nan, 40.0)
    data = plot_grad_log.GradientLogData(
        "busy", epoch=np.ones(rows), step=np.arange(1.0, rows + 1), norm=norm, threshold=threshold,
        loss=rng.random(rows), thresh_off=thresh_off, scale=np.full(rows, 65536.0), cosine=rng.uniform(-1, 1, rows))
    data.skipped = plot_grad_log.logged_skips(data)
    return data


def artist(figure, gid: str):
    found = [child for ax in figure.axes for child in ax.get_children() if child.get_gid() == gid]
    assert len(found) == 1, gid
    return found[0]


def shaded_rectangles(figure, gid: str) -> np.ndarray:
    """(left, right) of every rectangle of a shading path, checking each spans the panel's full height."""
    patch = artist(figure, gid)
    assert patch.get_transform() == patch.axes.get_xaxis_transform()  # y in axes fraction
    rectangles = patch.get_path().vertices.reshape(-1, 5, 2)
    assert (rectangles[:, :, 1] == [0, 1, 1, 0, 0]).all()
    assert (rectangles[:, 0, 0] == rectangles[:, 1, 0]).all() and (rectangles[:, 2, 0] == rectangles[:, 3, 0]).all()
    return rectangles[:, [0, 2], 0]


def test_shading_covers_exactly_the_thresh_off_runs():
    data = busy_log(600)  # fewer rows than pixel columns: no run is widened
    figure = plot_grad_log.draw_logs([data])
    try:
        for value in (1, 2):
            rows = np.flatnonzero(data.thresh_off == value)
            runs = np.split(rows, np.flatnonzero(np.diff(rows) > 1) + 1)
            assert len(runs) > 20
            expected = [[data.step[run[0]] - 0.5, data.step[run[-1]] + 0.5] for run in runs]
            assert shaded_rectangles(figure, f"threshoff-{value}").tolist() == expected
    finally:
        import matplotlib.pyplot as plt

        plt.close(figure)


def test_shaded_spans_keep_lone_rows_visible_and_merge():
    steps = np.arange(1.0, 100_001)
    mask = np.zeros(len(steps), dtype=bool)
    mask[[499, 4999, 5001]] = True  # steps 500, 5000 and 5002 alone
    mask[999:2000] = True  # steps 1000..2000
    left, right = plot_grad_log.shaded_spans(steps, mask, min_width=80.0)
    assert np.allclose(np.column_stack([left, right]),
                       [(460, 540), (999.5, 2000.5), (5000 - 40, 5002 + 40)])
    assert np.allclose(plot_grad_log.shaded_spans(steps, mask, min_width=0.0),
                       [[499.5, 999.5, 4999.5, 5001.5], [500.5, 2000.5, 5000.5, 5002.5]])


def test_every_nan_inf_and_skipped_row_has_a_marker_in_a_long_log():
    data = busy_log(60_000, seed=1)
    figure = plot_grad_log.draw_logs([data])
    try:
        for gid, rows in (("nan", np.isnan(data.norm)), ("inf", np.isinf(data.norm)),
                          ("skipped", data.skipped & np.isfinite(data.norm))):
            offsets = artist(figure, gid).get_offsets()
            assert rows.sum() >= 100
            assert np.asarray(offsets[:, 0]).tolist() == data.step[rows].tolist(), gid
        assert np.array_equal(artist(figure, "skipped").get_offsets()[:, 1],
                              data.norm[data.skipped & np.isfinite(data.norm)])
        # the ThreshOff runs of a long log: every such row lies in a shaded span
        for value in (1, 2):
            spans = shaded_rectangles(figure, f"threshoff-{value}")
            steps = data.step[data.thresh_off == value]
            inside = np.searchsorted(spans[:, 0], steps, side="right") - 1
            assert (inside >= 0).all() and (steps <= spans[inside, 1]).all()
        # lines are decimated, and the highest norm (a spike) is still drawn
        norm_line = next(line for line in figure.axes[0].get_lines() if line.get_label() == "gradient norm")
        assert len(norm_line.get_xdata()) < len(data) / 5
        assert np.nanmax(norm_line.get_ydata()) == np.max(data.norm[np.isfinite(data.norm)])
    finally:
        import matplotlib.pyplot as plt

        plt.close(figure)


def test_decimation_keeps_each_buckets_min_and_max():
    rng = np.random.default_rng(2)
    x = np.cumsum(rng.uniform(0.5, 1.5, size=20_000))
    y = rng.normal(size=len(x))
    y[rng.choice(len(x), size=2000, replace=False)] = np.nan
    y[5000:5400] = np.nan  # a gap of several buckets
    y[[100, 9000]] = (50.0, -50.0)  # spikes
    buckets = 500
    kept_x, kept_y = plot_grad_log.decimate(x, y, buckets)
    assert (np.diff(kept_x) > 0).all() and len(kept_x) <= 2 * buckets
    edges = x[0] + (x[-1] - x[0]) * np.arange(buckets + 1) / buckets
    edges[-1] = np.inf
    for low, high in zip(edges[:-1], edges[1:]):
        rows, kept = (x >= low) & (x < high), (kept_x >= low) & (kept_x < high)
        if not rows.any():
            continue
        finite = rows & np.isfinite(y)
        if not finite.any():  # a gap: one NaN point keeps the line broken
            assert kept.sum() == 1 and np.isnan(kept_y[kept]).all()
            continue
        smallest, largest = np.flatnonzero(finite)[[np.argmin(y[finite]), np.argmax(y[finite])]]
        points = set(zip(kept_x[kept].tolist(), kept_y[kept].tolist()))
        assert points == {(x[smallest], y[smallest]), (x[largest], y[largest])}
    assert 50.0 in kept_y and -50.0 in kept_y
    few_x, few_y = x[:2 * buckets], y[:2 * buckets].copy()  # at most 2 points per bucket: all kept
    few_y[[3, 4]] = (np.inf, -np.inf)
    kept_x, kept_y = plot_grad_log.decimate(few_x, few_y, buckets)
    assert np.array_equal(kept_x, few_x) and np.array_equal(kept_y, np.where(np.isfinite(few_y), few_y, np.nan),
                                                            equal_nan=True)


def test_fork_layout_log_is_drawn_in_row_order(tmp_path, capsys):
    """A log of the original --skip_grad_norm fork (Step restarts every epoch, Epoch from 0)."""
    path = tmp_path / "gradient_logs+fork.txt"
    rows = [f"{index // 50},{index % 50},{10.0 + index % 7},200000.0,0.1,0" for index in range(120)]
    rows[70] = "1,20,nan,nan,0.1,1"
    path.write_text("Epoch,Step,Gradient Norm,Threshold,Loss,ThreshOff\n" + "\n".join(rows) + "\n")
    data = plot_grad_log.read_gradient_log(path)
    assert data.fork_layout and data.step.tolist() == list(range(1, 121))
    assert np.flatnonzero(data.skipped).tolist() == [70] and data.thresh_off[70] == 1
    plot_grad_log.main([str(path), "--steps", "60:100", "--out", str(tmp_path / "fork.png")])
    note, wrote = capsys.readouterr().out.splitlines()
    assert note.startswith(f"{path}: ") and "global steps 1..120" in note
    assert wrote.startswith(f"wrote {tmp_path / 'fork.png'} (gradient_logs+fork.txt: 41 rows, 1 skipped)")
