"""tools/replay_grad_guard.py: reproduces a training run's own decisions from its gradient log."""
from __future__ import annotations

import argparse
import csv
import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from library import grad_guard
from library.errors import exit_on_user_error
from library.grad_log import GradientLog, is_fork_layout

REPO_ROOT = Path(__file__).resolve().parent.parent
TOOL = REPO_ROOT / "tools" / "replay_grad_guard.py"

_spec = importlib.util.spec_from_file_location("replay_grad_guard", TOOL)
replay_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(replay_tool)


def training_norms(count: int = 520, seed: int = 0) -> list[float]:
    rng = np.random.default_rng(seed)
    norms = [float(x) for x in rng.lognormal(3.0, 0.3, size=count)]
    for index in (30, 260, 400):
        norms[index] = math.nan
    for index in (120, 330):
        norms[index] = math.inf
    for index in (220, 221, 350, 480):
        norms[index] *= 40  # spikes the threshold catches
    return norms


def write_training_log(path: Path, flags: list[str], norms: list[float]) -> list[int]:
    """What a training run does: guard decisions logged per step. Returns the skipped steps."""
    parser = argparse.ArgumentParser()
    grad_guard.add_arguments(parser)
    args = parser.parse_args(flags)
    grad_guard.apply_preset(args, grad_guard.explicit_dests(parser, flags))
    guard = grad_guard.GradGuard(grad_guard.GuardConfig.from_args(args), announce=lambda line: None)
    log = GradientLog(path, with_scale=True, with_cosine=True)
    log.start()
    skipped = []
    for step, norm in enumerate(norms, 1):
        decision = guard.decide(step, norm)
        if decision.skip:
            skipped.append(step)
        log.append(epoch=1 + step // 100, step=step, norm=norm, threshold=decision.threshold, loss=0.1,
                   thresh_off=decision.thresh_off, scale=65536.0, cosine=0.5)
    log.flush()
    return skipped


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, encoding="utf-8", newline="") as file:
        return list(csv.DictReader(file))


@pytest.mark.parametrize("flags", [
    ["--grad_guard_preset", "stable", "--auto_cap_release", "--idle_free_phase", "--idle_max_steps", "60",
     "--idle_free_len", "15"],
    ["--skip_grad_norm", "--skip_grad_norm_max", "60", "--nan_to_window", "--no-skip_nan_immediate",
     "--nan_inf_until_step", "300"],
    ["--skip_grad_norm"],
])
def test_replay_reproduces_the_training_log_end_to_end(tmp_path, flags):
    log_path = tmp_path / "gradient_logs+last.txt"
    skipped = write_training_log(log_path, flags, training_norms())
    out_path = tmp_path / "replay.csv"
    result = subprocess.run([sys.executable, "tools/replay_grad_guard.py", str(log_path), "--out", str(out_path),
                             *flags], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    logged, replayed = read_csv(log_path), read_csv(out_path)
    assert list(replayed[0]) == ["Step", "Gradient Norm", "Threshold", "ThreshOff", "Skipped"]
    assert len(replayed) == len(logged) == 520
    for log_row, replay_row in zip(logged, replayed):
        for column in ("Step", "Gradient Norm", "Threshold", "ThreshOff"):
            assert replay_row[column] == log_row[column], (column, log_row["Step"])
    assert [int(row["Step"]) for row in replayed if row["Skipped"] == "1"] == skipped
    assert {row["Skipped"] for row in replayed} == {"0", "1"}
    summary = result.stdout.strip().splitlines()
    assert len(summary) == 1 and summary[0].startswith(f"rows=520 skipped={len(skipped)} ")


def test_other_flags_change_the_replay(tmp_path):
    log_path = tmp_path / "g.txt"
    write_training_log(log_path, ["--grad_norm_log"], training_norms())
    out_path = tmp_path / "out.csv"
    replay_tool.main([str(log_path), "--out", str(out_path), "--grad_guard_preset", "stable",
                      "--skip_nan_immediate"])  # explicit flag beats the preset
    rows = read_csv(out_path)
    nan_rows = [row for row in rows if row["Gradient Norm"] == "nan"]
    assert nan_rows and all(row["Skipped"] == "1" for row in nan_rows)
    assert any(row["ThreshOff"] == "1" and row["Threshold"] == "" for row in rows)  # inf entered the window


def test_summary_notes_when_skipping_is_off(tmp_path, capsys):
    log_path = tmp_path / "g.txt"
    log_path.write_text("Step,Gradient Norm\n1,1.5\n2,nan\n3,inf\n", encoding="utf-8")
    replay_tool.main([str(log_path), "--out", str(tmp_path / "o.csv")])
    output = capsys.readouterr().out
    assert output.startswith("rows=3 skipped=0 ") and "no --skip_grad_norm" in output
    assert (tmp_path / "o.csv").read_text().splitlines()[1:] == ["1,1.5,200000.0,0,0", "2,nan,200000.0,0,0",
                                                                 "3,inf,200000.0,0,0"]


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"),
    ("Epoch,Step,Loss\n1,1,0.5\n", "missing column(s) Gradient Norm"),
    ("Step,Gradient Norm\n1,abc\n", ":2: Step/Gradient Norm must be numbers"),
    ("", "missing column(s)"),
])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, content, message):
    log_path = tmp_path / "g.txt"
    if content is not None:
        log_path.write_text(content, encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        exit_on_user_error(lambda: replay_tool.main([str(log_path), "--out", str(tmp_path / "o.csv")]))
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith("error: ") and message in error


def test_bad_flag_value_from_the_command_line(tmp_path):
    log_path = tmp_path / "g.txt"
    log_path.write_text("Step,Gradient Norm\n1,1.5\n", encoding="utf-8")
    result = subprocess.run([sys.executable, str(TOOL), str(log_path), "--out", str(tmp_path / "o.csv"),
                             "--idle_free_len", "-1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == ["error: --idle_free_len must be a whole number of optimizer "
                                                  "steps >= 1 (got -1)"]


def write_fork_layout_log(global_log: Path, path: Path, rows_per_epoch: int) -> None:
    """The same rows as the original --skip_grad_norm fork writes them: Epoch 0-based, Step the
    0-based batch index within the epoch, a NaN threshold written as ``nan``, no resume."""
    rows = read_csv(global_log)
    with open(path, "w", encoding="utf-8", newline="") as file:
        file.write(",".join(rows[0]) + "\n")
        for index, row in enumerate(rows):
            row.update(Epoch=str(index // rows_per_epoch), Step=str(index % rows_per_epoch),
                       Threshold=row["Threshold"] or "nan", ThreshOff=str(min(int(row["ThreshOff"]), 1)))
            file.write(",".join(row.values()) + "\n")


@pytest.mark.parametrize("flags", [
    ["--skip_grad_norm", "--nan_to_window", "--no-skip_nan_immediate", "--nan_inf_until_step", "300"],
    ["--grad_guard_preset", "stable", "--auto_cap_release", "--idle_free_phase", "--idle_max_steps", "60",
     "--idle_free_len", "15", "--nan_inf_until_step", "250"],
])
def test_fork_layout_log_replays_as_global_steps(tmp_path, capsys, flags):
    """A log of the original fork (Step restarts every epoch, Epoch from 0) replays exactly like the same
    rows in our global-step layout, including a --nan_inf_until_step in its 2nd epoch."""
    global_log, fork_log = tmp_path / "global.txt", tmp_path / "fork.txt"
    write_training_log(global_log, ["--grad_norm_log"], training_norms())
    write_fork_layout_log(global_log, fork_log, rows_per_epoch=200)
    assert read_csv(fork_log)[200]["Step"] == "0" and read_csv(fork_log)[200]["Epoch"] == "1"

    replay_tool.main([str(global_log), "--out", str(tmp_path / "global.csv"), *flags])
    global_output = capsys.readouterr()
    replay_tool.main([str(fork_log), "--out", str(tmp_path / "fork.csv"), *flags])
    fork_output = capsys.readouterr()

    assert (tmp_path / "fork.csv").read_text() == (tmp_path / "global.csv").read_text()
    assert fork_output.err == global_output.err and "reached at step " in fork_output.err  # the switch line
    note, summary = fork_output.out.splitlines()
    assert summary == global_output.out.strip()
    assert note.startswith(f"{fork_log}: ") and "fork" in note and "global steps 1..520" in note
    replayed = read_csv(tmp_path / "fork.csv")
    assert [row["Step"] for row in replayed] == [str(step) for step in range(1, 521)]
    if "300" in flags:  # NaN at step 261 enters the window; the one at step 401 is skipped after the switch
        assert (replayed[260]["Gradient Norm"], replayed[260]["Skipped"]) == ("nan", "0")
        assert (replayed[400]["Gradient Norm"], replayed[400]["Skipped"]) == ("nan", "1")
    else:
        assert {row["ThreshOff"] for row in replayed} == {"0", "1", "2"}


@pytest.mark.parametrize("steps, epochs, fork", [
    ([1, 2, 3], [1, 1, 2], False),
    ([501, 502, 503], [3, 3, 3], False),  # our log of a run started with --initial_step
    ([1, 2, 3], None, False),
    ([0, 1, 2], [0, 0, 0], True),  # the fork, one epoch
    ([5, 6, 0, 1], [2, 2, 3, 3], True),  # the fork, resumed mid-epoch: Step restarts
    ([1, 2, 3], [0, 0, 0], True),
    ([1, 1, 2], None, True),
])
def test_layout_detection(steps, epochs, fork):
    assert is_fork_layout(steps, epochs) is fork


def fork_log_text(norms: list[float], rows_per_epoch: int) -> str:
    """A log as the original fork writes it: a row per micro-batch, Epoch 0-based, Step the batch index
    within the epoch, the warm-up threshold 200000."""
    lines = ["Epoch,Step,Gradient Norm,Threshold,Loss,ThreshOff"]
    for row, norm in enumerate(norms):
        epoch, step = divmod(row, rows_per_epoch)
        lines.append(f"{epoch},{step},{norm},200000,0.1,0")
    return "\n".join(lines) + "\n"


# What the fork's own code decided on these rows (its guard and loop, run by a harness outside the project):
# NaN norms enter the window unskipped until --nan_inf_until_step 3 switches, after the row that completes
# the fork's 3rd optimizer step: its global step counts accumulation windows (each epoch's last row ends
# one too, as accelerate syncs there) from the step its run started at.
@pytest.mark.parametrize("accumulation, initial_step, rows_per_epoch, nan_rows, switch_row, fork_skipped", [
    (2, 0, 12, [4, 6, 7, 9], 6, [7, 9]),  # the log alone: switch after row 3, rows 4 and 6 skipped
    (1, 2, 8, [1, 2, 3, 4], 1, [2, 3, 4]),  # from --initial_step 2: after row 1, not 3
    (3, 0, 5, [5, 6, 7, 8, 9], 8, [9]),  # epochs of 5 micro-batches: windows of 3 and 2 rows
])
def test_fork_log_of_an_accumulation_or_initial_step_run_replays_as_the_fork_decided(
        tmp_path, capsys, accumulation, initial_step, rows_per_epoch, nan_rows, switch_row, fork_skipped):
    norms = [math.nan if row in nan_rows else 1.0 + 0.01 * (row % 7) for row in range(1, 13)]
    log_path = tmp_path / "gradient_logs+fork.txt"
    log_path.write_text(fork_log_text(norms, rows_per_epoch), encoding="utf-8")
    flags = ["--skip_grad_norm", "--nan_to_window", "--no-skip_nan_immediate", "--nan_inf_until_step", "3"]
    replay_tool.main([str(log_path), "--out", str(tmp_path / "o.csv"), *flags,
                      "--gradient_accumulation_steps", str(accumulation), "--initial_step", str(initial_step)])
    output = capsys.readouterr()
    replayed = read_csv(tmp_path / "o.csv")
    assert [index for index, row in enumerate(replayed, 1) if row["Skipped"] == "1"] == fork_skipped
    note = output.out.splitlines()[0]
    assert f"--gradient_accumulation_steps {accumulation} --initial_step {initial_step}" in note
    assert "--nan_inf_until_step switches" in note
    assert output.err.strip() == (f"gradient guard: --nan_inf_until_step 3 reached after row {switch_row} of the "
                                  f"fork's log: NaN/Inf norms are now kept out of the window and skipped immediately")
