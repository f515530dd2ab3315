"""The gradient guard inside real fp16 training of the tiny SDXL (spec: shared/docs/grad_guard_spec.md)."""
from __future__ import annotations

import csv
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState
from conftest import model_args, run_script_as_main, run_trainer

import sdxl_train_network
import train_network
from networks import lora

REPO = Path(__file__).resolve().parent.parent


def read_log(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def sdxl_args(tiny_models, dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--seed", "3", "--max_data_loader_n_workers", "0",
        "--network_train_unet_only", "--network_dim", "4", "--learning_rate", "1e-3", *extra,
    ]


class RecordingTrainer(sdxl_train_network.SdxlNetworkTrainer):
    """Records, for every real optimizer step, the LR-schedule position and the scale it ran with."""

    calls: list[tuple[int, float]] = []

    def optimizer_step(self, args, optimizer, lr_scheduler, scaler, trainable_params, loss) -> None:
        RecordingTrainer.calls.append((lr_scheduler.last_epoch, scaler.get_scale() if scaler else 1.0))
        super().optimizer_step(args, optimizer, lr_scheduler, scaler, trainable_params, loss)


def run_recording(argv: list[str]) -> list[tuple[int, float]]:
    RecordingTrainer.calls = []
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    train_network.main(RecordingTrainer, sdxl_train_network.setup_parser, argv)
    return RecordingTrainer.calls


def lora_tensors(path: Path) -> dict[str, torch.Tensor]:
    return lora.read_lora_file(str(path))


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a)


@pytest.mark.device
def test_immediate_skip_leaves_weights_optimizer_lr_and_scale_untouched(tiny_models, demo_dataset, tmp_path):
    out = tmp_path / "out"
    calls = run_recording(
        sdxl_args(
            tiny_models, demo_dataset, out, "--mixed_precision", "fp16", "--max_train_steps", "5",
            "--grad_guard_preset", "minimal", "--debug_inject_grad", "3=nan", "--save_every_n_steps", "1",
            "--lr_scheduler", "linear", "--save_precision", "float",
        )
    )
    rows = read_log(out / "gradient_logs+last.txt")
    assert [row["Step"] for row in rows] == ["1", "2", "3", "4", "5"]  # the global step still advances
    assert rows[2]["Gradient Norm"] == "nan"
    # the optimizer (and so the scaler's step/update and the LR schedule) ran for steps 1, 2, 4, 5 only
    assert [lr_position for lr_position, _ in calls] == [0, 1, 2, 3]
    assert {scale for _, scale in calls} == {65536.0}  # the scaler never saw the NaN
    assert {row["Scale"] for row in rows} == {"65536.0"}
    step2, step3, step4 = (lora_tensors(out / f"last-step{n:08d}.safetensors") for n in (2, 3, 4))
    assert same_tensors(step2, step3)
    assert not same_tensors(step3, step4)
    assert all(torch.isfinite(value).all() for value in step4.values())


@pytest.mark.device
def test_stable_preset_lets_the_scaler_back_off_on_nan(tiny_models, demo_dataset, tmp_path):
    """Stable preset: a NaN norm goes to the window and is not skipped (NaN > any threshold is False),
    so the GradScaler sees the overflow, skips its own step and halves the scale."""
    out = tmp_path / "out"
    calls = run_recording(
        sdxl_args(
            tiny_models, demo_dataset, out, "--mixed_precision", "fp16", "--max_train_steps", "5",
            "--grad_guard_preset", "stable", "--debug_inject_grad", "3=nan", "--lr_scheduler", "linear",
        )
    )
    rows = read_log(out / "gradient_logs+last.txt")
    assert [row["Scale"] for row in rows] == ["65536.0", "65536.0", "65536.0", "32768.0", "32768.0"]
    assert len(calls) == 5  # the guard skipped nothing; the scaler dropped step 3 itself
    assert [lr_position for lr_position, _ in calls] == [0, 1, 2, 2, 3]  # no LR step for the overflow
    assert "CosineSim" in rows[0]
    assert all(torch.isfinite(value).all() for value in lora_tensors(out / "last.safetensors").values())


@pytest.mark.device
def test_stable_preset_skips_an_inf_norm_during_warm_up(tiny_models, demo_dataset, tmp_path):
    """An Inf norm against the finite warm-up threshold (the preset's: 20 x the median finite norm so far) is
    skipped (spec decision rule 4)."""
    out = tmp_path / "out"
    calls = run_recording(
        sdxl_args(tiny_models, demo_dataset, out, "--mixed_precision", "fp16", "--max_train_steps", "4",
                  "--grad_guard_preset", "stable", "--debug_inject_grad", "2=inf")
    )
    rows = read_log(out / "gradient_logs+last.txt")
    assert rows[1]["Gradient Norm"] == "inf" and float(rows[1]["Threshold"]) == 20 * float(rows[0]["Gradient Norm"])
    assert len(calls) == 3
    assert {row["Scale"] for row in rows} == {"65536.0"}


def test_log_only_mode_changes_no_weight(tiny_models, demo_dataset, tmp_path):
    plain, logged = tmp_path / "plain", tmp_path / "logged"
    common = ("--mixed_precision", "fp16", "--max_train_steps", "4")
    run_trainer("sdxl_train_network", sdxl_args(tiny_models, demo_dataset, plain, *common))
    run_trainer("sdxl_train_network", sdxl_args(tiny_models, demo_dataset, logged, *common, "--grad_norm_log",
                                                "--grad_cosine_log"))
    assert same_tensors(lora_tensors(plain / "last.safetensors"), lora_tensors(logged / "last.safetensors"))
    rows = read_log(logged / "gradient_logs+last.txt")
    assert len(rows) == 4 and rows[0]["CosineSim"] == "nan" and rows[0]["ThreshOff"] == "0"


@pytest.mark.device
def test_cosine_column_matches_a_direct_computation(tiny_models, demo_dataset, tmp_path):
    """With SGD (no clipping) each step's update is -lr * gradient, so the saved LoRAs give the gradients."""
    out = tmp_path / "out"
    learning_rate = 1e-3
    run_trainer(
        "sdxl_train_network",
        sdxl_args(tiny_models, demo_dataset, out, "--max_train_steps", "3", "--optimizer_type", "torch.optim.SGD",
                  "--max_grad_norm", "0", "--save_every_n_steps", "1", "--grad_norm_log", "--grad_cosine_log",
                  "--learning_rate", str(learning_rate)),
    )
    rows = read_log(out / "gradient_logs+last.txt")
    saved = [lora_tensors(out / f"last-step{n:08d}.safetensors") for n in (1, 2, 3)]
    keys = sorted(k for k in saved[0] if not k.endswith("alpha"))

    def flat(tensors):
        return torch.cat([tensors[k].double().flatten() for k in keys])

    # step 1 updates only the up weights (down gradients are zero while up is zero), so take
    # gradients 2 and 3 from the differences of consecutive saves.
    grad2 = (flat(saved[0]) - flat(saved[1])) / learning_rate
    grad3 = (flat(saved[1]) - flat(saved[2])) / learning_rate
    direct = torch.nn.functional.cosine_similarity(grad2, grad3, dim=0).item()
    assert float(rows[2]["CosineSim"]) == pytest.approx(direct, abs=1e-3)
    assert float(rows[2]["Gradient Norm"]) == pytest.approx(grad3.norm().item(), rel=1e-3)


@pytest.mark.device
def test_replay_reproduces_the_training_decisions(tiny_models, one_image_dataset, tmp_path, capsys):
    """Past the 200-step warm-up, with a NaN in the window: the replay tool gives the training's
    own Threshold, ThreshOff and skip decisions."""
    out = tmp_path / "out"
    # fp32 without a scaler: the NaN step must be skipped immediately (the default), or it would
    # reach the weights; it still enters the window with --nan_to_window.
    guard_flags = ["--skip_grad_norm", "--grad_norm_log", "--nan_to_window", "--skip_grad_norm_max", "15"]
    run_trainer(
        "sdxl_train_network",
        sdxl_args(tiny_models, one_image_dataset, out, "--max_train_steps", "212", "--debug_inject_grad", "5=nan",
                  "--network_dim", "1", *guard_flags),
    )
    log = out / "gradient_logs+last.txt"
    replayed = tmp_path / "replayed.csv"
    result = run_script_as_main(  # the tool as its launch runs it, without a process start (its imports)
        [sys.executable, str(REPO / "tools" / "replay_grad_guard.py"), str(log), "--out", str(replayed), *guard_flags],
        REPO, expect=None)
    assert result.returncode == 0, result.stderr
    trained, replay = read_log(log), read_log(replayed)
    assert len(trained) == len(replay) == 212
    for row, again in zip(trained, replay):
        assert (row["Threshold"], row["ThreshOff"]) == (again["Threshold"], again["ThreshOff"])
    assert [row["ThreshOff"] for row in trained[199:205]] == ["1"] * 5 + ["0"]  # NaN leaves at step 205
    thresholds = [float(row["Threshold"]) for row in trained[205:]]
    skipped = [int(again["Skipped"]) for again in replay]
    expected = [float(row["Gradient Norm"]) > threshold for row, threshold in zip(trained[205:], thresholds)]
    assert skipped[205:] == [int(flag) for flag in expected]
    assert skipped[4] == 1 and sum(skipped[:205]) == 1
    assert f"skipped: guard {sum(skipped)}," in capsys.readouterr().out  # the training skipped the same steps


def test_gradient_log_survives_sigterm(tiny_models, demo_dataset, tmp_path):
    out = tmp_path / "out"
    argv = sdxl_args(tiny_models, demo_dataset, out, "--max_train_steps", "100000", "--grad_norm_log")
    process = subprocess.Popen(
        [sys.executable, str(REPO / "sdxl_train_network.py"), *argv], cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    deadline = time.time() + 120
    for line in process.stdout:  # wait until training is under way
        if "training:" in line or time.time() > deadline:
            break
    time.sleep(3)
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)
    assert process.returncode != 0
    rows = read_log(out / "gradient_logs+last.txt")
    assert len(rows) >= 1
    assert [int(row["Step"]) for row in rows] == list(range(1, len(rows) + 1))
    assert all(math.isfinite(float(row["Gradient Norm"])) for row in rows)


class FailingTrainer(sdxl_train_network.SdxlNetworkTrainer):
    """Raises inside the fifth optimizer step, like a crash in the middle of training."""

    def optimizer_step(self, args, optimizer, lr_scheduler, scaler, trainable_params, loss) -> None:
        if lr_scheduler.last_epoch == 4:
            raise RuntimeError("boom")
        super().optimizer_step(args, optimizer, lr_scheduler, scaler, trainable_params, loss)


def test_gradient_log_rows_survive_an_exception(tiny_models, demo_dataset, tmp_path):
    out = tmp_path / "out"
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    with pytest.raises(RuntimeError, match="boom"):
        train_network.main(FailingTrainer, sdxl_train_network.setup_parser,
                           sdxl_args(tiny_models, demo_dataset, out, "--max_train_steps", "50", "--grad_norm_log"))
    rows = read_log(out / "gradient_logs+last.txt")
    assert [row["Step"] for row in rows] == ["1", "2", "3", "4"]  # buffered rows were flushed on the way out
    assert not (out / "last.safetensors").exists()
