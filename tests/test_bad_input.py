"""A user's mistake gives one clear line naming the flag or file, exit code 2, and touches no output."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import model_args, run_trainer

from library.errors import exit_on_user_error

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture()
def output_dir(tmp_path: Path) -> Path:
    """An output folder that already holds a LoRA from an earlier run."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "last.safetensors").write_bytes(b"earlier run")
    return folder


def run_expecting_user_error(capsys, argv: list[str], output_dir: Path) -> str:
    with pytest.raises(SystemExit) as exited:
        exit_on_user_error(lambda: run_trainer("sdxl_train_network", argv))
    assert exited.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
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
