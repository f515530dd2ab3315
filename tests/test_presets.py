"""examples/presets: the .sh and .bat files parse with the SDXL trainer's own parser and resolve
the gradient-guard flags to their preset (the way the trainer resolves them)."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

import sdxl_train_network
from library import config_file, grad_guard

PRESETS_DIR = Path(__file__).resolve().parent.parent / "examples" / "presets"
GUARD_DEFAULTS = {  # every guard dest a preset may touch, at its parser default
    "skip_grad_norm": False, "grad_norm_log": False, "grad_cosine_log": False, "skip_grad_norm_max": None,
    "nan_to_window": False, "inf_to_window": False, "skip_nan_immediate": True, "skip_inf_immediate": True,
    "nan_inf_until_step": None, "auto_cap_release": False, "idle_free_phase": False, "grad_norm_unscaled": False,
}


def sh_arguments(text: str) -> list[str]:
    """Arguments of the ``sdxl_train_network.py`` call in a bash script (backslash continuations,
    ``VAR=value`` assignments substituted)."""
    text = text.replace("\\\n", " ")
    variables: dict[str, str] = {}
    for line in text.splitlines():
        assignment = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", line.strip())
        if assignment:
            variables[assignment.group(1)] = shlex.split(assignment.group(2))[0]
        elif "sdxl_train_network.py" in line:
            line = re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: variables[m.group(1)], line)
            words = shlex.split(line)
            return words[words.index(next(w for w in words if w.endswith("sdxl_train_network.py"))) + 1:]
    raise AssertionError("no sdxl_train_network.py call")


def bat_arguments(text: str) -> list[str]:
    """Arguments of the ``sdxl_train_network.py`` call in a Windows batch file (``^`` line
    continuations, ``set VAR=value`` lines, ``%VAR%`` references, cmd's double quotes)."""
    text = text.replace("\r\n", "\n")
    text = re.sub(r"\^\n", " ", text)
    variables: dict[str, str] = {}
    for line in text.splitlines():
        assignment = re.fullmatch(r"set ([A-Za-z_][A-Za-z0-9_]*)=(.*)", line.strip(), re.IGNORECASE)
        if assignment:
            variables[assignment.group(1).upper()] = assignment.group(2)
        elif "sdxl_train_network.py" in line:
            line = re.sub(r"%([A-Za-z_][A-Za-z0-9_]*)%", lambda m: variables[m.group(1).upper()], line)
            words = [word.strip('"') for word in re.findall(r'"[^"]*"|\S+', line)]
            return words[words.index("sdxl_train_network.py") + 1:]
    raise AssertionError("no sdxl_train_network.py call")


@pytest.mark.parametrize("preset", ["stable", "minimal"])
@pytest.mark.parametrize("suffix", [".sh", ".bat"])
def test_preset_file_resolves_to_the_preset(preset, suffix):
    path = PRESETS_DIR / f"sdxl_lora_{preset}{suffix}"
    text = path.read_bytes().decode("utf-8")
    if suffix == ".bat":
        assert "\r\n" in text  # cmd.exe needs CRLF line ends for ^ continuations to be reliable
        argv = bat_arguments(text)
    else:
        assert text.startswith("#!/usr/bin/env bash")
        argv = sh_arguments(text)
    parser = sdxl_train_network.setup_parser()
    args, explicit = config_file.parse_args(parser, argv)  # what the trainer's main() does
    grad_guard.apply_preset(args, explicit)
    expected = {**GUARD_DEFAULTS, **grad_guard.PRESETS[preset]}
    assert {dest: getattr(args, dest) for dest in expected} == expected
    assert args.mixed_precision == "fp16"
    assert args.output_name == "my_sdxl_lora" and args.network_dim == 16
    assert args.pretrained_model_name_or_path.replace("\\", "/") == "models/sd_xl_base_1.0.safetensors"
    config = grad_guard.GuardConfig.from_args(args)  # valid guard options
    assert config.skip_grad_norm


def test_sh_and_bat_pass_the_same_arguments():
    for preset in ("stable", "minimal"):
        sh = sh_arguments((PRESETS_DIR / f"sdxl_lora_{preset}.sh").read_text())
        bat = bat_arguments((PRESETS_DIR / f"sdxl_lora_{preset}.bat").read_bytes().decode())
        assert [word.replace("\\", "/") for word in bat] == sh


def test_explicit_flag_wins_over_the_preset():
    """A user editing the minimal preset's line to add a cap keeps the cap (command line wins)."""
    argv = sh_arguments((PRESETS_DIR / "sdxl_lora_minimal.sh").read_text()) + ["--skip_grad_norm_max", "5000",
                                                                              "--no-skip_nan_immediate"]
    parser = sdxl_train_network.setup_parser()
    args, explicit = config_file.parse_args(parser, argv)
    grad_guard.apply_preset(args, explicit)
    assert (args.skip_grad_norm, args.skip_grad_norm_max, args.skip_nan_immediate) == (True, 5000.0, False)
