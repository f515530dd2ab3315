"""--config_file / --output_config: kohya's flattening and precedence, GUI quirks, checks, round trip."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from library import config_file, optimizers
from library.errors import UserError


def make_parser() -> argparse.ArgumentParser:
    """A trainer-like parser: the real config and optimizer options plus kohya-style others."""
    parser = argparse.ArgumentParser(prog="train_network.py")
    config_file.add_arguments(parser)
    optimizers.add_arguments(parser)
    parser.add_argument("--pretrained_model_name_or_path", type=str, default=None)
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--output_name", type=str, default=None)
    parser.add_argument("--network_dim", type=int, default=None)
    parser.add_argument("--network_alpha", type=float, default=1)
    parser.add_argument("--network_args", type=str, default=None, nargs="*")
    parser.add_argument("--max_token_length", type=int, default=None, choices=[None, 150, 225])
    parser.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--xformers", action="store_true")
    parser.add_argument("--cache_latents", action="store_true")
    parser.add_argument("--persistent_data_loader_workers", action="store_true")
    parser.add_argument("--grad_guard", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--wandb_api_key", type=str, default=None)
    return parser


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_sections_are_flattened_and_top_level_keys_kept(tmp_path):
    path = write(tmp_path / "run.toml", """
seed = 7
[model_arguments]
pretrained_model_name_or_path = "model.safetensors"
[optimizer_arguments]
learning_rate = 1e-4
optimizer_type = "AdamW"
optimizer_args = ["weight_decay=0.01", "betas=0.9,0.999"]
[training_arguments]
network_dim = 16
""")
    args, explicit = config_file.parse_args(make_parser(), ["--config_file", str(path)])
    assert args.seed == 7
    assert args.pretrained_model_name_or_path == "model.safetensors"
    assert args.learning_rate == 1e-4
    assert args.optimizer_args == ["weight_decay=0.01", "betas=0.9,0.999"]
    assert args.network_dim == 16
    assert explicit == {
        "config_file", "seed", "pretrained_model_name_or_path", "learning_rate",
        "optimizer_type", "optimizer_args", "network_dim",
    }


def test_command_line_wins_and_explicit_includes_both_sources(tmp_path):
    path = write(tmp_path / "run.toml", "learning_rate = 1e-4\nnetwork_dim = 16\nxformers = true\n")
    argv = ["--config_file", str(path), "--learning_rate", "5e-5", "--max_grad_norm", "1.0"]
    args, explicit = config_file.parse_args(make_parser(), argv)
    assert args.learning_rate == 5e-5  # the command line wins
    assert args.network_dim == 16 and args.xformers is True  # the file fills the rest
    assert args.lr_scheduler == "constant"  # untouched default
    # --max_grad_norm 1.0 equals the default but was given: it counts as explicit.
    assert explicit == {"config_file", "learning_rate", "max_grad_norm", "network_dim", "xformers"}


def test_explicit_without_config_file_counts_only_given_options():
    args, explicit = config_file.parse_args(make_parser(), ["--xformers", "--no-grad_guard", "--seed", "1"])
    assert explicit == {"xformers", "grad_guard", "seed"}
    assert args.grad_guard is False


def test_explicit_handles_abbreviations_and_accumulating_actions(tmp_path):
    parser = make_parser()
    parser.add_argument("--tag", action="append", default=None)
    parser.add_argument("--verbose", "-v", action="count", default=0)
    args, explicit = config_file.parse_args(parser, ["--learning", "1e-4", "--tag", "a", "--tag", "b", "-vv"])
    assert args.learning_rate == 1e-4 and args.tag == ["a", "b"] and args.verbose == 2
    assert explicit == {"learning_rate", "tag", "verbose"}
    path = write(tmp_path / "tags.toml", 'tag = ["x", "y"]\nverbose = 1\n')
    args, explicit = config_file.parse_args(parser, ["--config_file", str(path)])
    assert args.tag == ["x", "y"] and args.verbose == 1
    assert explicit == {"config_file", "tag", "verbose"}


def test_config_name_without_suffix_gets_toml_appended(tmp_path):
    write(tmp_path / "preset.toml", "seed = 3\n")
    args, _ = config_file.parse_args(make_parser(), ["--config_file", str(tmp_path / "preset")])
    assert args.seed == 3
    assert config_file.resolve_config_path(tmp_path / "preset") == tmp_path / "preset.toml"


def test_gui_style_file(tmp_path, caplog):
    # Flat keys as kohya_ss GUI writes them: empty strings for unset paths, false flags,
    # max_token_length = 75, ints for booleans, lists for nargs options, keys for other tools.
    path = write(tmp_path / "config_lora-20240101-120000.toml", r"""
cache_latents = true
epoch = 10
learning_rate = 0.0001
lr_scheduler = "cosine"
lr_scheduler_args = []
lr_warmup_steps = 0.1
max_grad_norm = 1
max_token_length = 75
network_alpha = 8
network_args = ["conv_dim=4", "conv_alpha=1"]
network_dim = 16.0
noise_offset_type = "Original"
optimizer_args = ["weight_decay=0.01"]
optimizer_type = "AdamW8bit"
output_dir = "D:\\xyz\\out"
output_name = ""
persistent_data_loader_workers = 1
pretrained_model_name_or_path = ""
xformers = false
grad_guard = false
""")
    with caplog.at_level(logging.WARNING, logger="library.config_file"):
        args, explicit = config_file.parse_args(make_parser(), ["--config_file", str(path)])
    assert args.output_dir == "D:\\xyz\\out"
    assert args.output_name is None and args.pretrained_model_name_or_path is None
    assert args.cache_latents is True and args.xformers is False
    assert args.persistent_data_loader_workers is True
    assert args.grad_guard is False  # BooleanOptionalAction: false is a value
    assert args.max_token_length is None  # 75 means the default
    assert args.network_dim == 16 and isinstance(args.network_dim, int)
    assert args.network_alpha == 8.0 and args.max_grad_norm == 1.0
    assert args.lr_warmup_steps == 0.1 and args.lr_scheduler_args is None
    assert args.network_args == ["conv_dim=4", "conv_alpha=1"]
    assert args.optimizer_type == "AdamW8bit"
    not_set = {"output_name", "pretrained_model_name_or_path", "xformers", "max_token_length", "lr_scheduler_args"}
    assert not (explicit & not_set)
    assert {"grad_guard", "cache_latents", "persistent_data_loader_workers", "network_dim"} <= explicit

    warnings = [record for record in caplog.records if record.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "\n" not in message and str(path) in message
    assert "epoch" in message and "noise_offset_type" in message


@pytest.mark.parametrize(
    "line, key, hint",
    [
        ('learning_rate = "fast"', "learning_rate", "not a number"),
        ("learning_rate = -1e-4", "learning_rate", ">= 0"),
        ("network_dim = 1.5", "network_dim", "int"),
        ("max_token_length = 100", "max_token_length", "150"),
        ('lr_scheduler = "Cosine"', "lr_scheduler", "cosine_with_restarts"),
        ("seed = true", "seed", "true/false"),
        ("seed = [1, 2]", "seed", "one value"),
        ('xformers = "yes"', "xformers", "true or false"),
        ("xformers = 2", "xformers", "true or false"),
        ("network_args = [[1]]", "network_args", "nested"),
    ],
)
def test_wrong_value_names_key_and_file(tmp_path, line, key, hint):
    path = write(tmp_path / "bad.toml", f"[section]\n{line}\n")
    with pytest.raises(UserError) as caught:
        config_file.parse_args(make_parser(), ["--config_file", str(path)])
    message = str(caught.value)
    assert str(path) in message and key in message and hint in message
    assert "\n" not in message


def test_invalid_toml_and_missing_file(tmp_path):
    path = write(tmp_path / "broken.toml", "learning_rate = [1,\n")
    with pytest.raises(UserError, match="broken.toml: not valid TOML"):
        config_file.parse_args(make_parser(), ["--config_file", str(path)])
    with pytest.raises(UserError, match="no such file"):
        config_file.parse_args(make_parser(), ["--config_file", str(tmp_path / "absent.toml")])


def test_command_line_errors_still_exit_through_argparse(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        config_file.parse_args(make_parser(), ["--learning_rate", "-1"])
    assert caught.value.code == 2
    assert "--learning_rate" in capsys.readouterr().err


ROUND_TRIP_ARGV = [
    "--pretrained_model_name_or_path", "C:\\models\\xl base.safetensors",
    "--output_dir", "D:\\xyz\\out \"quoted\"",
    "--output_name", "my_lora",
    "--network_dim", "32",
    "--network_alpha", "16",
    "--network_args", "conv_dim=4", "conv_alpha=1",
    "--optimizer_type", "Prodigy",
    "--optimizer_args", "weight_decay=0.01", "betas=0.9,0.999",
    "--learning_rate", "1e-4",
    "--max_grad_norm", "1.0",
    "--lr_scheduler", "cosine_with_restarts",
    "--lr_warmup_steps", "10%",
    "--lr_scheduler_num_cycles", "3",
    "--max_token_length", "225",
    "--mixed_precision", "bf16",
    "--xformers",
    "--no-grad_guard",
    "--seed", "0",
    "--wandb_api_key", "secret",
]


def test_output_config_round_trip(tmp_path, capsys):
    target = tmp_path / "saved"  # .toml is appended, like kohya
    parser = make_parser()
    original, original_explicit = config_file.parse_args(parser, ROUND_TRIP_ARGV)
    with pytest.raises(SystemExit) as caught:
        config_file.parse_args(parser, ROUND_TRIP_ARGV + ["--output_config", "--config_file", str(target)])
    assert caught.value.code == 0
    written = tmp_path / "saved.toml"
    assert written.is_file() and "secret" not in written.read_text(encoding="utf-8")
    assert not list(tmp_path.glob(".*tmp"))  # no temporary file left behind

    restored, restored_explicit = config_file.parse_args(make_parser(), ["--config_file", str(target)])
    expected = vars(original) | {"config_file": str(target), "wandb_api_key": None}
    assert vars(restored) == expected
    # The same options are explicit, so a preset applied afterwards behaves the same.
    assert restored_explicit == original_explicit - {"wandb_api_key"} | {"config_file"}

    with pytest.raises(UserError, match="already exists"):
        config_file.parse_args(parser, ["--output_config", "--config_file", str(target)])


def test_output_config_needs_config_file():
    with pytest.raises(UserError, match="--output_config needs --config_file"):
        config_file.parse_args(make_parser(), ["--output_config"])


def test_write_config_without_explicit_writes_non_defaults(tmp_path):
    parser = make_parser()
    args = parser.parse_args(["--seed", "5", "--max_grad_norm", "1.0", "--cache_latents"])
    path = config_file.write_config(args, parser, tmp_path / "out.toml")
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if not line.startswith("#")]
    assert lines == ["cache_latents = true", "seed = 5"]  # parser order, defaults left out
