"""Careless users, third sweep (issue 23): each mistake is one line naming the flag or file and what is
valid (exit code 2; 1 for a full disk), before the model is loaded where it can be known then, and a
failed run replaces nothing good on disk."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_trainer, train_expecting_user_error
from safetensors.torch import load_file
from test_bad_input import output_dir  # noqa: F401  (the fixture: an output folder holding an earlier LoRA)
from test_bad_input import base_args, replace_flag, run_expecting_user_error, unloadable_model_args

import train_network
from library import config_file, sampling
from library.datasets import config as dataset_config
from library.datasets.captions import read_caption_file
from library.errors import UserError
from networks.network_base import parse_network_args

REPO = Path(__file__).resolve().parent.parent
BOM = "\ufeff"


# -- 1. files saved as UTF-8 with a byte-order mark (Windows Notepad) -------------------------------
def test_bom_is_stripped_from_captions_configs_and_prompt_files(tmp_path):
    image = tmp_path / "img.png"
    (tmp_path / "img.txt").write_text(BOM + "sks dog, grass", encoding="utf-8")
    assert read_caption_file(str(image), ".txt", enable_wildcard=False) == "sks dog, grass"

    config = tmp_path / "run.toml"
    config.write_text(BOM + "[training]\nlearning_rate = 1e-3\n", encoding="utf-8")
    args, _ = config_file.parse_args(train_network.setup_parser(), ["--config_file", str(config)])
    assert args.learning_rate == 1e-3

    dataset = tmp_path / "dataset.toml"
    dataset.write_text(BOM + "[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = 'x'\n", encoding="utf-8")
    assert dataset_config.load_user_config(str(dataset))["datasets"][0]["resolution"] == 64

    prompts = tmp_path / "prompts.txt"
    prompts.write_text(BOM + "sks dog --w 64 --h 64\n", encoding="utf-8")
    assert [prompt.prompt for prompt in sampling.load_prompts(prompts)] == ["sks dog"]


# -- 2. a table inside a table ---------------------------------------------------------------------
def test_an_option_in_a_nested_toml_table_is_refused_and_unused_keys_are_named_with_their_table(tmp_path, caplog):
    nested = tmp_path / "nested.toml"
    nested.write_text("[a.b]\nlearning_rate = 1e-3\n", encoding="utf-8")
    with pytest.raises(UserError) as refused:
        config_file.parse_args(train_network.setup_parser(), ["--config_file", str(nested)])
    assert str(refused.value).startswith(f"--config_file {nested}: a.b.learning_rate: ") and "[a]" in str(refused.value)

    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[a]\nlearning_rate = 1e-3\nepoch = 4\n[a.b]\nnot_an_option = 1\n", encoding="utf-8")
    args, _ = config_file.parse_args(train_network.setup_parser(), ["--config_file", str(unknown)])
    assert args.learning_rate == 1e-3
    warning = [record.getMessage() for record in caplog.records if "ignoring" in record.getMessage()]
    assert len(warning) == 1 and warning[0].endswith(": a.epoch, a.b.not_an_option")


# -- refused before the model loads ----------------------------------------------------------------
def write_prompts(path: Path, line: str) -> Path:
    path.write_text(line + "\n", encoding="utf-8")
    return path


def early_cases(tmp_path: Path) -> list[tuple[list[str], str]]:
    """(extra flags, text the one-line error must contain)."""
    def sampled(line: str) -> list[str]:
        path = tmp_path / f"prompts{len(list(tmp_path.glob('prompts*.txt')))}.txt"
        return ["--sample_prompts", str(write_prompts(path, line)), "--sample_every_n_steps", "1"]
    return [
        # 3. an empty output name would write the hidden file .safetensors
        (["--output_name", ""], "--output_name '': give a file name"),
        (["--output_name", "  "], "--output_name '  ': give a file name"),
        # 5. sizes no GPU can train
        (["--resolution", "100000"], "--resolution 100000: at most 8192 px per side"),
        (["--resolution", "1024,65536"], "at most 8192 px per side"),
        # 6. LoKr factor 0: a 1x1 lokr_w1 in every module
        (["--network_module", "networks.lokr", "--network_args", "factor=0"],
         "--network_args factor=0: LoKr's factor must be -1 (the most balanced split of each layer) or a whole "
         "number >= 1"),
        (["--network_module", "lycoris.kohya", "--network_args", "algo=lokr", "factor=0"],
         "--network_args factor=0: LoKr's factor must be -1"),
        # 7. optimizer arguments of the wrong kind
        (["--optimizer_type", "Prodigy", "--learning_rate", "1", "--optimizer_args", "safeguard_warmup=maybe"],
         "--optimizer_args safeguard_warmup=maybe: Prodigy takes true or false for safeguard_warmup"),
        (["--optimizer_type", "DAdaptAdam", "--learning_rate", "1", "--optimizer_args", "decouple=maybe"],
         "--optimizer_args decouple=maybe: DAdaptAdam takes true or false for decouple"),
        (["--optimizer_type", "AdamWScheduleFree", "--optimizer_args", "warmup_steps=abc"],
         "--optimizer_args warmup_steps=abc: AdamWScheduleFree takes a number for warmup_steps"),
        # 12. sample prompt options kohya would clamp or pass on
        (sampled("a dog --w -512"), "width (--w) -512 must be 64 to 8192 pixels"),
        (sampled("a dog --h 100000"), "height (--h) 100000 must be 64 to 8192 pixels"),
        (sampled("a dog --s 0"), "sample_steps (--s) 0 must be 1 to 1000"),
        (sampled("a dog --l nan"), "scale (--l) nan must be a finite number"),
    ]


def test_mistakes_are_refused_before_the_model_loads(tiny_models, demo_dataset, output_dir, capsys, tmp_path):
    argv = unloadable_model_args(tiny_models, tmp_path) + base_args(tiny_models, demo_dataset, output_dir)[4:]
    for flags, expected in early_cases(tmp_path):
        message = run_expecting_user_error(capsys, argv + flags, output_dir)
        assert expected in message, (flags, message)
    # the same run without a mistake gets as far as the model (so the cases above were refused before it)
    assert "unloadable.ckpt" in run_expecting_user_error(capsys, argv, output_dir)


def test_boolean_optimizer_arguments_read_as_network_args_does():
    import argparse

    from library import optimizers

    parser = argparse.ArgumentParser()
    optimizers.add_arguments(parser)
    args = parser.parse_args(["--optimizer_type", "Prodigy", "--learning_rate", "1",
                              "--optimizer_args", "safeguard_warmup=yes decouple=0 use_bias_correction=True"])
    _, arguments, optimizer = optimizers.build_optimizer(args, [torch.nn.Parameter(torch.zeros(2))])
    group = optimizer.param_groups[0]
    assert (group["safeguard_warmup"], group["decouple"], group["use_bias_correction"]) == (True, False, True)
    assert arguments == "safeguard_warmup=True,decouple=False,use_bias_correction=True"


# -- 8. the GUI's one-string network_args -----------------------------------------------------------
def test_network_args_in_one_string_are_split_as_optimizer_args_are(tiny_models, demo_dataset, output_dir, capsys,
                                                                    tmp_path):
    assert parse_network_args(["conv_dim=4 conv_alpha=1", "preset=C:/My Presets/a.toml"]) == {
        "conv_dim": "4", "conv_alpha": "1", "preset": "C:/My Presets/a.toml"}
    argv = unloadable_model_args(tiny_models, tmp_path) + base_args(tiny_models, demo_dataset, output_dir)[4:]
    message = run_expecting_user_error(capsys, argv + ["--network_args", "conv_dim=4 conv_alpha=1"], output_dir)
    assert "unloadable.ckpt" in message  # the arguments were accepted; the run got to the model


# -- 12. a folder of configs only passed as the model -----------------------------------------------
def test_a_config_folder_as_the_model_is_one_line_before_loading(tiny_models, demo_dataset, output_dir, capsys):
    argv = replace_flag(base_args(tiny_models, demo_dataset, output_dir), "--pretrained_model_name_or_path",
                        str(tiny_models["sdxl_config"]))
    message = run_expecting_user_error(capsys, argv, output_dir)
    assert message == (f"error: --pretrained_model_name_or_path: {tiny_models['sdxl_config']} has no weights in "
                       f"unet/ (a folder of configs only?); give a diffusers model folder with weights, or a single "
                       f".safetensors file with this folder as --model_config_dir")
    assert "diffusion_pytorch_model" not in capsys.readouterr().out  # none of diffusers' search chatter


# -- 9. resume: the manifest is checked before the model is read -------------------------------------
@pytest.fixture(scope="module")
def state_of_a_ckpt_run(tiny_models, demo_dataset, tmp_path_factory) -> dict[str, Path]:
    """A finished run with states, trained from a .ckpt copy of the tiny SDXL; the .ckpt is then
    replaced by junk of the same size, so its name and size (what the state protects) still match
    but reading it fails: any refusal other than that one happened before the model load."""
    root = tmp_path_factory.mktemp("ckpt_run")
    model = root / "model.ckpt"
    torch.save({"state_dict": load_file(str(tiny_models["sdxl_file"]))}, model)
    output_dir = root / "out"
    run_trainer("sdxl_train_network", resume_argv(tiny_models, demo_dataset, model, output_dir) + [
        "--max_train_steps", "2", "--save_state", "--save_every_n_steps", "2"])
    model.write_bytes(b"x" * model.stat().st_size)
    return {"model": model, "output_dir": output_dir, "state": output_dir / "last-step00000002-state"}


def resume_argv(tiny_models, dataset: Path, model: Path, output_dir: Path) -> list[str]:
    return ["--pretrained_model_name_or_path", str(model), "--model_config_dir", str(tiny_models["sdxl_config"]),
            "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
            "--output_dir", str(output_dir), "--max_data_loader_n_workers", "0", "--network_train_unet_only",
            "--seed", "1", "--network_dim", "4"]


@pytest.mark.parametrize("flags, key", [
    (["--network_dim", "8"], "network_dim"),
    (["--network_alpha", "2"], "network_alpha"),
    (["--network_args", "conv_dim=2"], "network_args"),
    (["--mixed_precision", "bf16"], "mixed_precision"),
    (["--train_batch_size", "2"], "train_batch_size"),
    (["--gradient_accumulation_steps", "2"], "gradient_accumulation_steps"),
    (["--resolution", "128"], "resolution"),
    (["--seed", "2"], "seed"),
    (["--optimizer_type", "SGDNesterov"], "optimizer_type"),
    (["--network_module", "networks.loha"], "network_module"),
])
def test_resume_mismatches_are_refused_before_the_model_is_read(flags, key, state_of_a_ckpt_run, tiny_models,
                                                                demo_dataset, capsys, tmp_path):
    run = state_of_a_ckpt_run
    argv = resume_argv(tiny_models, demo_dataset, run["model"], run["output_dir"]) + [
        "--max_train_steps", "4", "--resume", str(run["state"])]
    for flag in flags[::2]:  # this case's value replaces the run's
        if flag in argv:
            index = argv.index(flag)
            del argv[index:index + 2]
    message = train_expecting_user_error(argv + flags, capsys)
    assert message.startswith(f"error: --resume {run['state']}: the state was written with {key}="), message
    assert message.endswith("; resume with the same settings")


def test_a_damaged_state_is_refused_before_the_model_is_read_and_an_intact_one_reaches_it(
        state_of_a_ckpt_run, tiny_models, demo_dataset, capsys, tmp_path):
    run = state_of_a_ckpt_run
    damaged = tmp_path / "damaged-state"
    shutil.copytree(run["state"], damaged)
    progress = damaged / "progress.json"
    progress.write_text(progress.read_text().replace('"global_step": 2', '"global_step": 3'))
    argv = resume_argv(tiny_models, demo_dataset, run["model"], run["output_dir"]) + ["--max_train_steps", "4"]
    message = train_expecting_user_error(argv + ["--resume", str(damaged)], capsys)
    assert "the state is damaged (checksum mismatch in progress.json)" in message
    # the intact state with the same settings passes every check and fails only at the (junk) model
    message = train_expecting_user_error(argv + ["--resume", str(run["state"])], capsys)
    assert "model.ckpt is not a readable checkpoint" in message


# -- 4. a full disk: one line, exit code 1, earlier files kept, no temporary left --------------------
def earlier_run(output_dir: Path) -> dict[Path, bytes]:
    files = {output_dir / "last.safetensors": b"earlier run",
             output_dir / "gradient_logs+last.txt": b"Epoch,Step,Gradient Norm,Threshold,Loss,ThreshOff\n1,1,1.0,,0.5,0\n",
             output_dir / "run.jsonl": b'{"step": 1}\n'}
    for path, data in files.items():
        path.write_bytes(data)
    return files


@pytest.mark.parametrize("disk_bytes, full_at", [
    (0, "run.jsonl"),  # full from the start: the jsonl log's first line is the run's first write
    (4000, "last.safetensors"),  # the logs' rows fit, the final LoRA does not
])
def test_a_full_disk_is_one_line_exit_1_and_keeps_what_was_on_disk(disk_bytes, full_at, tiny_models, demo_dataset,
                                                                    tmp_path):
    output_dir = tmp_path / "out"
    output_dir.mkdir()
    earlier = earlier_run(output_dir)
    argv = base_args(tiny_models, demo_dataset, output_dir) + [
        "--grad_norm_log", "--log_jsonl", str(output_dir / "run.jsonl"), "--save_state",
        "--debug_disk_full_after_bytes", str(disk_bytes)]
    result = subprocess.run([sys.executable, str(REPO / "sdxl_train_network.py"), *argv], capture_output=True,
                            text=True, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]  # tqdm writes to stderr too
    assert len(errors) == 1 and errors[0].startswith(
        f"error: {output_dir / full_at}: no space left on the disk; writing it needs "), errors
    assert " bytes" in errors[0] and errors[0].endswith("files already there are kept")
    assert (output_dir / "last.safetensors").read_bytes() == b"earlier run"
    assert not [path.name for path in output_dir.iterdir() if path.name.startswith(".")]  # no temporary left
    assert sorted(os.listdir(output_dir)) == sorted(path.name for path in earlier)  # no state, no tracker
    logs = [output_dir / "gradient_logs+last.txt", output_dir / "run.jsonl"]
    if disk_bytes == 0:  # nothing of the new run could be written: the earlier logs are as they were
        assert all(path.read_bytes() == earlier[path] for path in logs)
    else:  # the logs were replaced, at once, by ones holding the new run's rows
        rows = logs[0].read_text().splitlines()
        assert rows[0].startswith("Epoch,Step,") and [row.split(",")[1] for row in rows[1:]] == ["1", "2"]
        assert [json.loads(line)["step"] for line in logs[1].read_text().splitlines()] == [1, 2]
