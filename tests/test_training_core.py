"""Every trainer on the training core (``library.training``) goes through the same loop events:
sample, validate, save, rewind, and kill -9 + ``--resume auto`` to the uninterrupted run's bytes.

A trainer is a model family + a trainable; each entry of ``TRAINERS`` names its entry script and
its own options, and every test here runs for each entry (a full fine-tuner adds one)."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, SCRIPT_ENV, full_matrix, model_args, run_trainer_output, run_training_process

import library.training.trainer
import fine_tune
import sdxl_train
import sdxl_train_leco
import sdxl_train_network
import train_db
import train_leco
import train_network
from library.trainables.base import Trainable


@dataclass(frozen=True)
class TrainerUnderTest:
    script: str  # the entry script, run as the GUI runs it
    model: str  # the tiny model it trains on (conftest's ``tiny_models`` key)
    options: tuple[str, ...]  # what it trains, and how (its own options)
    final_file: str  # the file a finished run writes into --output_dir (--output_name core)


TRAINERS = {
    "lora-sdxl": TrainerUnderTest("sdxl_train_network.py", "sdxl", (
        "--network_dim", "4", "--network_alpha", "4", "--network_args", "conv_dim=4", "conv_alpha=4"),
        "core.safetensors"),
    "lora-sd15": TrainerUnderTest("train_network.py", "sd15", (
        "--network_dim", "4", "--network_alpha", "4", "--network_args", "conv_dim=4", "conv_alpha=4",
        "--network_train_unet_only"), "core.safetensors"),
    "full-sdxl": TrainerUnderTest("sdxl_train.py", "sdxl", ("--save_model_as", "safetensors"), "core.safetensors"),
    # the loop's other step path: the update applied during the backward (library/training/gradient_step.py)
    "full-sdxl-fused": TrainerUnderTest("sdxl_train.py", "sdxl", (
        "--save_model_as", "safetensors", "--fused_optimizer_groups", "3"), "core.safetensors"),
}
# LECO (train_leco.py, sdxl_train_leco.py) has no images: no validation split and no sample of a dataset's
# prompts; it is in ``entry_trainers`` (the core, every hook), and its kill -9 + --resume auto to the same
# bytes and its end line are tested in test_leco.py.
# A learning rate this high makes the tiny models' fp16 training diverge within a few steps, so the
# self-healing rewinds (the healing tests rely on the same); the other events come at fixed steps.
EVENTS = ("--mixed_precision", "fp16", "--grad_guard_preset", "stable", "--learning_rate", "1",
          "--max_train_steps", "8", "--save_state", "--save_every_n_steps", "1", "--rewind_every_n_steps", "2",
          "--validation_split", "0.25", "--validate_every_n_steps", "4", "--sample_every_n_steps", "4",
          "--optimizer_type", "AdamW")
KEPT = ("gradient_logs+core.txt", "healing_log+core.txt")  # with the final file: what the run leaves


def entry_trainers() -> list[library.training.trainer.Trainer]:
    return [train_network.NetworkTrainer(), sdxl_train_network.SdxlNetworkTrainer(), sdxl_train.FullModelTrainer(),
            train_db.trainer(), fine_tune.trainer(), train_leco.LecoTrainer(), sdxl_train_leco.SdxlLecoTrainer()]


def test_the_entry_scripts_are_the_core_with_a_family_and_a_trainable():
    for trainer in entry_trainers():
        assert isinstance(trainer, library.training.trainer.Trainer)
        assert type(trainer).train is library.training.trainer.Trainer.train  # no copy of the loop
    assert sdxl_train_network.SdxlNetworkTrainer().is_sdxl and not train_network.NetworkTrainer().is_sdxl
    assert sdxl_train.FullModelTrainer().is_sdxl and not train_db.trainer().is_sdxl


def test_every_trainable_has_every_hook_the_core_calls():
    """The hooks a trainable must answer are abstract in ``Trainable``: an entry trainer's trainable was
    created, so it has them all; the optional ones have the base class's defaults."""
    assert {"attach", "param_groups", "writer", "weights_finite"} <= Trainable.__abstractmethods__
    with pytest.raises(TypeError, match="abstract"):
        type("Incomplete", (Trainable,), {})()
    for trainer in entry_trainers():
        assert isinstance(trainer.trainable, Trainable)
        assert isinstance(trainer.trainable.kind, str) and hasattr(trainer.trainable, "module")


def run_script(script: str, argv: list[str], expect: int | None = 0) -> subprocess.CompletedProcess:
    """``script`` in a subprocess of its own file (test_fused_training and test_healthy_point use it)."""
    result = subprocess.run([sys.executable, str(REPO / script), *argv], cwd=REPO, env=SCRIPT_ENV,
                            capture_output=True, text=True, timeout=600)
    if expect is not None:
        assert result.returncode == expect, (result.stdout + result.stderr)[-3000:]
    return result


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from tools.make_demo_dataset import make_demo_dataset

    root = tmp_path_factory.mktemp("core_dataset")
    make_demo_dataset(str(root), count=8, size=64, repeats=1)
    return root


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("core_prompts") / "prompts.txt"
    path.write_text("a red circle --w 64 --h 64 --s 2 --d 5\n")
    return path


def events_argv(name: str, tiny_models, dataset: Path, prompts: Path, output_dir: Path) -> list[str]:
    trainer = TRAINERS[name]
    return model_args(tiny_models, trainer.model) + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", "core", "--seed", "42", "--max_data_loader_n_workers", "0",
        "--sample_prompts", str(prompts), *EVENTS, *trainer.options]


@pytest.fixture(scope="module")
def uninterrupted(tiny_models, dataset, prompts, tmp_path_factory):
    """name -> (output folder, stdout, rewind steps) of each trainer's uninterrupted run."""
    runs = {}

    def get(name: str) -> tuple[Path, str, list[int]]:
        if name not in runs:
            output_dir = tmp_path_factory.mktemp(f"core_{name}")
            # in this process (saves a process start); the killed run's resume is compared with its bytes
            stdout = run_trainer_output(Path(TRAINERS[name].script).stem,
                                        events_argv(name, tiny_models, dataset, prompts, output_dir))
            rewinds = [int(step) for step in re.findall(r"^step (\d+): .*rewound to the healthy point", stdout, re.M)]
            runs[name] = output_dir, stdout, rewinds
        return runs[name]
    return get


# The SD 1.5 LoRA trainer is the SDXL one with another family, whose sampling (test_sampling), validation
# (test_validation) and training (test_training) are tested on SD 1.5 elsewhere: its events run with --full_matrix.
EVENTS_IN_FULL_MATRIX_ONLY = ("lora-sd15",)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in TRAINERS if full_matrix() or name not in EVENTS_IN_FULL_MATRIX_ONLY])
def test_every_loop_event_happens(name, uninterrupted):
    output_dir, stdout, rewinds = uninterrupted(name)
    assert rewinds, stdout[-3000:]  # rewind: the run diverged and went back to a healthy point
    assert "rewind" in (output_dir / "healing_log+core.txt").read_text()
    assert re.search(r"^validation loss after step 4: ", stdout, re.M)  # validate
    assert re.search(r"^validation loss after step 8: ", stdout, re.M)
    assert len(list((output_dir / "sample").glob("core_000004_*.png"))) == 1  # sample
    assert len(list((output_dir / "sample").glob("core_000008_*.png"))) == 1
    assert (output_dir / TRAINERS[name].final_file).stat().st_size > 0  # save: the final file and state
    assert (output_dir / "core-state").is_dir() and (output_dir / "core-step00000008-state").is_dir()
    end_lines = re.findall(r"^(?:done|failed): .*$", stdout, re.M)  # the output: stdout, then the progress bar's
    assert len(end_lines) == 1 and end_lines[0].startswith("done: 8 steps"), stdout[-3000:]


# The LoRA trainers' kill -9 + --resume auto is also tested in test_resume.py (every state part, both models);
# here CI kills the full fine-tuner (the trainable whose state is a whole model), --full_matrix every trainer.
KILLED_IN_CI = ("full-sdxl",)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name in TRAINERS if full_matrix() or name in KILLED_IN_CI])
def test_killed_at_the_rewind_then_resumed_gives_the_uninterrupted_bytes(name, uninterrupted, tiny_models, dataset,
                                                                         prompts, tmp_path):
    reference, _, rewinds = uninterrupted(name)
    kill_at = rewinds[0]  # a state is written every step: dying while writing state K kills at step K
    argv = events_argv(name, tiny_models, dataset, prompts, tmp_path)
    # in a process of its own (a fork of this one: no imports to wait for)
    killed = run_training_process(Path(TRAINERS[name].script).stem,
                                  argv + ["--debug_kill_in_state_write", str(kill_at)])
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    resumed = run_trainer_output(Path(TRAINERS[name].script).stem, argv + ["--resume", "auto"])  # no process needed
    assert f"resumed at step {kill_at - 1} " in resumed
    for file_name in (TRAINERS[name].final_file, *KEPT):
        assert (tmp_path / file_name).read_bytes() == (reference / file_name).read_bytes(), file_name
