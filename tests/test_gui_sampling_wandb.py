"""What the kohya_ss GUI passes about samples and wandb: its always-present (often empty) prompt
file samples nothing and costs no memory; wandb without credentials is refused before loading."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
from conftest import model_args, run_trainer, train_expecting_user_error

import sdxl_train_network

PROMPT = "a red circle --w 64 --h 64 --s 1 --d 1\n"
MISSING = None  # no prompt file at all


@pytest.fixture
def held_models(monkeypatch) -> list[tuple[bool, int]]:
    """Which frozen models the run still holds at each training step: (VAE held, text encoders held)."""
    held: list[tuple[bool, int]] = []
    original = sdxl_train_network.SdxlNetworkTrainer.predict

    def predict(self, models, *args, **kwargs):
        held.append((models.vae is not None, len(models.text_encoders)))
        return original(self, models, *args, **kwargs)

    monkeypatch.setattr(sdxl_train_network.SdxlNetworkTrainer, "predict", predict)
    return held


def gui_args(tiny_models, dataset: Path, output_dir: Path, *extra: str, model: Optional[str] = None) -> list[str]:
    """A GUI-like run: the prompt file is ``<output_dir>/sample/prompt.txt``; both caches on, so
    the VAE and the text encoders are freed after caching unless sampling needs them."""
    model_flags = model_args(tiny_models, "sdxl")
    if model is not None:
        model_flags[1] = model
    return model_flags + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", "run", "--seed", "1", "--max_data_loader_n_workers", "0",
        "--network_dim", "4", "--learning_rate", "1e-3", "--max_train_steps", "2", "--network_train_unet_only",
        "--cache_latents", "--cache_text_encoder_outputs",
        "--sample_prompts", str(output_dir / "sample" / "prompt.txt"), *extra,
    ]


@pytest.mark.parametrize("content,schedule,notice", [
    ("", [], None),  # the GUI with an empty Samples box
    ("", ["--sample_every_n_steps", "1"], "the file is empty or missing"),
    (MISSING, [], None),
    (MISSING, ["--sample_at_first"], "the file is empty or missing"),
    (PROMPT, [], "no sample point scheduled"),
], ids=["empty", "empty-scheduled", "missing", "missing-scheduled", "prompts-unscheduled"])
def test_nothing_to_sample_trains_and_frees_the_models(tiny_models, demo_dataset, tmp_path, capsys, held_models,
                                                       content, schedule, notice):
    output_dir = tmp_path / "out"
    if content is not MISSING:
        (output_dir / "sample").mkdir(parents=True)
        (output_dir / "sample" / "prompt.txt").write_text(content)
    capsys.readouterr()
    run_trainer("sdxl_train_network", gui_args(tiny_models, demo_dataset, output_dir, *schedule))
    lines = [line for line in capsys.readouterr().out.splitlines() if "--sample_prompts" in line]
    assert len(lines) == (notice is not None) and all(notice in line for line in lines), lines
    # VAE and both text encoders released after caching (the 2 steps, and the LoRA effect monitor's probe)
    assert len(held_models) >= 2 and set(held_models) == {(False, 0)}
    assert (output_dir / "run.safetensors").is_file()
    assert not list(output_dir.rglob("*.png"))


def test_scheduled_prompts_keep_the_models_and_sample(tiny_models, demo_dataset, tmp_path, capsys, held_models):
    output_dir = tmp_path / "out"
    (output_dir / "sample").mkdir(parents=True)
    (output_dir / "sample" / "prompt.txt").write_text(PROMPT)
    run_trainer("sdxl_train_network", gui_args(tiny_models, demo_dataset, output_dir, "--sample_every_n_steps", "2"))
    assert len(held_models) >= 2 and set(held_models) == {(True, 2)}
    assert len(list((output_dir / "sample").glob("run_000002_00_*_1.png"))) == 1
    assert "--sample_prompts" not in capsys.readouterr().out


@pytest.mark.parametrize("content", ["a cat --d seven\n", "a cat --ss magic\n"])
def test_a_broken_scheduled_prompt_file_stops_before_loading(tiny_models, demo_dataset, tmp_path, capsys, content):
    output_dir = tmp_path / "out"
    (output_dir / "sample").mkdir(parents=True)
    (output_dir / "sample" / "prompt.txt").write_text(content)
    missing_model = str(tmp_path / "no_such_model.safetensors")  # loading it would be a different error
    error = train_expecting_user_error(
        gui_args(tiny_models, demo_dataset, output_dir, "--sample_every_n_epochs", "1", model=missing_model), capsys)
    assert "--sample_prompts" in error and "prompt.txt" in error
    # unscheduled, the same file is not read: the run gets as far as loading the model
    error = train_expecting_user_error(gui_args(tiny_models, demo_dataset, output_dir, model=missing_model), capsys)
    assert "no_such_model" in error


@pytest.fixture
def no_wandb_credentials(monkeypatch, tmp_path):
    """An environment where wandb finds no key and no mode: no variables, no netrc, no settings file."""
    wandb = pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb.teardown()  # wandb keeps the settings and credentials it loaded first in this process
    yield monkeypatch
    wandb.teardown()


@pytest.mark.parametrize("extra,environment,expected", [
    ([], {}, "no wandb API key found"),
    (["--log_with", "all", "--logging_dir", "logs"], {}, "--log_with all: no wandb API key found"),
    ([], {"WANDB_API_KEY": "short"}, "API key must have 40+ characters"),
    (["--wandb_api_key", "short"], {}, "--wandb_api_key: API key must have 40+ characters"),
], ids=["none", "all", "bad-env-key", "bad-flag-key"])
def test_wandb_without_credentials_stops_before_loading(tiny_models, demo_dataset, tmp_path, capsys,
                                                        no_wandb_credentials, extra, environment, expected):
    for name, value in environment.items():
        no_wandb_credentials.setenv(name, value)
    argv = gui_args(tiny_models, demo_dataset, tmp_path / "out", "--log_with", "wandb", *extra,
                    model=str(tmp_path / "no_such_model.safetensors"))
    error = train_expecting_user_error(argv, capsys)
    assert expected in error
    assert "short" not in error.replace(expected, "")  # a key is never echoed
    if "found" in expected:
        assert "`wandb login`" in error and "--wandb_api_key" in error and "WANDB_MODE=offline" in error


@pytest.mark.parametrize("environment,extra", [
    ({"WANDB_MODE": "offline"}, []), ({"WANDB_MODE": "dryrun"}, []), ({"WANDB_MODE": "disabled"}, []),
    ({"WANDB_API_KEY": "k" * 40}, []),  # a well-formed key is not checked online
    ({}, ["--log_tracker_config", "TRACKER_CONFIG"]),  # [wandb] mode = "offline"
], ids=["offline", "dryrun", "disabled", "key", "tracker-config-mode"])
def test_wandb_modes_and_keys_that_pass_the_check(tiny_models, demo_dataset, tmp_path, capsys, no_wandb_credentials,
                                                  environment, extra):
    for name, value in environment.items():
        no_wandb_credentials.setenv(name, value)
    tracker_config = tmp_path / "trackers.toml"
    tracker_config.write_text('[wandb]\nmode = "offline"\n')
    extra = [str(tracker_config) if flag == "TRACKER_CONFIG" else flag for flag in extra]
    argv = gui_args(tiny_models, demo_dataset, tmp_path / "out", "--log_with", "wandb", *extra,
                    model=str(tmp_path / "no_such_model.safetensors"))
    assert "no_such_model" in train_expecting_user_error(argv, capsys)  # got past the check to model loading


def test_a_run_without_wandb_never_imports_it(tiny_models, demo_dataset, tmp_path):
    argv = gui_args(tiny_models, demo_dataset, tmp_path / "out", "--log_with", "tensorboard", "--logging_dir",
                    str(tmp_path / "logs"), model=str(tmp_path / "no_such_model.safetensors"))
    code = ("import sys, sdxl_train_network\nfrom library.errors import UserError\n"
            f"try:\n    sdxl_train_network.main(argv={argv!r})\nexcept UserError:\n    pass\n"
            "print('wandb imported' if 'wandb' in sys.modules else 'wandb not imported')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.stdout.strip().splitlines()[-1] == "wandb not imported", result.stderr
