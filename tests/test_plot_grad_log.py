"""tools/plot_grad_log.py: reads real gradient logs (any column variant) fast and writes one PNG."""
from __future__ import annotations

import math
import subprocess
import sys
import time
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


def test_plots_100k_rows_fast(big_log, tmp_path):
    out = tmp_path / "big.png"
    started = time.perf_counter()
    plot_grad_log.main([str(big_log), "--out", str(out)])
    elapsed_s = time.perf_counter() - started
    assert out.read_bytes()[:8] == PNG_SIGNATURE
    assert out.stat().st_size > 20_000
    assert elapsed_s < 10, f"plotting 100k rows took {elapsed_s:.1f} s"


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
