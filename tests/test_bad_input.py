"""A user's mistake gives one clear line naming the flag or file, exit code 2, and touches no output."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import model_args, train_expecting_user_error
from PIL import Image
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture()
def output_dir(tmp_path: Path) -> Path:
    """An output folder that already holds a LoRA from an earlier run."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "last.safetensors").write_bytes(b"earlier run")
    return folder


def run_expecting_user_error(capsys, argv: list[str], output_dir: Path) -> str:
    message = train_expecting_user_error(argv, capsys)
    assert message.startswith("error: ")
    assert (output_dir / "last.safetensors").read_bytes() == b"earlier run"
    assert sorted(os.listdir(output_dir)) == ["last.safetensors"]
    return message


def base_args(tiny_models, dataset: Path, output_dir: Path) -> list[str]:
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--max_train_steps", "2", "--max_data_loader_n_workers", "0",
    ]


def replace_flag(argv: list[str], flag: str, value: str) -> list[str]:
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


def test_missing_model_path(tiny_models, demo_dataset, output_dir, capsys, tmp_path):
    argv = replace_flag(base_args(tiny_models, demo_dataset, output_dir), "--pretrained_model_name_or_path",
                        str(tmp_path / "nowhere.safetensors"))
    assert "nowhere.safetensors" in run_expecting_user_error(capsys, argv, output_dir)


def test_truncated_safetensors(tiny_models, demo_dataset, output_dir, capsys, tmp_path):
    truncated = tmp_path / "truncated.safetensors"
    data = Path(tiny_models["sdxl_file"]).read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    argv = replace_flag(base_args(tiny_models, demo_dataset, output_dir), "--pretrained_model_name_or_path",
                        str(truncated))
    assert "truncated.safetensors" in run_expecting_user_error(capsys, argv, output_dir)


def test_dataset_folder_without_images(tiny_models, output_dir, capsys, tmp_path):
    empty = tmp_path / "empty"
    (empty / "10_thing").mkdir(parents=True)
    message = run_expecting_user_error(capsys, base_args(tiny_models, empty, output_dir), output_dir)
    assert "--train_data_dir" in message and "no images" in message


def test_unreadable_image(tiny_models, demo_dataset, output_dir, capsys, tmp_path):
    broken = tmp_path / "broken"
    (broken / "1_thing").mkdir(parents=True)
    (broken / "1_thing" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    message = run_expecting_user_error(capsys, base_args(tiny_models, broken, output_dir), output_dir)
    assert "bad.png" in message


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--optimizer_type", "NoSuchOptimizer", "--optimizer_type"),
        ("--lr_scheduler", "sometimes", "--lr_scheduler"),
        ("--network_dim", "0", "--network_dim"),
        ("--network_dim", "-4", "--network_dim"),
        ("--max_train_steps", "0", "--max_train_steps"),
        ("--learning_rate", "0", "--learning_rate"),
        ("--learning_rate", "-1e-4", "--learning_rate"),
        ("--resolution", "63", "--resolution"),
    ],
)
def test_bad_values(flag, value, expected, tiny_models, demo_dataset, output_dir, capsys):
    argv = base_args(tiny_models, demo_dataset, output_dir) + [flag, value]
    if flag in argv[:-2]:
        argv = replace_flag(argv[:-2], flag, value)
    assert expected in run_expecting_user_error(capsys, argv, output_dir)


def test_invalid_toml_config(tiny_models, demo_dataset, output_dir, capsys, tmp_path):
    config = tmp_path / "broken.toml"
    config.write_text("[model]\npretrained_model_name_or_path = 'unterminated\n")
    argv = base_args(tiny_models, demo_dataset, output_dir) + ["--config_file", str(config)]
    assert "broken.toml" in run_expecting_user_error(capsys, argv, output_dir)


def test_entry_script_prints_one_line_and_no_traceback(tiny_models, demo_dataset, output_dir):
    """The real command line: exit code 2, one line on stderr, no traceback."""
    argv = base_args(tiny_models, demo_dataset, output_dir) + ["--optimizer_type", "NoSuchOptimizer"]
    result = subprocess.run(
        [sys.executable, str(REPO / "sdxl_train_network.py"), *argv],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(error_lines) == 1 and "--optimizer_type" in error_lines[0]
    assert (output_dir / "last.safetensors").read_bytes() == b"earlier run"


# -- refused before the model is loaded ----------------------------------------------------------
def unloadable_model_args(tiny_models, tmp_path: Path) -> list[str]:
    """A model file that exists but fails as soon as it is loaded (a .ckpt is only read by the load):
    a refusal that names something else happened before the load."""
    junk = tmp_path / "unloadable.ckpt"
    junk.write_bytes(b"not a checkpoint")
    return ["--pretrained_model_name_or_path", str(junk), "--model_config_dir", str(tiny_models["sdxl_config"])]


def lora_file(path: Path, value: float = 0.0) -> Path:
    """A small kohya-named LoRA file whose up weight holds ``value``."""
    save_file({"lora_unet_x.lora_down.weight": torch.zeros(4, 8),
               "lora_unet_x.lora_up.weight": torch.full((8, 4), value),
               "lora_unet_x.alpha": torch.tensor(4.0)}, str(path))
    return path


def early_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    """(extra flags, text the one-line error must contain): each known from the arguments and files alone."""
    not_safetensors = tmp_path / "notes.safetensors"
    not_safetensors.write_text("just text")
    return [
        (["--network_alpha", "nan"], "--network_alpha nan must be a number >= 0"),
        (["--network_alpha", "-8"], "--network_alpha -8.0 must be a number >= 0"),
        (["--nan_inf_until_step", "0"], "--nan_inf_until_step must be a whole number of optimizer steps >= 1"),
        (["--skip_grad_norm", "--skip_grad_norm_max", "-5"], "--skip_grad_norm_max must be a positive gradient norm"),
        (["--network_weights", str(tmp_path / "missing.safetensors")], "--network_weights"),
        (["--network_weights", str(not_safetensors)], "not a readable safetensors file"),
        (["--network_weights", str(lora_file(tmp_path / "nan.safetensors", math.nan))],
         "lora_unet_x.lora_up.weight holds NaN/Inf"),
        (["--base_weights", str(lora_file(tmp_path / "inf.safetensors", math.inf))], "--base_weights"),
        (["--resume", str(tmp_path / "no-such-state")], "--resume"),
        (["--vae", str(tmp_path / "missing_vae.safetensors")], "--vae"),
        (["--optimizer_args", "betas=0.9"], "e.g. betas=0.9,0.999"),
        (["--optimizer_args", "weight_decy=0.1"], "AdamW rejected them"),
        (["--learning_rate", "3e38"], "--learning_rate 3e+38: AdamW's update overflows float32"),
        (["--mixed_precision", "fp16", "--full_fp16"], "eps 1e-08 is 0"),
        (["--lr_scheduler", "cosine", "--lr_warmup_steps", "50"], "--lr_warmup_steps 50 gives 50 steps"),
        (["--lr_scheduler", "cosine_with_min_lr"], "needs --lr_scheduler_min_lr_ratio"),
        (["--min_timestep", "900", "--max_timestep", "100"], "--min_timestep 900 / --max_timestep 100"),
        (["--debug_inject_grad", "soon=nan"], "--debug_inject_grad soon=nan"),
        (["--output_name", "sub/lora", "--save_state_on_train_end"], "--output_name sub/lora: give a file name"),
    ]


def test_mistakes_are_refused_before_the_model_loads(tiny_models, demo_dataset, output_dir, capsys, tmp_path):
    argv = base_args(tiny_models, demo_dataset, output_dir)
    argv = unloadable_model_args(tiny_models, tmp_path) + argv[4:]  # base_args starts with the 4 model flags
    for flags, expected in early_cases(tmp_path):
        message = run_expecting_user_error(capsys, argv + flags, output_dir)
        assert expected in message, (flags, message)
    # the same run without a mistake gets as far as the model (so the cases above were refused before it)
    assert "unloadable.ckpt" in run_expecting_user_error(capsys, argv, output_dir)


def test_alpha_zero_means_rank_as_in_kohya(tiny_models, demo_dataset, output_dir, capsys, tmp_path):
    argv = unloadable_model_args(tiny_models, tmp_path) + base_args(tiny_models, demo_dataset, output_dir)[4:]
    assert "unloadable.ckpt" in run_expecting_user_error(capsys, argv + ["--network_alpha", "0"], output_dir)


# -- outputs that cannot be written: refused before anything runs, earlier files untouched ---------
def earlier_logs(output_dir: Path) -> dict[Path, bytes]:
    files = {output_dir / "gradient_logs+last.txt": b"Epoch,Step\n1,1\n", output_dir / "run.jsonl": b'{"step": 1}\n'}
    for path, data in files.items():
        path.write_bytes(data)
    return files


@pytest.mark.parametrize("flag, target", [
    ("--output_dir", "{file}/sub"),
    ("--logging_dir", "{file}"),
    ("--logging_dir", "{file}/runs"),
    ("--log_jsonl", "{file}/sub/run.jsonl"),
    ("--log_jsonl", "{folder}"),
    ("--grad_norm_log_dir", "{file}/logs"),
    ("--console_log_file", "{folder}"),
])
def test_unwritable_outputs_are_refused_up_front(flag, target, tiny_models, demo_dataset, output_dir, capsys,
                                                 tmp_path):
    """Tests run as root, where a read-only folder is still writable: a path under a regular file can
    never be created, whoever runs."""
    blocker = tmp_path / "a_file"
    blocker.write_bytes(b"keep me")
    files = earlier_logs(output_dir)
    target = target.format(file=blocker, folder=tmp_path)
    argv = base_args(tiny_models, demo_dataset, output_dir) + [
        "--grad_norm_log", "--log_jsonl", str(output_dir / "run.jsonl")]
    if flag in argv:
        argv = replace_flag(argv, flag, target)
    else:
        argv += [flag, target]
    message = train_expecting_user_error(argv, capsys)
    assert message.startswith(f"error: {flag} {target}: "), message
    assert blocker.read_bytes() == b"keep me"
    assert {path: path.read_bytes() for path in files} == files
    assert sorted(os.listdir(output_dir)) == sorted(["last.safetensors", *(path.name for path in files)])
    assert (output_dir / "last.safetensors").read_bytes() == b"earlier run"


def test_truncated_image_is_refused_before_training_and_logs_stay(tiny_models, output_dir, capsys, tmp_path):
    """A truncated PNG has an intact header; it used to fail at the step that loaded it, after the
    gradient log and the jsonl of the earlier run were replaced."""
    folder = tmp_path / "data" / "1_thing"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for index in range(3):
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(folder / f"{index}.png")
    truncated = (folder / "2.png").read_bytes()
    (folder / "2.png").write_bytes(truncated[: len(truncated) * 2 // 3])
    files = earlier_logs(output_dir)
    argv = base_args(tiny_models, tmp_path / "data", output_dir) + [
        "--grad_norm_log", "--log_jsonl", str(output_dir / "run.jsonl")]
    message = train_expecting_user_error(argv, capsys)
    assert "2.png" in message and "truncated" in message and "--skip_bad_images" in message
    assert {path: path.read_bytes() for path in files} == files
    assert (output_dir / "last.safetensors").read_bytes() == b"earlier run"


def test_ctrl_c_while_the_model_is_read_is_one_line(tiny_models, demo_dataset, output_dir, tmp_path):
    """The model folder's model_index.json is a FIFO nobody writes to: the run blocks reading the
    model, exactly where Ctrl-C interrupts it, without a timing guess."""
    model = tmp_path / "model"
    model.mkdir()
    os.mkfifo(model / "model_index.json")
    argv = ["--pretrained_model_name_or_path", str(model)] + base_args(tiny_models, demo_dataset, output_dir)[4:]
    process = subprocess.Popen(
        [sys.executable, str(REPO / "sdxl_train_network.py"), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        # a shell's background job ignores SIGINT, and the child would inherit that
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    writer = None
    try:
        deadline = time.monotonic() + 120
        while writer is None:  # a non-blocking writer gets in once the run has opened the FIFO to read it
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            try:
                writer = os.open(model / "model_index.json", os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # ENXIO: no reader yet
                time.sleep(0.2)
        process.send_signal(signal.SIGINT)  # the run waits for model_index.json's first byte
        _, stderr = process.communicate(timeout=60)
    finally:
        process.kill()
        if writer is not None:
            os.close(writer)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1] == "interrupted (Ctrl-C)"
    assert sorted(os.listdir(output_dir)) == ["last.safetensors"]
    assert (output_dir / "last.safetensors").read_bytes() == b"earlier run"
