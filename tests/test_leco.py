"""LECO / slider training (``sdxl_train_leco.py``, ``train_leco.py``, ``library.trainables.leco`` on the
training core): the prompt files of both formats, the target (kohya parity), one-line refusals, a slider
that moves the UNet both ways, the GUI's LECO command, kill -9 + ``--resume auto`` to the same bytes."""
from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from library.errors import UserError
from library.leco_prompts import PromptPair, leco_target, load_prompt_pairs
from conftest import REPO, SCRIPT_ENV, model_args, run_script_as_main

SLIDER_TOML = """
neutral = "photo"
resolution = 64

[[targets]]
target_class = "photo"
positive = "happy photo"
negative = "sad photo"
guidance_scale = 0.5
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def fields(pair: PromptPair) -> tuple:
    return (pair.target, pair.positive, pair.unconditional, pair.neutral, pair.action, pair.multiplier)


def test_original_leco_pairs_take_file_defaults_and_kohya_fallbacks(tmp_path):
    path = write(tmp_path, "p.toml", """
guidance_scale = 2.0
resolution = [64, 96]
[[prompts]]
target = "van gogh"
[[prompts]]
target = "cat"
positive = "tabby cat"
unconditional = "animal"
action = "enhance"
batch_size = 2
weight = 0.5
""")
    first, second = load_prompt_pairs(path)
    # positive defaults to target, neutral to unconditional (empty), action to erase
    assert fields(first) == ("van gogh", "van gogh", "", "", "erase", 1.0)
    assert (first.guidance_scale, first.resolution, first.batch_size) == (2.0, (64, 96), 1)
    assert fields(second) == ("cat", "tabby cat", "animal", "animal", "enhance", 1.0)
    assert (second.batch_size, second.weight) == (2, 0.5)


def test_yaml_list_is_a_list_of_leco_pairs(tmp_path):
    path = write(tmp_path, "p.yaml", '- target: "van gogh"\n  action: enhance\n  resolution: 512\n')
    (pair,) = load_prompt_pairs(path)
    assert fields(pair) == ("van gogh", "van gogh", "", "", "enhance", 1.0) and pair.resolution == (512, 512)


def test_slider_target_expands_into_four_bidirectional_pairs(tmp_path):
    pairs = load_prompt_pairs(write(tmp_path, "s.toml", SLIDER_TOML))
    pos, neg = "happy photo", "sad photo"
    assert [fields(p) for p in pairs] == [
        ("photo", neg, pos, "photo", "erase", 1.0),
        ("photo", pos, neg, "photo", "enhance", 1.0),
        ("photo", pos, neg, "photo", "erase", -1.0),
        ("photo", neg, pos, "photo", "enhance", -1.0),
    ]
    assert all(p.resolution == (64, 64) and p.guidance_scale == 0.5 for p in pairs)


def test_slider_neutrals_resolutions_and_one_sided_targets(tmp_path):
    (tmp_path / "neutrals.txt").write_text("studio photo\n\n  portrait \n", encoding="utf-8")
    path = write(tmp_path, "s.yaml", """
slider:
  neutrals: ["", "cinematic"]
  targets:
    - target_class: person
      positive: smiling person
      resolutions: [[64, 64], [64, 128]]
      multiplier: 2.0
    - target_class: person
      negative: blurry
      neutral_prompt_file: neutrals.txt
""")
    pairs = load_prompt_pairs(path)
    first = pairs[:8]  # 2 neutrals x 2 resolutions x 2 directions
    assert [(p.neutral, p.resolution, p.action, p.multiplier, p.unconditional) for p in first] == [
        ("", (64, 64), "enhance", 2.0, ""), ("", (64, 64), "erase", -2.0, ""),
        ("", (64, 128), "enhance", 2.0, ""), ("", (64, 128), "erase", -2.0, ""),
        ("cinematic", (64, 64), "enhance", 2.0, ""), ("cinematic", (64, 64), "erase", -2.0, ""),
        ("cinematic", (64, 128), "enhance", 2.0, ""), ("cinematic", (64, 128), "erase", -2.0, ""),
    ]
    assert all(p.positive == "smiling person" for p in first)
    second = pairs[8:]  # the target's own neutral file replaces the file's neutrals
    assert [(p.neutral, p.positive, p.action, p.multiplier) for p in second] == [
        ("studio photo", "blurry", "erase", 1.0), ("studio photo", "blurry", "enhance", -1.0),
        ("portrait", "blurry", "erase", 1.0), ("portrait", "blurry", "enhance", -1.0),
    ]


def test_target_erases_or_enhances_the_guided_direction():
    pair = PromptPair("t", "p", "u", "n", "erase", 2.0, (64, 64), False, 1, False, 1.0, 1.0)
    positive, neutral, unconditional = torch.tensor([3.0]), torch.tensor([10.0]), torch.tensor([1.0])
    assert leco_target(pair, positive, neutral, unconditional).item() == 10.0 - 2.0 * 2.0
    enhance = dataclasses.replace(pair, action="enhance")
    assert leco_target(enhance, positive, neutral, unconditional).item() == 10.0 + 2.0 * 2.0


@pytest.mark.parametrize("text, message", [
    ("[[prompts]]\npositive = 'x'\n", "prompts[0]: the key `target` is missing"),
    ("[[prompts]]\ntarget = 'x'\naction = 'remove'\n", "`action` 'remove' is unknown; valid: erase, enhance"),
    ("[[prompts]]\ntarget = 'x'\ntargett = 'y'\n", "unknown key 'targett'"),
    ("[[targets]]\ntarget_class = 'x'\n", "targets[0]: a slider target needs `positive` or `negative`"),
    ("targets = []\n", "`targets` is empty"),
    ("resolution = 512\n", "no `prompts` and no slider `targets`"),
    ("[[prompts]]\ntarget = 'x'\nresolution = 'big'\n", "`resolution` 'big'"),
    ("[[prompts]\ntarget = 1\n", "not a valid TOML file"),
])
def test_bad_prompt_files_are_one_line_user_errors(tmp_path, text, message):
    with pytest.raises(UserError) as error:
        load_prompt_pairs(write(tmp_path, "bad.toml", text))
    assert message in str(error.value) and "\n" not in str(error.value)
    assert "--prompts_file" in str(error.value)


def run_script(script: str, argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / script), *argv], cwd=REPO, env=SCRIPT_ENV, capture_output=True,
                          text=True, timeout=600)


def run_script_here(script: str, argv: list[str]) -> subprocess.CompletedProcess:
    """``script`` as ``__main__`` in this process (``run_script_as_main``): its exit code and streams, no
    process start (a refusal's cost is the imports)."""
    return run_script_as_main([sys.executable, str(REPO / script), *argv], REPO, expect=None)


@pytest.mark.parametrize("text, message", [
    ("[[prompts]]\ntarget = 'x'\naction = 'remove'\n", "`action` 'remove' is unknown; valid: erase, enhance"),
    ("[[prompts]]\npositive = 'x'\n", "prompts[0]: the key `target` is missing"),
])
def test_script_refuses_a_bad_prompt_file_with_exit_2_before_loading(tmp_path, text, message):
    """The model path does not exist: a refusal naming it would mean the prompt file was read after."""
    bad = write(tmp_path, "bad.yaml" if text.startswith("-") else "bad.toml", text)
    result = run_script_here("sdxl_train_leco.py", ["--pretrained_model_name_or_path",
                                                    str(tmp_path / "missing.safetensors"), "--prompts_file", str(bad),
                                                    "--output_dir", str(tmp_path / "out")])
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and str(bad) in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_script_refuses_image_dataset_options_with_exit_2(tmp_path):
    prompts_file = write(tmp_path, "p.toml", "[[prompts]]\ntarget = 'x'\n")
    result = run_script_here("train_leco.py", ["--pretrained_model_name_or_path", str(tmp_path / "missing.safetensors"),
                                               "--prompts_file", str(prompts_file), "--output_dir",
                                               str(tmp_path / "out"), "--cache_latents"])
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: --cache_latents: LECO trains a UNet LoRA from prompts alone (no images, no epochs); remove the option"
    ], result.stderr[-2000:]


def neutral_predictions(tiny_models, lora_path: Path, prompts: dict[str, str], multipliers: list[float]
                        ) -> tuple[dict[str, torch.Tensor], dict[float, torch.Tensor]]:
    """The frozen UNet's predictions for ``prompts`` and the slider's for the neutral prompt at each
    multiplier, on fixed noise at fixed timesteps (the tiny SDXL, 64x64)."""
    import argparse

    from library.trainables import leco
    from library.training.families import SdxlFamily
    from networks import registry

    family = SdxlFamily()
    args = argparse.Namespace(pretrained_model_name_or_path=str(tiny_models["sdxl_file"]), v2=False,
                              model_config_dir=str(tiny_models["sdxl_config"]), tokenizer_cache_dir=None, vae=None,
                              lowram=False, highvram=False, fp8_base=False, fp8_base_unet=False,
                              max_token_length=None, weighted_captions=False)
    models = family.load_models(args)
    network = registry.network_from_file(str(lora_path), models.text_encoders, models.unet,
                                         family.unet_module_names(models), "--lora").eval()
    network.apply_to(apply_text_encoder=False, apply_unet=True)
    generator = torch.Generator().manual_seed(7)
    latents = torch.randn((4, 4, 8, 8), generator=generator)
    timesteps = torch.tensor([100, 300, 600, 900])
    sizes = leco.size_conditioning(64, 64, 4, False)

    def predict(prompt: str, multiplier: float) -> torch.Tensor:
        network.set_multiplier(multiplier)
        with torch.no_grad():
            conditioning = leco.repeat_conditioning(family.encode_prompts(args, models, [prompt]), 4)
            return family.predict(models, latents, timesteps, conditioning, sizes)

    frozen = {name: predict(prompt, 0.0) for name, prompt in prompts.items()}
    return frozen, {m: predict(prompts["neutral"], m) for m in multipliers}


@pytest.mark.slow
def test_slider_moves_the_neutral_prediction_towards_positive_at_plus_one_and_negative_at_minus_one(
        tiny_models, tmp_path):
    """An ai-toolkit-style slider (SLIDER_TOML) on the tiny SDXL: the neutral prompt's prediction on fixed
    noise at fixed timesteps gets closer to the positive prompt's (frozen UNet) at +1 and to the
    negative's at -1, than the base model's (multiplier 0). guidance_scale 0.5: the ideal slider then
    sits at the middle of positive and negative, closer to each side than the base (with 1.0 it would
    overshoot past the prompt nearer to neutral). Measured on the training core (RMS): to positive 0.021239
    at 0, 0.020330 at +1 (0.022517 at -1); to negative 0.022687 at 0, 0.022637 at -1 (0.023164 at +1);
    along positive-negative +0.0555 at +1, -0.0540 at -1 (the random tiny model's prompts differ little;
    the LoRA also moves off the positive-negative axis, hence rank 1 and few steps)."""
    import sdxl_train_leco

    prompts_file = write(tmp_path, "slider.toml", SLIDER_TOML)
    sdxl_train_leco.main([*model_args(tiny_models, "sdxl"), "--prompts_file", str(prompts_file), "--output_dir",
                          str(tmp_path / "out"), "--output_name", "slider", "--network_dim", "1", "--network_alpha",
                          "1", "--learning_rate", "5e-4", "--max_train_steps", "32", "--max_denoising_steps", "4",
                          "--seed", "3"])
    frozen, slider = neutral_predictions(
        tiny_models, tmp_path / "out" / "slider.safetensors",
        {"neutral": "photo", "positive": "happy photo", "negative": "sad photo"}, [0.0, 1.0, -1.0])
    torch.testing.assert_close(slider[0.0], frozen["neutral"], rtol=0, atol=0)  # multiplier 0: the base model
    distance = lambda a, b: (a - b).double().pow(2).mean().sqrt().item()  # noqa: E731
    to_positive = {m: distance(slider[m], frozen["positive"]) for m in slider}
    to_negative = {m: distance(slider[m], frozen["negative"]) for m in slider}
    direction = (frozen["positive"] - frozen["negative"]).double().flatten()
    along = {m: torch.dot((slider[m] - slider[0.0]).double().flatten(), direction).item() / direction.norm().item()
             for m in slider}
    print(f"RMS to positive: {to_positive}; to negative: {to_negative}; moved along positive-negative: {along}; "
          f"|neutral-positive| {distance(frozen['neutral'], frozen['positive'])}, |neutral-negative| "
          f"{distance(frozen['neutral'], frozen['negative'])}")
    assert to_positive[1.0] < to_positive[0.0] and to_negative[-1.0] < to_negative[0.0]
    assert to_positive[1.0] < to_positive[-1.0] and to_negative[-1.0] < to_negative[1.0]


def test_pairs_and_targets_match_kohyas_own_parser_and_target():
    """kohya's ``load_prompt_settings`` and ``PromptSettings.build_target`` (its v0.11.1
    ``library/leco_train_util.py``, run outside the project by /work/harness_leco/kohya_side.py) on
    the files in tests/data/leco gave ``kohya_pairs.json``: the same pairs in the same order, and the
    same targets bit for bit for the same UNet outputs (one multiply-add each side, same order)."""
    data = Path(__file__).parent / "data" / "leco"
    recorded = json.loads((data / "kohya_pairs.json").read_text())
    outputs = torch.linspace(-1.0, 1.0, 3 * 6, dtype=torch.float32).reshape(3, 6) ** 3  # positive, neutral, uncond
    assert sum(len(rows) for rows in recorded.values()) == 31
    for name, rows in recorded.items():
        pairs = load_prompt_pairs(data / name)
        assert len(pairs) == len(rows), name
        for pair, row in zip(pairs, rows):
            target = leco_target(pair, *outputs)
            assert {**{f: getattr(pair, f) for f in row if f not in ("resolution", "leco_target")},
                    "resolution": list(pair.resolution), "leco_target": [float(v) for v in target]} == row, name


@pytest.mark.slow
def test_gui_leco_tab_command_trains(tiny_models, tmp_path):
    """The TOML the kohya_ss GUI v26's LECO tab wrote (its own ``leco_tab`` and ``train_model``,
    driven headless by /work/harness_leco/drive_leco.py: defaults AdamW8bit, sdpa, gradient
    checkpointing, fp16 save; 2 steps, 4 denoising steps set), with this run's paths, as the GUI
    launches it (``--config_file``; the tiny model also needs ``--model_config_dir``)."""
    from networks import network_base
    import sdxl_train_leco

    prompts_file = write(tmp_path, "slider.toml", SLIDER_TOML)
    template = (Path(__file__).parent / "data" / "leco" / "gui_leco_sdxl.toml").read_text()
    config = write(tmp_path, "config_leco.toml", template.replace("{OUTPUT_DIR}", str(tmp_path / "out")).replace(
        "{MODEL}", str(tiny_models["sdxl_file"])).replace("{PROMPTS}", str(prompts_file)))
    sdxl_train_leco.main(["--config_file", str(config), "--model_config_dir", str(tiny_models["sdxl_config"])])
    path = tmp_path / "out" / "gui_slider.safetensors"
    metadata = network_base.read_lora_metadata(str(path))
    assert metadata["ss_leco_prompt_count"] == "4" and metadata["ss_leco_prompts_file"] == "slider.toml"
    assert json.loads(metadata["ss_leco_preview"])[1]["action"] == "enhance"
    weights = network_base.read_lora_file(str(path))
    assert weights and all(key.startswith("lora_unet_") for key in weights)  # a UNet LoRA only
    assert all(tensor.dtype == torch.float16 for tensor in weights.values())  # save_precision = "fp16"


@pytest.mark.slow
def test_sd15_leco_trains_a_loha(tiny_models, tmp_path):
    import train_leco
    from networks import network_base

    prompts_file = write(tmp_path, "p.toml", '[[prompts]]\ntarget = "cat"\naction = "enhance"\nresolution = 64\n')
    train_leco.main([*model_args(tiny_models, "sd15"), "--prompts_file", str(prompts_file), "--output_dir",
                     str(tmp_path / "out"), "--network_module", "networks.loha", "--network_dim", "2",
                     "--max_train_steps", "2", "--max_denoising_steps", "3", "--seed", "1"])
    path = tmp_path / "out" / "last.safetensors"  # kohya's default output name
    assert network_base.read_lora_metadata(str(path))["ss_network_module"] == "networks.loha"
    assert any(key.endswith("hada_w1_a") for key in network_base.read_lora_file(str(path)))


def leco_run_argv(tiny_models, prompts_file: Path, output_dir: Path) -> list[str]:
    """A short SDXL slider run under fp16 (the loss scaler: LECO's ~1e-6 losses underflow unscaled)
    with a state every step."""
    return [*model_args(tiny_models, "sdxl"), "--prompts_file", str(prompts_file), "--output_dir", str(output_dir),
            "--output_name", "s", "--network_dim", "1", "--network_alpha", "1", "--learning_rate", "5e-4",
            "--max_train_steps", "4", "--max_denoising_steps", "4", "--seed", "3", "--mixed_precision", "fp16",
            "--optimizer_type", "AdamW", "--save_state", "--save_every_n_steps", "1"]


@pytest.mark.slow
def test_killed_in_a_state_write_then_resumed_gives_the_uninterrupted_bytes(tiny_models, tmp_path, capsys,
                                                                            monkeypatch):
    """Every draw of a LECO micro-batch (pair, denoising steps, initial and step noise) is keyed by the
    seed and its position, so the resumed run trains what the uninterrupted one trained; the end line
    is the core's honest one. (The killed run is a subprocess; the others run in this process.)"""
    import sdxl_train_leco

    monkeypatch.setenv("SOURCE_DATE_EPOCH", SCRIPT_ENV["SOURCE_DATE_EPOCH"])  # the files' dates, as the subprocess's
    prompts_file = write(tmp_path, "slider.toml", SLIDER_TOML)
    sdxl_train_leco.main(leco_run_argv(tiny_models, prompts_file, tmp_path / "ref"))
    reference = capsys.readouterr().out
    assert reference.strip().splitlines()[-1].startswith(
        "done: 4 steps, 4 trained; skipped: guard 0, loss scaler "), reference[-2000:]
    argv = leco_run_argv(tiny_models, prompts_file, tmp_path / "run")
    killed = run_script("sdxl_train_leco.py", argv + ["--debug_kill_in_state_write", "3"])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    sdxl_train_leco.main(argv + ["--resume", "auto"])
    resumed = capsys.readouterr().out
    assert "resumed at step 2 " in resumed and resumed.strip().splitlines()[-1].startswith("done: 4 steps"), resumed
    assert (tmp_path / "run" / "s.safetensors").read_bytes() == (tmp_path / "ref" / "s.safetensors").read_bytes()


@pytest.mark.slow
def test_the_end_line_counts_a_step_the_core_skipped(tiny_models, tmp_path, capsys):
    """The core's honest end line for a LECO run: a non-finite gradient injected at step 2 is not
    trained (the guard's non-finite path), the line says so, and its average loss keeps its
    significant digits (4 of them: LECO's losses are ~1e-6)."""
    import sdxl_train_leco

    prompts_file = write(tmp_path, "slider.toml", SLIDER_TOML)
    sdxl_train_leco.main([*model_args(tiny_models, "sdxl"), "--prompts_file", str(prompts_file), "--output_dir",
                          str(tmp_path / "out"), "--output_name", "s", "--network_dim", "1", "--max_train_steps", "4",
                          "--max_denoising_steps", "3", "--seed", "3", "--debug_inject_grad", "2=nan"])
    final = capsys.readouterr().out.strip().splitlines()[-1]
    assert final.startswith("done: 4 steps, 3 trained; skipped: guard 0, loss scaler 0, non-finite loss 0, "
                            "non-finite gradient 1;"), final
    average = float(final.split("final average loss ")[1].split()[0])  # LECO's ~1e-6 losses: shown, not 0.0000
    assert 0 < average < 1e-2, final


@pytest.mark.slow
def test_a_diverging_leco_run_heals_and_the_nan_report_names_the_pair(tiny_models, tmp_path, capsys):
    """Learning rate 1 under fp16 makes the tiny SDXL's forward overflow within a few steps (measured:
    first non-finite loss at step 5, rewinds at steps 6 and 8): the core's healing rewinds through
    the LECO batches (their positions), and the NaN report names the prompt pair as it names an image."""
    import sdxl_train_leco

    prompts_file = write(tmp_path, "slider.toml", SLIDER_TOML)
    sdxl_train_leco.main([*model_args(tiny_models, "sdxl"), "--prompts_file", str(prompts_file), "--output_dir",
                          str(tmp_path / "out"), "--output_name", "h", "--network_dim", "4", "--max_train_steps", "8",
                          "--max_denoising_steps", "3", "--seed", "42", "--mixed_precision", "fp16",
                          "--grad_guard_preset", "stable", "--learning_rate", "1", "--optimizer_type", "AdamW",
                          "--rewind_every_n_steps", "2"])
    output = capsys.readouterr().out
    assert "rewound to the healthy point of step" in output, output[-3000:]
    report = (tmp_path / "out" / "h-nan_report.txt").read_text()
    assert f"{prompts_file} (pair " in report and "caption 'photo'" in report, report
    assert output.strip().splitlines()[-1].startswith("done: 8 steps") and "rewinds " in output.splitlines()[-1]
