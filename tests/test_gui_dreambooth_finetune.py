"""The kohya_ss GUI v26's Dreambooth and Finetuning tabs: every command they launch trains with this repository.

``data/gui_dreambooth_finetune.json`` holds what the GUI's own code wrote (recorded by the harness
/work/harness_ft_gui, ``drive_ft.py``: each tab built headless by its own module; every ``presets/finetune``
preset that targets SDXL or SD 1.5 applied with the GUI's preset loader, and the Dreambooth tab's defaults for
SDXL and SD 1.5, since ``presets/dreambooth`` holds only SD3 presets; model path = the tiny model folder, the
folders, output name, max resolution 128,128 and buckets 64..256 set; Start training clicked): the Finetuning
tab's preparation commands, the ``accelerate launch ... <script> --config_file <toml>`` command and the TOML,
machine paths replaced by placeholders. Each is replayed here: the preparation commands as the GUI runs them
(``subprocess.run`` with its PYTHONPATH: each script file as ``__main__`` with the GUI's argv and working folder), then
the training command through ``accelerate launch``'s own code (its parser and checks, the command and environment its
simple launcher builds). One launch, ``finetune_adafactor``'s refused one, starts the processes as the GUI does (the
launcher, then the script: accelerate turns the script's exit code 2 into its own 1); the others run the command the
launcher built in this process (a process start costs ~5-15 s of CPU for its imports alone; tests/test_finetune_prep.py
runs the preparation commands as processes).

What differs from the recording, and why: paths; ``max_train_steps`` 2 and ``max_train_epochs`` dropped (kohya
lets it override the steps; hundreds of epochs would not fit a test); the preset's own ``logging_dir``
(``/kohya_ss/output/...``, a folder of the preset author's machine) put under the output folder;
``--num_cpu_threads_per_process 1`` (conftest: more OpenMP threads only slow a shared CPU down).

The Finetuning presets "adafactor" and "lion" (SD 1.5) set ``bucket_reso_steps = 1.0``: kohya's ``fine_tune.py``
asserts that it divides by 64 (``verify_bucket_reso_steps(64)``) and stops; here the same rule is one line, exit 2,
before any model loads. They are replayed as written (refused) and with the GUI's default 64 (trained).
"""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import REPO, SCRIPT_ENV, run_script_as_main
from PIL import Image
from safetensors import safe_open

RECORDED = json.loads((Path(__file__).parent / "data" / "gui_dreambooth_finetune.json").read_text(encoding="utf-8"))
RUNS = RECORDED["runs"]
SIZES = {"img0": (128, 128), "img1": (192, 128), "img2": (128, 192), "img3": (160, 144)}
SAVE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "float": torch.float32}
STEPS = 2
BUCKET_STEPS_REFUSED = {"finetune_adafactor", "finetune_lion"}  # bucket_reso_steps = 1.0 (see the docstring)
LAUNCHED_AS_PROCESSES = "finetune_adafactor"  # the launch that starts processes (see the docstring)
BUCKET_STEPS_ERROR = "bucket_reso_steps 1 must be a multiple of 64 for this model (kohya's rule)"


def fill(text: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        text = text.replace("{" + name + "}", value)
    assert not re.search(r"\{(python|sd_scripts|gui|images|dreambooth|model|train|output)\}", text), text
    return text


def shortened(toml_lines: list[str], values: dict[str, str]) -> str:
    """The GUI's TOML with only the changes the module docstring lists."""
    lines = []
    for line in toml_lines:
        key = line.split(" = ")[0]
        if key == "max_train_epochs":
            continue
        if key == "max_train_steps":
            line = f"max_train_steps = {STEPS}"
        elif key == "logging_dir":
            line = f'logging_dir = "{values["output"]}/logs"'
        lines.append(fill(line, values))
    return "\n".join(lines) + "\n"


@pytest.fixture
def gui_inputs(tmp_path: Path) -> dict[str, str]:
    """What the harness fed the tabs: a fine-tuning folder and a DreamBooth parent (``2_thing``), the same
    four images of four sizes with ``.txt`` captions."""
    images, dreambooth = tmp_path / "finetune_images", tmp_path / "dreambooth" / "2_thing"
    rng = np.random.default_rng(0)
    for folder in (images, dreambooth):
        folder.mkdir(parents=True)
    for index, (stem, (width, height)) in enumerate(SIZES.items()):
        pixels = rng.integers(0, 255, (height, width, 3), dtype=np.uint8)
        for folder in (images, dreambooth):
            Image.fromarray(pixels).save(folder / f"{stem}.png")
            (folder / f"{stem}.txt").write_text(f"a photo of thing {index}, red, square", encoding="utf-8")
    return {"images": str(images), "dreambooth": str(dreambooth.parent)}


def run_as_gui(argv: list[str], pythonpath: str, cwd: Path, expect: int = 0) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=cwd, env={**SCRIPT_ENV, "PYTHONPATH": pythonpath}, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == expect, (result.stdout + result.stderr)[-4000:]
    return result


def launch_in_process(argv: list[str], cwd: Path, expect: int = 0) -> subprocess.CompletedProcess:
    """``accelerate launch ...`` (``argv``) through accelerate's ``launch_command``, with the command (interpreter,
    script, arguments) and environment its simple launcher builds run in this process (``run_script_as_main``);
    the script's result. Its exit code must be ``expect``; a non-zero one reaches accelerate as the simple
    launcher reports it (``CalledProcessError``)."""
    from accelerate.commands import launch
    from accelerate.utils import prepare_simple_launcher_cmd_env

    launched = []

    def simple_launcher(args) -> None:
        command, env = prepare_simple_launcher_cmd_env(args)
        env["SOURCE_DATE_EPOCH"] = SCRIPT_ENV["SOURCE_DATE_EPOCH"]  # as in run_as_gui's processes
        # A run without --seed (the Dreambooth defaults) draws its seed from Python's random, which a new process
        # seeds from the OS and this one left wherever earlier tests seeded it: seeded here, the replay repeats.
        random.seed(0)
        launched.append(run_script_as_main(command, cwd, expect=expect, env=env))
        if launched[-1].returncode != 0:
            raise subprocess.CalledProcessError(launched[-1].returncode, command)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "simple_launcher", simple_launcher)
        try:
            launch.launch_command(launch.launch_command_parser().parse_args(argv[2:]))
        except subprocess.CalledProcessError as failed:
            assert expect != 0 and failed.returncode == expect
    assert len(launched) == 1  # accelerate chose its simple launcher: one process, no distributed launch
    return launched[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_gui_command_trains_as_written(name, tiny_models, gui_inputs, tmp_path):
    run = RUNS[name]
    values = {"python": sys.executable, "sd_scripts": str(REPO), "gui": str(tmp_path / "kohya_ss"),
              "model": str(tiny_models[run["kind"]]), "train": str(tmp_path / "train"),
              "output": str(tmp_path / "output"), **gui_inputs}
    for prep in run["prep"]:  # the Finetuning tab: captions merged, buckets and latents prepared
        assert fill(prep["PYTHONPATH"], values).split(":")[:2] == [values["gui"], str(REPO)]
        run_script_as_main([fill(part, values) for part in prep["argv"]], tmp_path)

    argv = [fill(part, values) for part in run["train_argv"]]
    toml_path = Path(argv[argv.index("--config_file") + 1])
    toml_path.parent.mkdir(parents=True, exist_ok=True)
    toml_text = shortened(run["toml_lines"], values)
    toml_path.write_text(toml_text, encoding="utf-8")
    (toml_path.parent / "sample").mkdir(exist_ok=True)  # the GUI writes the (here empty) sample prompts file
    (toml_path.parent / "sample" / "prompt.txt").write_text("", encoding="utf-8")
    assert argv[:2] == ["accelerate", "launch"]
    argv[argv.index("--num_cpu_threads_per_process") + 1] = "1"
    if name in BUCKET_STEPS_REFUSED:
        if name == LAUNCHED_AS_PROCESSES:
            launch = [sys.executable, "-m", "accelerate.commands.launch", *argv[2:]]
            refused = run_as_gui(launch, str(REPO), tmp_path, expect=1)  # accelerate launch: 1 when its child fails
            assert "returned non-zero exit status 2" in refused.stderr, refused.stderr[-3000:]
        else:
            refused = launch_in_process(argv, tmp_path, expect=2)
        errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and errors[0].endswith(BUCKET_STEPS_ERROR), refused.stderr[-3000:]
        assert not Path(values["output"], "logs").exists()
        toml_text = re.sub(r"(?m)^bucket_reso_steps = 1.0$", "bucket_reso_steps = 64", toml_text)
        toml_path.write_text(toml_text, encoding="utf-8")
    result = launch_in_process(argv, tmp_path)

    # every step trained, or (fp16 from the loss scaler's initial scale) skipped by the loss scaler only
    end = re.match(rf"done: {STEPS} steps, (\d+) trained; skipped: guard 0, loss scaler (\d+), non-finite loss 0, "
                   r"non-finite gradient 0;", result.stdout.strip().splitlines()[-1])
    assert end and int(end[1]) >= 1 and int(end[1]) + int(end[2]) == STEPS, result.stdout[-3000:]
    config = tomllib.loads(toml_text)
    assert config["save_model_as"] == "safetensors"
    saved = Path(config["output_dir"]) / f"{config['output_name']}.safetensors"  # kohya's final name
    with safe_open(str(saved), "pt") as file, safe_open(str(tiny_models[f"{run['kind']}_file"]), "pt") as base:
        assert set(file.keys()) == set(base.keys())  # the whole checkpoint in the original layout, as the base
        dtypes = {file.get_slice(key).get_dtype() for key in file.keys()}
    assert dtypes <= {{torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32"}[
        SAVE_DTYPES[config["save_precision"]]], "I64"}, dtypes
