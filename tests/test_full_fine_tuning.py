"""The full fine-tuners (``sdxl_train.py``, ``train_db.py``, ``fine_tune.py``) on the tiny models: they learn,
their checkpoints load in diffusers holding exactly the trained weights, a learning rate far too high
heals or fails honestly, bad input is one line before any model loads; kohya's full-fine-tune-only options
(``--stop_text_encoder_training``, ``--no_token_padding``, ``--diffusers_xformers``) and the ``-best`` file in the
run's model format. The loop events and kill -9 + ``--resume auto`` run in tests/test_training_core.py
(``TRAINERS["full-sdxl"]``); the GUI's Dreambooth / Finetuning commands in tests/test_gui_dreambooth_finetune.py;
two processes in tests/test_multiprocess.py."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, model_args, run_trainer, train_expecting_user_error
from safetensors.torch import load_file


COMMON = ("--resolution", "64", "--seed", "1", "--max_data_loader_n_workers", "0", "--optimizer_type", "AdamW")


def losses(output_dir: Path, name: str) -> list[float]:
    with open(output_dir / f"gradient_logs+{name}.txt", newline="") as file:
        return [float(row["Loss"]) for row in csv.DictReader(file)]


@pytest.fixture(scope="module")
def overfit(tiny_models, one_image_dataset, tmp_path_factory) -> Path:
    """12 steps of a full SDXL fine-tune in fp16 with the stable guard on one image (fixed timestep, so the
    loss measures what was learned rather than the timestep drawn)."""
    output_dir = tmp_path_factory.mktemp("full_overfit")
    run_trainer("sdxl_train", model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(one_image_dataset), "--output_dir", str(output_dir), "--output_name", "ft", *COMMON,
        "--mixed_precision", "fp16", "--grad_guard_preset", "stable", "--learning_rate", "1e-3",
        "--max_train_steps", "12", "--min_timestep", "500", "--max_timestep", "501",
        "--save_model_as", "safetensors", "--save_state_on_train_end"])
    return output_dir


@pytest.mark.slow
def test_full_sdxl_fp16_overfits_one_image(overfit):
    values = losses(overfit, "ft")
    assert len(values) == 12
    first, last = sum(values[:3]) / 3, sum(values[-3:]) / 3
    assert last < 0.7 * first, values  # measured: 0.97 -> ~0.5 over these steps


@pytest.mark.slow
def test_saved_checkpoint_loads_in_diffusers_and_is_the_trained_weights(overfit, tiny_models):
    from diffusers import StableDiffusionXLPipeline

    trained = load_file(overfit / "ft-state" / "lora.safetensors")  # the state: what trained, as trained
    pipeline = StableDiffusionXLPipeline.from_single_file(str(overfit / "ft.safetensors"),
                                                          config=str(tiny_models["sdxl_config"]),
                                                          local_files_only=True, torch_dtype=torch.float32)
    unet = pipeline.unet.state_dict()
    assert {f"unet.{name}" for name in unet} == set(trained)  # the whole UNet trains, text encoders do not
    for name, tensor in unet.items():
        assert torch.equal(tensor, trained[f"unet.{name}"]), name
    base = StableDiffusionXLPipeline.from_single_file(str(tiny_models["sdxl_file"]),
                                                      config=str(tiny_models["sdxl_config"]),
                                                      local_files_only=True, torch_dtype=torch.float32)
    assert not all(torch.equal(tensor, base.unet.state_dict()[name]) for name, tensor in unet.items())
    metadata = json.loads((overfit / "ft.safetensors").read_bytes()[8:8 + int.from_bytes(
        (overfit / "ft.safetensors").read_bytes()[:8], "little")])["__metadata__"]
    assert metadata["modelspec.architecture"] == "stable-diffusion-xl-v1-base"  # kohya's checkpoint spec
    assert not any(key.startswith("ss_") for key in metadata)


@pytest.mark.slow
def test_learning_rate_far_too_high_heals_or_fails_honestly(tiny_models, one_image_dataset, tmp_path, capsys):
    argv = model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(one_image_dataset), "--output_dir", str(tmp_path), "--output_name", "hot", *COMMON,
        "--mixed_precision", "fp16", "--grad_guard_preset", "stable", "--learning_rate", "1e-1",  # 100x the above
        "--max_train_steps", "6", "--rewind_every_n_steps", "2", "--save_model_as", "safetensors"]
    try:
        run_trainer("sdxl_train", argv)
        code = 0
    except SystemExit as exited:
        code = exited.code
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert (code, last.split(":")[0]) in ((0, "done"), (1, "failed")), last
    for path in tmp_path.glob("*.safetensors"):  # whatever was written holds finite weights
        assert all(torch.isfinite(tensor).all() for tensor in load_file(path).values()), path


@pytest.mark.parametrize("script, argv, message", [
    ("sdxl_train", ["--block_lr", "1e-5,1e-5"], "--block_lr: 2 value(s) given, SDXL has 23"),
    ("sdxl_train", ["--full_bf16"], "--full_bf16 needs --mixed_precision bf16"),
    ("sdxl_train", ["--fused_backward_pass"], "--fused_backward_pass needs --optimizer_type Adafactor (got AdamW)"),
    ("sdxl_train", ["--fused_backward_pass", "--optimizer_type", "Adafactor", "--gradient_accumulation_steps", "2"],
     "--fused_backward_pass needs --gradient_accumulation_steps 1 (got 2)"),
    ("fine_tune", ["--fused_optimizer_groups", "4", "--gradient_accumulation_steps", "2"],
     "--fused_optimizer_groups 4 needs --gradient_accumulation_steps 1 (got 2)"),
    ("train_db", ["--fused_optimizer_groups", "-1"], "--fused_optimizer_groups must be a whole number >= 1"),
    ("sdxl_train", ["--fused_optimizer_groups", "2", "--debug_inject_grad", "2=nan"],
     "--debug_inject_grad with --fused_optimizer_groups 2: the gradients are applied during the backward"),
    ("sdxl_train", ["--learning_rate", "0"], "nothing would train"),
    ("train_db", ["--learning_rate_te", "-1"], "--learning_rate_te -1.0 must be a number >= 0"),
])
def test_bad_input_is_one_line_exit_2_before_loading(script, argv, message, tmp_path, capsys):
    missing_model = ["--pretrained_model_name_or_path", str(tmp_path / "not_loaded.safetensors"),
                     "--train_data_dir", str(tmp_path), "--output_dir", str(tmp_path / "out")]
    error = train_expecting_user_error(missing_model + argv, capsys, script=script)
    assert message in error


@pytest.mark.slow
def test_train_db_dreambooth_with_regularization_on_sd15(tiny_models, tmp_path):
    from tools.make_demo_dataset import make_demo_dataset

    make_demo_dataset(str(tmp_path / "train"), count=2, size=64, repeats=1)
    make_demo_dataset(str(tmp_path / "reg"), count=2, size=64, repeats=1)
    output_dir = tmp_path / "out"
    run_trainer("train_db", model_args(tiny_models, "sd15") + [
        "--train_data_dir", str(tmp_path / "train"), "--reg_data_dir", str(tmp_path / "reg"),
        "--prior_loss_weight", "0.5", "--output_dir", str(output_dir), "--output_name", "db", *COMMON,
        "--learning_rate", "1e-4", "--max_train_steps", "2", "--save_model_as", "safetensors"])
    saved = load_file(output_dir / "db.safetensors")
    base = load_file(tiny_models["sd15_file"])
    # train_db trains the UNet and the text encoder (kohya's default), the VAE stays
    changed = {key.split(".")[0] + "." + key.split(".")[1] for key in base if key in saved
               and base[key].is_floating_point() and not torch.equal(saved[key], base[key])}
    assert "model.diffusion_model" in changed and "cond_stage_model.transformer" in changed, changed
    assert not any(key.startswith("first_stage_model") for key in changed)


@pytest.mark.slow
def test_stop_text_encoder_training_freezes_it_after_n_steps(tiny_models, demo_dataset, tmp_path, capsys):
    """kohya's train_db.py: the text encoder trains during the first N optimizer steps only (here 1 of 3); the UNet
    all of them. ``--no_token_padding`` is accepted (no effect in kohya v0.11.1 either)."""
    output_dir = tmp_path / "out"
    run_trainer("train_db", model_args(tiny_models, "sd15") + [
        "--train_data_dir", str(demo_dataset), "--output_dir", str(output_dir), "--output_name", "db", *COMMON,
        "--learning_rate", "1e-3", "--learning_rate_te", "1e-3", "--max_train_steps", "3",
        "--stop_text_encoder_training", "1", "--no_token_padding", "--save_every_n_steps", "1",
        "--save_model_as", "safetensors", "--save_precision", "float"])
    assert "stop text encoder training at step 1" in capsys.readouterr().out
    base = load_file(tiny_models["sd15_file"])
    steps = [load_file(output_dir / f"db-step{step:08d}.safetensors") for step in (1, 2)] + [
        load_file(output_dir / "db.safetensors")]

    def changed(before: dict, after: dict, prefix: str) -> bool:
        return any(not torch.equal(after[key], before[key].to(after[key].dtype))
                   for key in after if key.startswith(prefix) and after[key].is_floating_point())

    te, unet = "cond_stage_model.transformer.", "model.diffusion_model."
    assert changed(base, steps[0], te) and changed(base, steps[0], unet)  # step 1: both train
    for before, after in zip(steps, steps[1:]):  # steps 2 and 3: the UNet only
        assert changed(before, after, unet) and not changed(before, after, te)


def test_text_encoder_stop_follows_the_step_count_back_and_forth():
    """The decision is the step count's at each forward: a resumed run or a rewind to before N trains it again."""
    from types import SimpleNamespace

    from library.trainables.full_model import FullModel, TextEncoderStop

    encoder, unet = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    module = FullModel({"unet": unet, "text_encoder": encoder},
                       {f"{name}.{key}": p for name, model in (("unet", unet), ("text_encoder", encoder))
                        for key, p in model.named_parameters()})
    progress = SimpleNamespace(global_step=0)
    TextEncoderStop.install(module, 2, progress)
    for step, trains in ((0, True), (1, True), (2, False), (5, False), (1, True)):
        progress.global_step = step
        encoder(torch.zeros(1, 2))
        assert all(p.requires_grad == trains for p in encoder.parameters()), step
        assert all(p.requires_grad for p in unet.parameters())


# kohya v0.11.1's options of each full fine-tuner that its LoRA counterpart (sdxl_train_network.py /
# train_network.py) lacks, with kohya's defaults (its parsers dumped by the harness /work/harness_ft_prep).
KOHYA_FULL_MODEL_ONLY = {
    "sdxl_train": {"block_lr": None, "diffusers_xformers": False, "fused_optimizer_groups": None,
                   "learning_rate_te1": None, "learning_rate_te2": None, "train_text_encoder": False,
                   "use_safetensors": False},
    "train_db": {"learning_rate_te": None, "no_token_padding": False, "stop_text_encoder_training": None,
                 "use_safetensors": False},
    "fine_tune": {"diffusers_xformers": False, "learning_rate_te": None, "train_text_encoder": False,
                  "use_safetensors": False},
}


@pytest.mark.parametrize("script", sorted(KOHYA_FULL_MODEL_ONLY))
def test_kohya_full_model_options_are_where_kohya_defines_them(script):
    import importlib

    parser = importlib.import_module(script).setup_parser()
    defaults = {action.dest: action.default for action in parser._actions}
    own = KOHYA_FULL_MODEL_ONLY[script]
    assert {dest: defaults.get(dest, "missing") for dest in own} == own
    # not where kohya has none (--fused_optimizer_groups: SD 1.x's parsers accept it too, library/fused_backward.py)
    others = set().union(*KOHYA_FULL_MODEL_ONLY.values()) - set(own) - {"use_safetensors", "fused_optimizer_groups"}
    assert not others & set(defaults), others & set(defaults)


def test_diffusers_xformers_without_cuda_says_it_uses_sdpa():
    from diffusers import AutoencoderKL

    from library import compatibility

    vae = AutoencoderKL(block_out_channels=(8,), norm_num_groups=8, latent_channels=4, sample_size=16)
    lines: list[str] = []
    assert compatibility.select_diffusers_xformers(False, vae, "cpu", lines.append) == "sdpa" and not lines
    assert compatibility.select_diffusers_xformers(True, vae, "cpu", lines.append) == "sdpa"
    assert lines == ["--diffusers_xformers: xformers needs a CUDA device; using torch's scaled_dot_product_attention "
                     "instead"]


@pytest.mark.slow
@pytest.mark.parametrize("save_model_as, best_name", [(None, "ft-best.ckpt"), ("diffusers", "ft-best")])
def test_best_checkpoint_is_written_in_the_full_models_format(save_model_as, best_name, tiny_models, demo_dataset,
                                                               tmp_path, capsys):
    """The ``-best`` file of a full model is the run's model format (kohya's rule without --save_model_as: the
    single-file base's form, ``.ckpt``; ``diffusers``: a folder), and an early stop copies it over the final one."""
    output_dir = tmp_path / "out"
    run_trainer("sdxl_train", model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(demo_dataset), "--output_dir", str(output_dir), "--output_name", "ft", *COMMON,
        "--learning_rate", "1e-4", "--max_train_steps", "4", "--validation_split", "0.5",
        "--validate_every_n_steps", "1", "--early_stop_patience", "1", "--best_checkpoint_margin", "0.9",
        "--diffusers_xformers"] + (["--save_model_as", save_model_as] if save_model_as else []))
    out = capsys.readouterr().out
    assert "--diffusers_xformers: xformers needs a CUDA device" in out
    assert "--early_stop_patience 1 reached" in out
    best = output_dir / best_name
    final = output_dir / best_name.replace("-best", "")
    assert best.exists() and final.exists(), sorted(p.name for p in output_dir.iterdir())
    assert not list(output_dir.glob("*.None")) and not list(output_dir.glob("*.diffusers"))
    if best.is_dir():
        files = sorted(p.relative_to(best) for p in best.rglob("*") if p.is_file())
        assert files and files == sorted(p.relative_to(final) for p in final.rglob("*") if p.is_file())
        assert all((best / name).read_bytes() == (final / name).read_bytes() for name in files)
    else:
        assert best.read_bytes() == final.read_bytes()
