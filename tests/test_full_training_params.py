"""library.full_training_params: kohya's optimizer groups, --block_lr and dtypes for full fine-tuning.

The --block_lr assignment and the TE1 freeze are compared with kohya's own functions run on kohya's own
model classes (harness /work/harness_full_ckpt/kohya_param_groups.py in kohya's venv: sdxl_train's
get_block_params_to_optimize and append_block_lr_to_logs on SdxlUNet2DConditionModel built on the meta
device, the TE1 freeze lines on transformers' CLIPTextModel with SDXL's CLIP-L config), recorded in
tests/data/kohya_sdxl_block_lr.json: per group its lr, parameter count and the SHA-256 of its sorted names,
the logged names, TE1's frozen names. Ours run on the real SDXL architecture (the shipped diffusers config,
meta device), names translated to the original layout kohya's model uses.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest
import torch

from library import checkpoint_keys as ck
from library import full_training_params as ftp
from library import model_loading as ml
from library.errors import UserError

KOHYA = json.loads((Path(__file__).parent / "data" / "kohya_sdxl_block_lr.json").read_text())


def digest(names) -> str:
    return hashlib.sha256("\n".join(sorted(names)).encode()).hexdigest()


@pytest.fixture(scope="module")
def full_size_sdxl() -> ml.StableDiffusionModels:
    """The real SDXL architecture (the shipped diffusers configs) on the meta device: no memory, seconds."""
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    configs = ml.shipped_config_dir("sdxl")
    read = lambda sub: json.loads((configs / sub / "config.json").read_text())  # noqa: E731
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(read("unet"))
        encoders = [CLIPTextModel(CLIPTextConfig(**read("text_encoder"))),
                    CLIPTextModelWithProjection(CLIPTextConfig(**read("text_encoder_2")))]
    return ml.StableDiffusionModels("sdxl", [], encoders, None, unet, {}, "sdxl_meta")


@pytest.mark.parametrize("label", ["all", "zeros"])
def test_block_lr_groups_are_kohyas(label, full_size_sdxl):
    expected = KOHYA[label]
    parts = ftp.TrainedParts.resolve("sdxl_train", 1e-5, train_text_encoder=True, learning_rate_te1=0.5,
                                     learning_rate_te2=0.25,
                                     block_lr=",".join(str(lr) for lr in expected["block_lrs"]))
    groups = ftp.param_groups(full_size_sdxl, parts)
    table = ck.unet_block_table(full_size_sdxl.unet.config)
    unet_groups = [g for g in groups if g.log_name.startswith("block")]
    ours = [{"lr": g.lr, "count": len(g.params),
             "names_sha256": digest(ck.translate(name.removeprefix("unet."), table) for name in g.params)}
            for g in unet_groups]
    assert ours == expected["groups"]
    assert [g.log_name for g in groups] == expected["log_names"]
    assert [g.lr for g in groups[len(unet_groups):]] == [0.5, 0.25]
    all_unet = [ck.translate(name, table) for name, _ in full_size_sdxl.unet.named_parameters()]
    assert (len(all_unet), digest(all_unet)) == (KOHYA["unet_parameter_count"], KOHYA["unet_parameters_sha256"])


def test_te1_last_layer_and_final_norm_stay_frozen_as_kohya_freezes_them(full_size_sdxl):
    parts = ftp.TrainedParts.resolve("sdxl_train", 1e-5, train_text_encoder=True)
    frozen = ftp.frozen_parameter_names(full_size_sdxl, parts)
    te1 = full_size_sdxl.text_encoders[0]
    inner = "text_model." if hasattr(te1, "text_model") else ""
    assert {f"text_model.{name.removeprefix(inner)}" for name in frozen["text_encoder"]} == set(KOHYA["te1_frozen"])
    assert len(list(te1.named_parameters())) == KOHYA["te1_parameter_count"]
    assert frozen["text_encoder_2"] == set() and frozen["unet"] == set()


def test_resolve_follows_each_scripts_rules():
    resolve = ftp.TrainedParts.resolve
    # sdxl_train: lr 0 freezes; TE lrs default to --learning_rate; --block_lr only when the UNet trains
    assert resolve("sdxl_train", 1e-5) == ftp.TrainedParts(1e-5, (None, None), freeze_te1_last_layer=True)
    parts = resolve("sdxl_train", 0.0, train_text_encoder=True, learning_rate_te2=3e-6, block_lr=",".join(["1"] * 23))
    assert (parts.unet_lr, parts.text_encoder_lrs, parts.block_lrs) == (None, (None, 3e-6), None)
    assert resolve("sdxl_train", 2e-5, train_text_encoder=True, learning_rate_te1=0).text_encoder_lrs == (None, 2e-5)
    # fine_tune: TE only with --train_text_encoder; one group unless --learning_rate_te
    assert resolve("fine_tune", 1e-5, learning_rate_te=1e-6) == ftp.TrainedParts(1e-5, (None,))
    assert resolve("fine_tune", 1e-5, train_text_encoder=True) == ftp.TrainedParts(1e-5, (1e-5,), one_group=True)
    assert resolve("fine_tune", 1e-5, train_text_encoder=True, learning_rate_te=1e-6) == ftp.TrainedParts(1e-5, (1e-6,))
    # train_db: TE trains unless --stop_text_encoder_training is negative
    assert resolve("train_db", 1e-5) == ftp.TrainedParts(1e-5, (1e-5,), one_group=True)
    assert resolve("train_db", 1e-5, stop_text_encoder_training=-1) == ftp.TrainedParts(1e-5, (None,))
    assert resolve("train_db", 1e-5, stop_text_encoder_training=0, learning_rate_te=0.0) == ftp.TrainedParts(1e-5, (0.0,))


@pytest.mark.parametrize("text, message", [("1,2", "2 value"), ("a" + ",1" * 22, "comma-separated numbers")])
def test_bad_block_lr_names_the_flag(text, message):
    with pytest.raises(UserError, match=message) as error:
        ftp.TrainedParts.resolve("sdxl_train", 1e-5, block_lr=text)
    assert str(error.value).startswith("--block_lr")


def test_kohyas_log_names_by_position(full_size_sdxl):
    """kohya names the groups unet, text_encoder1, text_encoder2 by position: TE2 alone is logged as text_encoder1."""
    names = lambda parts: [g.log_name for g in ftp.param_groups(full_size_sdxl, parts)]  # noqa: E731
    resolve = ftp.TrainedParts.resolve
    assert names(resolve("sdxl_train", 1e-5, train_text_encoder=True)) == ["unet", "text_encoder1", "text_encoder2"]
    assert names(resolve("sdxl_train", 1e-5, train_text_encoder=True, learning_rate_te1=0)) == ["unet", "text_encoder1"]
    assert names(resolve("sdxl_train", 0, train_text_encoder=True, learning_rate_te1=1e-6,
                         learning_rate_te2=1e-6)) == ["text_encoder1", "text_encoder2"]


def test_groups_on_sd_take_every_parameter_once(tiny_models):
    models = ml.load_models(tiny_models["sd15"], sdxl=False)
    unet_count = len(list(models.unet.parameters()))
    te_count = len(list(models.text_encoders[0].parameters()))
    one = ftp.param_groups(models, ftp.TrainedParts.resolve("train_db", 1e-5))
    assert [(g.log_name, g.lr, len(g.params)) for g in one] == [("unet", 1e-5, unet_count + te_count)]
    two = ftp.param_groups(models, ftp.TrainedParts.resolve("fine_tune", 1e-5, train_text_encoder=True,
                                                             learning_rate_te=1e-6))
    assert [(g.log_name, g.lr, len(g.params)) for g in two] == [("unet", 1e-5, unet_count),
                                                                ("text_encoder1", 1e-6, te_count)]


def test_a_block_at_lr_zero_does_not_move_and_the_others_do(tiny_models):
    """A real optimizer step on the tiny SDXL: block 0 (time/label embeddings) and TE1's last layer stay put."""
    models = ml.load_models(tiny_models["sdxl"], sdxl=True)
    block_lrs = ["0"] + ["1e-3"] * 22
    parts = ftp.TrainedParts.resolve("sdxl_train", 1e-3, train_text_encoder=True, block_lr=",".join(block_lrs))
    ftp.apply_requires_grad(models, parts)
    groups = ftp.param_groups(models, parts)
    optimizer = torch.optim.SGD([g.for_optimizer() for g in groups])
    before = {name: p.detach().clone() for name, p in models.unet.named_parameters()}
    te1_before = {name: p.detach().clone() for name, p in models.text_encoders[0].named_parameters()}
    all_params = [p for module in (models.unet, *models.text_encoders) for p in module.parameters()]
    for parameter in all_params:
        parameter.grad = torch.ones_like(parameter) if parameter.requires_grad else None
    optimizer.step()
    table = ck.unet_block_table(models.unet.config)
    for name, parameter in models.unet.named_parameters():
        in_block0 = ftp.sdxl_block_index(ck.translate(name, table)) == 0
        assert torch.equal(parameter, before[name]) == in_block0, name
        assert parameter.requires_grad != in_block0
    frozen = ftp.frozen_parameter_names(models, parts)["text_encoder"]
    assert frozen and all(not p.requires_grad for n, p in models.text_encoders[0].named_parameters() if n in frozen)
    for name, parameter in models.text_encoders[0].named_parameters():
        assert torch.equal(parameter, te1_before[name]) == (name in frozen), name
    assert not any(p.requires_grad for p in models.vae.parameters())


def test_model_dtypes_follow_kohya():
    half, bf16, f32 = torch.float16, torch.bfloat16, torch.float32
    sdxl = ftp.TrainedParts.resolve("sdxl_train", 1e-5, train_text_encoder=True, learning_rate_te2=0)
    assert ftp.model_dtypes(sdxl, mixed_precision="fp16") == ftp.ModelDtypes(f32, (f32, half), half)
    assert ftp.model_dtypes(sdxl, mixed_precision="fp16", full_fp16=True) == ftp.ModelDtypes(half, (half, half), half)
    assert ftp.model_dtypes(sdxl, mixed_precision="bf16", full_bf16=True, no_half_vae=True) == \
        ftp.ModelDtypes(bf16, (bf16, bf16), f32)
    frozen_tes = ftp.TrainedParts.resolve("sdxl_train", 1e-5)
    assert ftp.model_dtypes(frozen_tes, mixed_precision="bf16", full_bf16=True, cache_text_encoder_outputs=True) == \
        ftp.ModelDtypes(bf16, (f32, f32), bf16)
    assert ftp.model_dtypes(ftp.TrainedParts.resolve("fine_tune", 1e-5), mixed_precision="no") == \
        ftp.ModelDtypes(f32, (f32,), f32)
    assert ftp.model_dtypes(ftp.TrainedParts.resolve("fine_tune", 1e-5), mixed_precision="fp16") == \
        ftp.ModelDtypes(f32, (half,), half)


@pytest.mark.parametrize("flags, message", [
    (dict(mixed_precision="bf16", full_fp16=True), "--full_fp16 needs --mixed_precision fp16"),
    (dict(mixed_precision="no", full_bf16=True), "--full_bf16 needs --mixed_precision bf16"),
    (dict(mixed_precision="fp16", full_fp16=True, full_bf16=True), "give one of them"),
])
def test_full_precision_without_its_mixed_precision_is_refused(flags, message):
    with pytest.raises(UserError, match=message):
        ftp.model_dtypes(ftp.TrainedParts.resolve("sdxl_train", 1e-5), **flags)


@pytest.mark.parametrize("script, flags", [
    ("sdxl_train", {"train_text_encoder", "learning_rate_te1", "learning_rate_te2", "block_lr"}),
    ("fine_tune", {"train_text_encoder", "learning_rate_te"}),
    ("train_db", {"learning_rate_te", "stop_text_encoder_training"}),
])
def test_each_script_gets_kohyas_options(script, flags):
    parser = argparse.ArgumentParser()
    ftp.add_arguments(parser, script)
    args = vars(parser.parse_args([]))
    assert set(args) == flags
    parsed = argparse.Namespace(learning_rate=1e-5, **args)
    assert ftp.TrainedParts.from_args(parsed, script) == ftp.TrainedParts.resolve(script, 1e-5)
