"""Kill -9 and resume: the resumed run is the run that would have happened, to the byte."""
from __future__ import annotations

import json
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import conftest
from conftest import model_args, run_trainer
from PIL import Image

from library.errors import exit_on_user_error


@pytest.fixture(scope="module")
def bucketed_dataset(tmp_path_factory) -> Path:
    """Images of three aspect ratios (three buckets) with comma-separated captions to shuffle."""
    root = tmp_path_factory.mktemp("bucketed")
    folder = root / "2_thing"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for index, (width, height) in enumerate([(64, 96), (96, 64), (80, 80), (64, 96), (96, 64), (80, 80)]):
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / f"{index}.png")
        (folder / f"{index}.txt").write_text(f"thing, colour {index}, texture, noise, sample {index % 3}")
    return root


def resume_args(tiny_models, dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    """8 steps of 2 batches of 1: an epoch (6 images x 2 repeats) is 6 steps, so a resume from the step-4 state
    crosses the epoch's end, and one from the step-6 state starts the second epoch."""
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--enable_bucket", "--min_bucket_reso", "64", "--max_bucket_reso", "128", "--bucket_reso_steps", "32",
        "--shuffle_caption", "--output_dir", str(output_dir), "--output_name", "run", "--seed", "5",
        "--max_data_loader_n_workers", "0", "--network_dim", "4", "--learning_rate", "1e-3",
        "--mixed_precision", "fp16", "--grad_guard_preset", "stable", "--gradient_accumulation_steps", "2",
        "--max_train_steps", "8", "--save_state", "--save_every_n_steps", "2", "--network_train_unet_only",
        # dropout draws from the global torch RNG: a resume must continue its stream exactly
        "--network_dropout", "0.1", "--network_args", "rank_dropout=0.1", "module_dropout=0.1",
        *extra,
    ]


def launch(argv: list[str]):
    """The training in a process of its own, to kill or interrupt (a fork of this one: no imports to wait for)."""
    return conftest.start_training_process("sdxl_train_network", argv)


def run_to_end(argv: list[str]) -> str:
    """A run that is not killed, in this process (a resume reads only the files: it needs no process of its own)."""
    output = conftest.run_trainer_output("sdxl_train_network", argv)
    assert f"on {conftest.DEVICE}" in output  # trained on the device under test
    return output


@pytest.fixture(scope="module")
def uninterrupted(tiny_models, bucketed_dataset, tmp_path_factory) -> Path:
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    run_to_end(resume_args(tiny_models, bucketed_dataset, output_dir))
    return output_dir


def assert_same_run(reference: Path, resumed: Path) -> None:
    assert (resumed / "run.safetensors").read_bytes() == (reference / "run.safetensors").read_bytes()
    assert (resumed / "gradient_logs+run.txt").read_text() == (reference / "gradient_logs+run.txt").read_text()


# Each seed kills at another moment (0.3-2 s into the training); CI runs one (with the kill in a state write below,
# two kill points), --full_matrix all three.
RANDOM_KILL_SEEDS = [0, 1, 2] if conftest.full_matrix() else [0]


@pytest.mark.device
@pytest.mark.parametrize("seed", RANDOM_KILL_SEEDS)
def test_sigkill_at_a_random_moment_then_resume_auto_gives_identical_bytes(
    seed, tiny_models, bucketed_dataset, uninterrupted, tmp_path
):
    output_dir = tmp_path / "run"
    argv = resume_args(tiny_models, bucketed_dataset, output_dir)
    process = launch(argv)
    for line in process.stdout:
        if "training:" in line:
            break
    time.sleep(random.Random(seed).uniform(0.3, 2.0))
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    output = run_to_end(argv + ["--resume", "auto"])
    assert "--resume auto:" in output
    assert_same_run(uninterrupted, output_dir)


@pytest.mark.device
def test_killed_during_a_state_write_resumes_from_the_previous_state(
    tiny_models, bucketed_dataset, uninterrupted, tmp_path
):
    output_dir = tmp_path / "run"
    argv = resume_args(tiny_models, bucketed_dataset, output_dir)
    process = launch(argv + ["--debug_kill_in_state_write", "3"])  # dies writing the step-6 state
    process.communicate(timeout=300)
    assert process.returncode == -signal.SIGKILL
    assert json.loads((output_dir / "run-state.json").read_text())["state"] == "run-step00000004-state"
    output = run_to_end(argv + ["--resume", "auto"])
    assert "resuming from" in output and "run-step00000004-state" in output
    assert not any(path.name.startswith(".run") for path in output_dir.iterdir())  # partial write cleaned up
    assert_same_run(uninterrupted, output_dir)


def test_damaged_newest_state_falls_back_to_the_previous_one(uninterrupted, tiny_models, bucketed_dataset, tmp_path):
    output_dir = tmp_path / "run"
    shutil.copytree(uninterrupted, output_dir)
    # the newest two: the state at the end (--save_state, as kohya) and the step-8 one, both damaged
    for newest in (output_dir / "run-state", output_dir / "run-step00000008-state"):
        lora_file = newest / "lora.safetensors"
        lora_file.write_bytes(lora_file.read_bytes()[:100])  # truncated
    (output_dir / "run.safetensors").unlink()
    output = run_to_end(resume_args(tiny_models, bucketed_dataset, output_dir, "--resume", "auto"))
    assert "run-step00000008-state" in output and "checksum mismatch" in output
    assert "resuming from" in output and "run-step00000006-state" in output
    assert (output_dir / "run.safetensors").read_bytes() == (uninterrupted / "run.safetensors").read_bytes()


def test_states_are_rotated_and_complete(tiny_models, demo_dataset, tmp_path):
    output_dir = tmp_path / "out"
    run_trainer(
        "sdxl_train_network",
        model_args(tiny_models, "sdxl") + [
            "--train_data_dir", str(demo_dataset), "--caption_extension", ".txt", "--resolution", "64",
            "--output_dir", str(output_dir), "--max_data_loader_n_workers", "0", "--network_train_unet_only",
            "--max_train_steps", "8", "--save_state", "--save_every_n_steps", "2", "--save_last_n_steps_state", "2",
            "--save_state_on_train_end", "--seed", "1",
        ],
    )
    states = sorted(path.name for path in output_dir.iterdir() if path.name.endswith("-state"))
    # kohya's rule: after step 8 the state of step 8 - 2 - 1 rounded down to 4 goes; 6 and 8 stay
    # (tests/test_rotation.py has the whole table), plus the end-of-training state
    assert states == ["last-state", "last-step00000006-state", "last-step00000008-state"]
    from library.train_state import verify_state

    assert all(verify_state(output_dir / name) == (True, "intact") for name in states)
    manifest = json.loads((output_dir / "last-step00000008-state" / "manifest.json").read_text())
    assert manifest["arguments"]["world_size"] == 1 and manifest["global_step"] == 8
    assert set(manifest["files"]) == {"components.pt", "lora.safetensors", "progress.json", "rng.pt"}


@pytest.fixture(scope="module")
def finished_run(tiny_models, demo_dataset, tmp_path_factory) -> Path:
    output_dir = tmp_path_factory.mktemp("finished")
    run_trainer(
        "sdxl_train_network",
        model_args(tiny_models, "sdxl") + [
            "--train_data_dir", str(demo_dataset), "--caption_extension", ".txt", "--resolution", "64",
            "--output_dir", str(output_dir), "--max_data_loader_n_workers", "0", "--network_train_unet_only",
            "--max_train_steps", "2", "--save_state", "--save_every_n_steps", "2", "--seed", "1",
        ],
    )
    return output_dir


def refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        exit_on_user_error(lambda: run_trainer("sdxl_train_network", argv))
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def resume_from(tiny_models, demo_dataset, output_dir: Path, state: Path, *extra: str) -> list[str]:
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(demo_dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--max_data_loader_n_workers", "0", "--network_train_unet_only",
        "--max_train_steps", "4", "--seed", "1", "--resume", str(state), *extra,
    ]


def test_resume_refuses_a_changed_network_dim(finished_run, tiny_models, demo_dataset, tmp_path, capsys):
    state = finished_run / "last-step00000002-state"
    message = refused(capsys, resume_from(tiny_models, demo_dataset, tmp_path, state, "--network_dim", "8"))
    assert "network_dim" in message and "8" in message


def test_resume_refuses_a_damaged_or_incomplete_state(finished_run, tiny_models, demo_dataset, tmp_path, capsys):
    damaged = tmp_path / "damaged-state"
    shutil.copytree(finished_run / "last-step00000002-state", damaged)
    progress = damaged / "progress.json"
    progress.write_text(progress.read_text().replace('"global_step": 2', '"global_step": 3'))
    message = refused(capsys, resume_from(tiny_models, demo_dataset, tmp_path / "a", damaged))
    assert "checksum mismatch in progress.json" in message
    missing = tmp_path / "missing-state"
    shutil.copytree(finished_run / "last-step00000002-state", missing)
    (missing / "rng.pt").unlink()
    message = refused(capsys, resume_from(tiny_models, demo_dataset, tmp_path / "b", missing))
    assert "missing rng.pt" in message


def test_sigint_finishes_the_step_saves_a_state_and_says_how_to_resume(tiny_models, demo_dataset, tmp_path):
    output_dir = tmp_path / "out"
    argv = model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(demo_dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--max_data_loader_n_workers", "0", "--network_train_unet_only",
        "--max_train_steps", "100000", "--save_state", "--grad_norm_log", "--seed", "1",
    ]
    process = launch(argv)
    for line in process.stdout:
        if "training:" in line:
            break
    time.sleep(2)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGINT
    assert "--resume auto" in output
    tracker = json.loads((output_dir / "last-state.json").read_text())
    rows = (output_dir / "gradient_logs+last.txt").read_text().strip().splitlines()[1:]
    assert tracker["global_step"] == len(rows) >= 1


def test_tensorboard_receives_the_step_scalars(tiny_models, demo_dataset, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logging_dir = tmp_path / "logs"
    run_trainer(
        "sdxl_train_network",
        model_args(tiny_models, "sdxl") + [
            "--train_data_dir", str(demo_dataset), "--caption_extension", ".txt", "--resolution", "64",
            "--output_dir", str(tmp_path / "out"), "--max_data_loader_n_workers", "0", "--network_train_unet_only",
            "--max_train_steps", "3", "--mixed_precision", "fp16", "--grad_guard_preset", "stable",
            "--logging_dir", str(logging_dir), "--log_with", "tensorboard", "--seed", "1",
            "--log_jsonl", str(tmp_path / "steps.jsonl"),
        ],
    )
    event_files = list(logging_dir.rglob("events.out.tfevents.*"))
    assert event_files
    scalars = set()
    for event_file in event_files:
        accumulator = EventAccumulator(str(event_file))
        accumulator.Reload()
        scalars |= set(accumulator.Tags()["scalars"])
    expected = {"loss/current", "loss/average", "train/skipped_steps", "train/grad_norm", "train/grad_threshold",
                "train/loss_scale", "train/grad_cosine", "lr/group0"}
    assert expected <= scalars
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert expected <= set(lines[0])
