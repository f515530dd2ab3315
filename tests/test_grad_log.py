"""The CSV gradient log: header variants, formatting, buffering, resume truncation, signal flush."""
from __future__ import annotations

import argparse
import math
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from library.errors import UserError
from library.grad_log import GradientLog, install_flush_handlers

REPO_ROOT = Path(__file__).resolve().parent.parent


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


def add_rows(log: GradientLog, steps, epoch: int = 1) -> None:
    for step in steps:
        log.append(epoch=epoch, step=step, norm=float(step), threshold=200000.0, loss=0.5, thresh_off=0,
                   scale=65536.0 if log.with_scale else None, cosine=0.25 if log.with_cosine else None)


def args_for(tmp_path: Path, **overrides) -> argparse.Namespace:
    values = dict(grad_norm_log=True, grad_cosine_log=False, grad_norm_log_dir=None, output_dir=str(tmp_path),
                  output_name=None)
    values.update(overrides)
    return argparse.Namespace(**values)


@pytest.mark.parametrize("with_scale, with_cosine, header", [
    (False, False, "Epoch,Step,Gradient Norm,Threshold,Loss,ThreshOff"),
    (True, False, "Epoch,Step,Gradient Norm,Threshold,Loss,ThreshOff,Scale"),
    (False, True, "Epoch,Step,Gradient Norm,Threshold,Loss,ThreshOff,CosineSim"),
    (True, True, "Epoch,Step,Gradient Norm,Threshold,Loss,ThreshOff,Scale,CosineSim"),
])
def test_header_variants(tmp_path, with_scale, with_cosine, header):
    log = GradientLog.from_args(args_for(tmp_path, grad_cosine_log=with_cosine), with_scale=with_scale)
    log.start()
    add_rows(log, [1])
    log.flush()
    assert log.path == tmp_path / "gradient_logs+last.txt"
    assert lines(log.path)[0] == header and len(lines(log.path)) == 2


def test_row_formatting_nan_inf_and_empty_threshold(tmp_path):
    log = GradientLog(tmp_path / "g.txt", with_scale=True, with_cosine=True)
    log.start()
    log.append(epoch=1, step=1, norm=12.5, threshold=200000.0, loss=0.125, thresh_off=0, scale=65536.0,
               cosine=math.nan)
    log.append(epoch=2, step=2, norm=math.nan, threshold=math.nan, loss=0.25, thresh_off=1, scale=32768.0,
               cosine=0.5)
    log.append(epoch=2, step=3, norm=math.inf, threshold=math.inf, loss=math.nan, thresh_off=2, scale=1.0,
               cosine=-1.0)
    log.flush()
    assert lines(log.path)[1:] == [
        "1,1,12.5,200000.0,0.125,0,65536.0,nan",
        "2,2,nan,,0.25,1,32768.0,0.5",
        "2,3,inf,inf,nan,2,1.0,-1.0",
    ]


def test_columns_must_match_the_values_given(tmp_path):
    log = GradientLog(tmp_path / "g.txt", with_scale=False, with_cosine=False)
    with pytest.raises(ValueError):
        log.append(epoch=1, step=1, norm=1.0, threshold=1.0, loss=1.0, thresh_off=0, scale=2.0)


def test_rows_are_buffered_and_appended_every_100(tmp_path):
    log = GradientLog(tmp_path / "g.txt", with_scale=False, with_cosine=False)
    log.start()
    add_rows(log, range(1, 100))
    assert not log.path.exists() and log.pending_rows == 99  # nothing written before the first flush
    add_rows(log, [100])
    assert len(lines(log.path)) == 101 and log.pending_rows == 0
    add_rows(log, range(101, 106))
    assert len(lines(log.path)) == 101
    log.flush()
    log.flush()  # nothing pending: no duplicates
    assert [int(line.split(",")[1]) for line in lines(log.path)[1:]] == list(range(1, 106))


def test_flush_creates_the_header_when_start_was_not_called(tmp_path):
    log = GradientLog(tmp_path / "sub" / "g.txt", with_scale=False, with_cosine=False)
    add_rows(log, [1])
    log.flush()
    assert lines(log.path) == ["Epoch,Step,Gradient Norm,Threshold,Loss,ThreshOff", "1,1,1.0,200000.0,0.5,0"]


def test_fresh_start_replaces_an_old_log_at_its_first_flush(tmp_path):
    path = tmp_path / "g.txt"
    old = GradientLog(path, with_scale=False, with_cosine=False)
    old.start()
    add_rows(old, [1, 2])
    old.flush()
    new = GradientLog(path, with_scale=False, with_cosine=False)
    new.start()
    new.flush()
    assert len(lines(path)) == 3  # a run that fails before its first row leaves the old log as it was
    add_rows(new, [1])
    new.flush()
    assert [int(line.split(",")[1]) for line in lines(path)[1:]] == [1]


def test_resume_drops_rows_after_the_checkpoint_step_then_appends(tmp_path):
    path = tmp_path / "g.txt"
    first = GradientLog(path, with_scale=True, with_cosine=False)
    first.start()
    add_rows(first, range(1, 151))  # crash after step 150; checkpoint was at step 120
    first.flush()
    with open(path, "a", encoding="utf-8") as file:
        file.write("1,151,3.")  # a torn row
    resumed = GradientLog(path, with_scale=True, with_cosine=False)
    resumed.start(resume_step=120)
    assert len(lines(path)) == 152  # untouched until the resumed run flushes a row
    add_rows(resumed, range(121, 131))
    resumed.flush()
    assert [int(line.split(",")[1]) for line in lines(path)[1:]] == list(range(1, 131))


def test_truncate_after_also_drops_pending_rows(tmp_path):
    log = GradientLog(tmp_path / "g.txt", with_scale=False, with_cosine=False)
    log.start()
    add_rows(log, range(1, 11))
    log.truncate_after(5)
    log.flush()
    assert [int(line.split(",")[1]) for line in lines(log.path)[1:]] == [1, 2, 3, 4, 5]


def test_resume_without_a_file_starts_one(tmp_path):
    log = GradientLog(tmp_path / "g.txt", with_scale=False, with_cosine=True)
    log.start(resume_step=300)
    add_rows(log, [301])
    log.flush()
    assert lines(log.path) == ["Epoch,Step,Gradient Norm,Threshold,Loss,ThreshOff,CosineSim",
                               "1,301,301.0,200000.0,0.5,0,0.25"]


def test_resume_with_other_columns_rewrites_rows(tmp_path, caplog):
    path = tmp_path / "g.txt"
    old = GradientLog(path, with_scale=True, with_cosine=False)
    old.start()
    add_rows(old, [1, 2])
    old.flush()
    resumed = GradientLog(path, with_scale=False, with_cosine=True)
    resumed.start(resume_step=2)
    add_rows(resumed, [3])
    resumed.flush()
    assert lines(path) == ["Epoch,Step,Gradient Norm,Threshold,Loss,ThreshOff,CosineSim",
                           "1,1,1.0,200000.0,0.5,0,", "1,2,2.0,200000.0,0.5,0,", "1,3,3.0,200000.0,0.5,0,0.25"]
    assert "columns change" in caplog.text


def test_resume_onto_a_file_that_is_not_a_gradient_log(tmp_path):
    path = tmp_path / "g.txt"
    path.write_text("something else\n1\n", encoding="utf-8")
    with pytest.raises(UserError, match="not a gradient log"):
        GradientLog(path, with_scale=False, with_cosine=False).start(resume_step=1)


def test_from_args_paths_and_cosine_rules(tmp_path, caplog):
    assert GradientLog.from_args(args_for(tmp_path, grad_norm_log=False), with_scale=False) is None
    assert GradientLog.from_args(args_for(tmp_path, grad_norm_log=False, grad_cosine_log=True),
                                 with_scale=False) is None
    assert "--grad_cosine_log needs --grad_norm_log" in caplog.text
    log = GradientLog.from_args(args_for(tmp_path, output_name="mylora", grad_norm_log_dir=str(tmp_path / "logs")),
                                with_scale=False)
    assert log.path == tmp_path / "logs" / "gradient_logs+mylora.txt"
    with pytest.raises(UserError, match="--grad_norm_log_dir"):
        GradientLog.from_args(args_for(tmp_path, output_dir=None), with_scale=False)


SIGNAL_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from library.grad_log import GradientLog, install_flush_handlers
    log = GradientLog({path!r}, with_scale=False, with_cosine=False)
    log.start()
    install_flush_handlers(log.flush)
    for step in range(1, 8):
        log.append(epoch=1, step=step, norm=1.0, threshold=2.0, loss=0.5, thresh_off=0)
    print("ready", flush=True)
    if {mode!r} == "exit":
        sys.exit(0)
    time.sleep(60)
""")


@pytest.mark.parametrize("mode, signum", [("sigterm", signal.SIGTERM), ("sigint", signal.SIGINT), ("exit", None)])
def test_pending_rows_are_flushed_on_signals_and_exit(tmp_path, mode, signum):
    path = tmp_path / "g.txt"
    script = SIGNAL_SCRIPT.format(root=str(REPO_ROOT), path=str(path), mode=mode)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    assert process.stdout.readline().strip() == "ready"
    if signum is not None:
        process.send_signal(signum)
    _, stderr = process.communicate(timeout=30)
    if mode == "sigterm":
        assert process.returncode == -signal.SIGTERM  # still killed by the signal after flushing
    elif mode == "sigint":
        assert process.returncode != 0 and "KeyboardInterrupt" in stderr
    else:
        assert process.returncode == 0
    assert len(lines(path)) == 8


def test_uninstall_restores_the_previous_handlers():
    before = signal.getsignal(signal.SIGTERM)
    uninstall = install_flush_handlers(lambda: None)
    assert signal.getsignal(signal.SIGTERM) is not before
    uninstall()
    assert signal.getsignal(signal.SIGTERM) == before
