"""Careless users, fourth sweep (issue 29, the trainer's findings): each mistake is one line naming the
flag or file and what is valid (exit code 2), before the model is loaded where it can be known then,
and nothing good on disk is replaced by an untrained LoRA."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from conftest import run_trainer, train_expecting_user_error
from PIL import Image
from test_bad_input import output_dir  # noqa: F401  (the fixture: an output folder holding an earlier LoRA)
from test_bad_input import base_args, run_expecting_user_error, unloadable_model_args
from test_healing import train  # (exit code, stdout) of an in-process sdxl training

import train_network
from library import config_file
from library.errors import UserError

REPO = Path(__file__).resolve().parent.parent


def early_argv(tiny_models, dataset: Path, output_dir: Path, tmp_path: Path) -> list[str]:
    """A run whose model fails as soon as it is loaded: a refusal naming something else came before the load."""
    return unloadable_model_args(tiny_models, tmp_path) + base_args(tiny_models, dataset, output_dir)[4:]


def transparent_dataset(root: Path, alpha: int) -> Path:
    """A DreamBooth folder (``1_sks``) of two 64 px RGBA images whose alpha is ``alpha`` everywhere."""
    folder = root / "1_sks"
    folder.mkdir(parents=True)
    for index in range(2):
        pixels = np.full((64, 64, 4), 120, dtype=np.uint8)
        pixels[..., 3] = alpha
        Image.fromarray(pixels, "RGBA").save(folder / f"img{index}.png")
        (folder / f"img{index}.txt").write_text("sks", encoding="utf-8")
    return root


# -- refused before the model loads ----------------------------------------------------------------
def test_mistakes_are_refused_before_the_model_loads(tiny_models, demo_dataset, output_dir, capsys, tmp_path):
    argv = early_argv(tiny_models, demo_dataset, output_dir, tmp_path)
    no_alpha_config = tmp_path / "dataset.toml"
    no_alpha_config.write_text(f"[[datasets]]\nresolution = 64\n[[datasets.subsets]]\nimage_dir = '{demo_dataset / '1_shape'}'\n"
                               f"caption_extension = '.txt'\n", encoding="utf-8")
    cases = [
        # the average would never update: every file the untrained LoRA, exit 0
        (["--ema_decay", "0.9", "--ema_update_every", "5"],
         "--ema_update_every 5: the run trains 2 optimizer steps, so the average would never update"),
        (["--max_train_epochs", "1", "--ema_decay", "0.9", "--ema_update_every", "5"],  # 4 images: 4 steps
         "--ema_update_every 5: the run trains 4 optimizer steps"),
        # rewind options while rewinding is off (the EMA's options refuse the same mistake)
        (["--rewind_lr_factor", "0.5"], "--rewind_lr_factor shapes the rewinds of --rewind_on_divergence, which is off"),
        (["--grad_guard_preset", "stable", "--no-rewind_on_divergence", "--max_rewinds", "3"],
         "--max_rewinds shapes the rewinds"),
        # a name no image has injects nothing
        (["--debug_inject_sample", "nomatch.png=nan"],
         "--debug_inject_sample nomatch.png=...: no image of the training set is named nomatch.png"),
        # masks promised, none configured
        (["--train_data_dir", "", "--dataset_config", str(no_alpha_config), "--masked_loss"],
         f"--masked_loss: no subset of --dataset_config {no_alpha_config} sets alpha_mask = true"),
    ]
    for flags, expected in cases:
        message = run_expecting_user_error(capsys, argv + flags, output_dir)
        assert expected in message, (flags, message)
    # the same run without a mistake gets as far as the model (so the cases above were refused before it)
    assert "unloadable.ckpt" in run_expecting_user_error(capsys, argv, output_dir)


def test_rewind_options_with_rewinding_on_are_accepted(tiny_models, demo_dataset, output_dir, capsys, tmp_path):
    argv = early_argv(tiny_models, demo_dataset, output_dir, tmp_path)
    for flags in (["--rewind_on_divergence", "--rewind_lr_factor", "0.5"],
                  ["--grad_guard_preset", "stable", "--max_rewinds", "3"]):
        assert "unloadable.ckpt" in run_expecting_user_error(capsys, argv + flags, output_dir)


def test_every_alpha_mask_empty_is_refused_before_the_model_loads(tiny_models, output_dir, capsys, tmp_path):
    empty = transparent_dataset(tmp_path / "empty", alpha=0)
    argv = early_argv(tiny_models, empty, output_dir, tmp_path) + ["--masked_loss", "--alpha_mask"]
    message = run_expecting_user_error(capsys, argv, output_dir)
    assert "--masked_loss: the alpha mask of every image is empty (fully transparent, e.g. " in message
    assert "img0.png" in message
    # one visible pixel is enough to train on
    visible = transparent_dataset(tmp_path / "visible", alpha=0)
    pixels = np.asarray(Image.open(visible / "1_sks" / "img1.png")).copy()
    pixels[10, 10, 3] = 255
    Image.fromarray(pixels, "RGBA").save(visible / "1_sks" / "img1.png")
    argv = early_argv(tiny_models, visible, output_dir, tmp_path) + ["--masked_loss", "--alpha_mask"]
    assert "unloadable.ckpt" in run_expecting_user_error(capsys, argv, output_dir)


def test_nan_report_path_taken_by_a_folder_is_refused_before_training(tiny_models, demo_dataset, output_dir, capsys,
                                                                      tmp_path):
    (output_dir / "last-nan_report.txt").mkdir()
    argv = early_argv(tiny_models, demo_dataset, output_dir, tmp_path) + ["--grad_guard_preset", "stable"]
    message = train_expecting_user_error(argv, capsys)
    assert f"--nan_report: {output_dir / 'last-nan_report.txt'}, where the report is written, is a folder" in message
    assert sorted(os.listdir(output_dir)) == ["last-nan_report.txt", "last.safetensors"]


def test_the_same_option_in_two_config_tables_is_refused(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("[model]\nlearning_rate = 1e-3\n[training]\nlearning_rate = 0.5\n", encoding="utf-8")
    with pytest.raises(UserError) as refused:
        config_file.parse_args(train_network.setup_parser(), ["--config_file", str(config)])
    assert str(refused.value) == (f"--config_file {config}: learning_rate is set twice, as model.learning_rate and "
                                  f"as training.learning_rate; keep one of them")
    config.write_text("[model]\nlearning_rate = 1e-3\n[training]\nunet_lr = 0.5\n", encoding="utf-8")
    args, _ = config_file.parse_args(train_network.setup_parser(), ["--config_file", str(config)])
    assert (args.learning_rate, args.unet_lr) == (1e-3, 0.5)


# -- resume: a state that cannot fit is refused before the model loads; one setting spelled two ways fits --------
@pytest.fixture(scope="module")
def trained_state(tiny_models, demo_dataset, tmp_path_factory) -> tuple[list[str], Path]:
    """(the run's flags, its final state folder): a 1-step tiny SDXL run with --save_state."""
    output = tmp_path_factory.mktemp("state_run")
    argv = base_args(tiny_models, demo_dataset, output) + ["--max_train_steps", "1", "--save_state", "--seed", "1",
                                                           "--optimizer_type", "AdamW"]
    run_trainer("sdxl_train_network", argv)
    return argv, output / "last-state"


@pytest.fixture
def no_model_load(monkeypatch):
    """Loading the model is a user error naming it: a refusal that names something else came before the load
    (a state's model is protected by name and size, so an unloadable stand-in cannot be used)."""
    def refuse(*args, **kwargs):
        raise UserError("the model was loaded")
    monkeypatch.setattr(train_network.NetworkTrainer, "load_models", refuse)


def resume_argv(trained_state, output_dir: Path) -> list[str]:
    """The state's run resumed into ``output_dir``."""
    argv, state = trained_state
    argv = list(argv)
    argv[argv.index("--output_dir") + 1] = str(output_dir)
    return argv + ["--resume", str(state)]


def test_a_state_that_cannot_fit_the_network_is_refused_before_the_model_loads(trained_state, output_dir, capsys,
                                                                              no_model_load):
    argv = resume_argv(trained_state, output_dir)
    state = trained_state[1]
    cases = [
        (["--network_dim", "8"], "the state was written with network_dim=None, this run has network_dim=8"),
        (["--network_module", "networks.lokr"], "network_module='networks.lora', this run has "
                                                "network_module='networks.lokr'"),
        (["--network_args", "conv_dim=4"], "network_args=[], this run has network_args=['conv_dim=4']"),
        (["--network_train_unet_only"], "network_train_unet_only=False"),
    ]
    for flags, expected in cases:
        message = run_expecting_user_error(capsys, argv + flags, output_dir)
        assert message.startswith(f"error: --resume {state}: ") and expected in message, (flags, message)
    assert run_expecting_user_error(capsys, argv, output_dir) == "error: the model was loaded"


def test_one_setting_spelled_two_ways_resumes(trained_state, output_dir, capsys, no_model_load):
    argv = resume_argv(trained_state, output_dir)
    for flag, value in (("--resolution", "64,64"), ("--optimizer_type", "adamw")):
        spelled = list(argv)
        spelled[spelled.index(flag) + 1] = value
        assert run_expecting_user_error(capsys, spelled, output_dir) == "error: the model was loaded", (flag, value)


# -- a kohya-ss state: what its files tell is refused before the model loads --------------------------
def kohya_state_folder(folder: Path, keys: dict[str, tuple[int, ...]], step: str = '{"current_epoch": 1, '
                       '"current_step": 2}', optimizer: bytes | None = None) -> Path:
    """A kohya-ss state folder: ``model.safetensors`` holding zero tensors of ``keys``' shapes, train_state.json
    holding ``step``, and an ``optimizer.bin`` (torch.save of an empty optimizer state unless given)."""
    import io

    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({key: torch.zeros(shape) for key, shape in keys.items()}, str(folder / "model.safetensors"))
    (folder / "train_state.json").write_text(step, encoding="utf-8")
    if optimizer is None:
        buffer = io.BytesIO()
        torch.save({"state": {}, "param_groups": []}, buffer)
        optimizer = buffer.getvalue()
    (folder / "optimizer.bin").write_bytes(optimizer)
    return folder


SD_MODULE = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"


def sd_lora_keys(rank: int) -> dict[str, tuple[int, ...]]:
    return {f"{SD_MODULE}.lora_down.weight": (rank, 32), f"{SD_MODULE}.lora_up.weight": (32, rank),
            f"{SD_MODULE}.alpha": ()}


def test_a_kohya_state_that_cannot_fit_is_refused_before_the_model_loads(tiny_models, demo_dataset, output_dir,
                                                                         capsys, tmp_path, no_model_load):
    from conftest import model_args

    argv = model_args(tiny_models, "sd15") + base_args(tiny_models, demo_dataset, output_dir)[4:] + [
        "--network_dim", "4"]
    sdxl_module = "lora_te1_text_model_encoder_layers_0_self_attn_q_proj"
    good_optimizer = (kohya_state_folder(tmp_path / "probe", {}) / "optimizer.bin").read_bytes()
    cases = [
        (kohya_state_folder(tmp_path / "rank8", sd_lora_keys(8)),
         "(model.safetensors): its LoRA has rank 8, this run --network_dim 4"),
        (kohya_state_folder(tmp_path / "sdxl", {f"{sdxl_module}.lora_down.weight": (4, 32)}),
         "(model.safetensors): a kohya-ss state of an SDXL LoRA; continue it with sdxl_train_network.py"),
        (kohya_state_folder(tmp_path / "cut", sd_lora_keys(4), step='{"current_epoch": 1, "curr'),
         "train_state.json is unreadable"),
        (kohya_state_folder(tmp_path / "damaged", sd_lora_keys(4), optimizer=good_optimizer[:-40]),
         "optimizer.bin is damaged (not a torch.save archive"),
        (kohya_state_folder(tmp_path / "flipped", sd_lora_keys(4), optimizer=good_optimizer.replace(
            b"param_groups", b"param_grOups")), "optimizer.bin is damaged (checksum mismatch in "),
    ]
    for state, expected in cases:
        message = train_expecting_user_error(argv + ["--resume", str(state)], capsys, script="train_network")
        assert message.startswith(f"error: --resume {state}") and expected in message, (state, message)
    fitting = kohya_state_folder(tmp_path / "fits", sd_lora_keys(4))
    message = train_expecting_user_error(argv + ["--resume", str(fitting)], capsys, script="train_network")
    assert message == "error: the model was loaded"
    assert sorted(os.listdir(output_dir)) == ["last.safetensors"]


# -- nothing good on disk is replaced by untrained weights -------------------------------------------------
def test_an_ema_that_never_updated_is_not_saved(tiny_models, demo_dataset, output_dir, capsys):
    (output_dir / "last-step00000001.safetensors").write_bytes(b"earlier run")
    argv = base_args(tiny_models, demo_dataset, output_dir) + ["--ema_decay", "0.9", "--ema_update_every", "2",
                                                               "--save_every_n_steps", "1", "--seed", "3"]
    code, output = train(argv, capsys)
    assert code == 0
    assert (f"not saving {output_dir / 'last-step00000001.safetensors'}: the EMA has not updated yet (its first "
            f"update is after 2 trained steps, --ema_update_every)") in output
    assert (output_dir / "last-step00000001.safetensors").read_bytes() == b"earlier run"
    assert (output_dir / "last-step00000002.safetensors").is_file() and (output_dir / "last.safetensors").is_file()


def test_a_run_stopped_by_the_quarantine_limit_replaces_nothing_and_says_so(tiny_models, demo_dataset, output_dir,
                                                                            capsys):
    earlier_state = output_dir / "last-step00000001-state"
    earlier_state.mkdir()
    (earlier_state / "manifest.json").write_text("{}", encoding="utf-8")
    (output_dir / "last-step00000001.safetensors").write_bytes(b"earlier run")
    every_image = [f"{index:03d}.png=nan" for index in range(4)]
    argv = base_args(tiny_models, demo_dataset, output_dir) + [
        "--max_train_steps", "4", "--quarantine_bad_samples", "--save_every_n_steps", "1", "--save_state",
        "--seed", "3", "--debug_inject_sample", *every_image]
    code, output = train(argv, capsys)
    final = output.strip().splitlines()[-1]
    assert code == 1 and final.startswith("failed: step 3: 3 of 4 images quarantined"), final
    # fp32: the VAE is no suspect; the quarantine lines name the images
    assert "with the VAE in float32" in final and "--no_half_vae" not in final
    assert "no last healthy weights written" in final and "this run wrote no other LoRA file" in final
    assert (f"not saving {output_dir / 'last-step00000001.safetensors'}: it would hold the initial, untrained LoRA "
            f"(no optimizer step of this run has trained it") in output
    assert "not saving state last-step00000001-state: it would hold the initial, untrained LoRA" in output
    assert (output_dir / "last-step00000001.safetensors").read_bytes() == b"earlier run"
    assert os.listdir(earlier_state) == ["manifest.json"]
    assert not (output_dir / "last-step00000002.safetensors").exists()


def test_files_of_a_span_a_rewind_abandons_are_renamed_and_named(tiny_models, demo_dataset, output_dir, capsys):
    """One image in four has NaN latents and a step of it alone counts as divergence: each rewind goes back
    to the initial healthy point, abandoning the files saved since."""
    argv = base_args(tiny_models, demo_dataset, output_dir) + [
        "--max_train_steps", "4", "--rewind_on_divergence", "--divergence_nan_steps", "1",
        "--rewind_every_n_steps", "100", "--save_every_n_steps", "1", "--seed", "3",
        "--debug_inject_sample", "002.png=nan"]
    code, output = train(argv, capsys)
    rewinds = [line for line in output.splitlines() if ": rewound to the healthy point of step 0" in line]
    assert rewinds, output
    renamed = [name for line in rewinds if "the files of the diverged span are renamed: " in line
               for name in line.split("the files of the diverged span are renamed: ")[1].split(", ")]
    assert renamed, rewinds
    for path in renamed:
        assert path.endswith("-abandoned.safetensors") and os.path.isfile(path)
        assert not os.path.exists(path.replace("-abandoned", ""))


# -- NaN in a latent cache file is refused naming the file, as the VAE's own NaN latents are --------------
@pytest.mark.parametrize("written_by", ["ours", "kohya"])
def test_a_latent_cache_holding_nan_is_refused_naming_it(written_by, tiny_models, tmp_path):
    from test_datasets import dataset_from
    from test_datasets_cache import image_folder

    from library import model_loading
    from library.datasets import latents

    vae = model_loading.load_models(str(tiny_models["sdxl"]), sdxl=True).vae
    args = image_folder(tmp_path)
    latents.cache_latents(dataset_from(*args).plan.images, vae, to_disk=True, is_sdxl=True)
    path = tmp_path / "data" / "2_x" / "0_0064x0064_sdxl.npz"
    with np.load(path) as npz:
        arrays = {key: npz[key] for key in npz.files}
    arrays["latents_8x8"][0, 0, 0] = np.nan  # kohya v0.11.1's keys: suffixed with the latent size
    if written_by == "kohya":  # kohya's files: one fixed sample, no metadata
        arrays = {key: value for key, value in arrays.items() if not key.startswith(("cache_meta", "latents_std"))}
    np.savez(path, **arrays)
    with pytest.raises(UserError) as refused:
        latents.cache_latents(dataset_from(*args).plan.images, vae, to_disk=True, is_sdxl=True)
    assert str(refused.value) == (f"latent cache {path} (of {tmp_path / 'data' / '2_x' / '0.png'}) holds NaN or Inf "
                                  f"latents: delete it so that it is rebuilt (and pass --no_half_vae if the VAE that "
                                  f"wrote it overflowed in half precision)")
