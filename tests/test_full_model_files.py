"""library.full_model_files: a trained full model saved as kohya's fine-tuning scripts save it.

What must hold: every format loads in diffusers to exactly the weights in memory (cast to --save_precision),
.ckpt/.safetensors carry kohya's layout, counters, base-file tensors and metadata, folders load with
from_pretrained, kohya's names and format rule, and a failed save leaves the previous one.

ComfyUI (checked outside the project, harness /work/harness_full_ckpt: make_checkpoints.py writes the
tiny SDXL and SD1.5, perturbed, with ``save_model`` as .safetensors and .ckpt in float, fp16 and bf16;
comfy_ckpt_check.py loads each with ComfyUI a125cd84's ``load_state_dict_guess_config`` (model config from
its own ``detect_unet_config``, its hard-coded VAE architecture given the tiny sizes, token tables padded
to 49408 rows, everything in fp32): all 12 files load with no key left over, and every UNet, VAE and CLIP
parameter ComfyUI holds equals the in-memory weight cast to the file's precision exactly (SDXL 858 UNet+VAE
and 105 CLIP tensors, SD1.5 928 and 52, 0 mismatched; the same files compared at the wrong precision:
963 of 963 mismatched). The tests below assert the same equality through diffusers' loader.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from library import atomic_files, checkpoint_files, checkpoint_keys as ck, full_model_files as fm
from library import model_loading as ml
from library.errors import DiskFull, UserError

KINDS = {"sdxl": "sdxl", "sd15": "sd1", "sd2": "sd2"}
PRECISIONS = {"float": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def trained(tiny_models, name: str) -> ml.StableDiffusionModels:
    """The tiny model from its single file with every floating parameter moved (as training would)."""
    models = ml.load_models(tiny_models[f"{name}_file"], sdxl=name == "sdxl", v2=name == "sd2",
                            model_config_dir=tiny_models[f"{name}_config"])
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for module in (models.unet, models.vae, *models.text_encoders):
            for parameter in module.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 1e-3)
    return models


class TrainedModels(dict):
    """Each kind's :func:`trained` models, loaded when first asked for (a -k selection loads only what it uses)."""

    def __init__(self, tiny_models):
        super().__init__()
        self.tiny_models = tiny_models

    def __missing__(self, name: str) -> ml.StableDiffusionModels:
        self[name] = trained(self.tiny_models, name)
        return self[name]


@pytest.fixture(scope="module")
def trained_models(tiny_models):
    return TrainedModels(tiny_models)


def components(models) -> dict[str, torch.nn.Module]:
    named = {"unet": models.unet, "vae": models.vae, "text_encoder": models.text_encoders[0]}
    if len(models.text_encoders) > 1:
        named["text_encoder_2"] = models.text_encoders[1]
    return named


def assert_loaded_equal(expected_models, loaded: dict[str, torch.nn.Module], dtype: torch.dtype) -> int:
    """Every tensor of every component of ``loaded`` equals the in-memory one cast to ``dtype``; returns the count."""
    compared = 0
    for name, model in components(expected_models).items():
        theirs = loaded[name].state_dict()
        for key, value in model.state_dict().items():
            expected = value.to(dtype) if value.is_floating_point() else value
            assert theirs[key].dtype == expected.dtype, f"{name}.{key}"
            assert torch.equal(theirs[key], expected), f"{name}.{key} differs"
            compared += 1
    return compared


def load_single_file(name: str, path: Path, tiny_models, dtype: torch.dtype):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    pipeline_class = StableDiffusionXLPipeline if name == "sdxl" else StableDiffusionPipeline
    pipeline = pipeline_class.from_single_file(str(path), config=str(tiny_models[f"{name}_config"]),
                                               local_files_only=True, torch_dtype=dtype)
    names = ["unet", "vae", "text_encoder"] + (["text_encoder_2"] if name == "sdxl" else [])
    return {component: getattr(pipeline, component) for component in names}


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", KINDS)
def test_single_file_loads_in_diffusers_as_the_weights_in_memory(name, precision, trained_models, tiny_models, tmp_path):
    models = trained_models[name]
    dtype = PRECISIONS[precision]
    model_format = fm.ModelFormat.resolve("safetensors", False, base_is_single_file=False)
    path = tmp_path / fm.final_model_name("mine", model_format)
    fm.save_model(models, path, model_format, fm.save_dtype(precision), metadata={"modelspec.title": "mine"})
    assert path.name == "mine.safetensors" and not list(tmp_path.glob(".*"))
    count = assert_loaded_equal(models, load_single_file(name, path, tiny_models, dtype), dtype)
    assert count == sum(len(m.state_dict()) for m in components(models).values())
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"modelspec.title": "mine"}
        assert {handle.get_slice(key).get_dtype() for key in handle.keys()} == {
            {"float": "F32", "fp16": "F16", "bf16": "BF16"}[precision]}


@pytest.mark.parametrize("name", KINDS)
def test_ckpt_is_kohyas_torch_save_with_counters(name, trained_models, tiny_models, tmp_path):
    """kohya's .ckpt: {"state_dict", "epoch", "global_step"}, the base .ckpt's counters added; diffusers reads it."""
    models = trained_models[name]
    base = tmp_path / "base.ckpt"
    with safe_open(str(tiny_models[f"{name}_file"]), framework="pt") as handle:
        base_state = {key: handle.get_tensor(key) for key in handle.keys()}
    torch.save({"state_dict": base_state, "epoch": 2, "global_step": 40}, base)
    source = checkpoint_files.read_source_checkpoint(base, models)
    model_format = fm.ModelFormat.resolve(None, False, base_is_single_file=True)
    path = tmp_path / fm.epoch_model_name(None, 3, model_format)
    assert path.name == "epoch-000003.ckpt"
    fm.save_model(models, path, model_format, torch.float16, metadata={"ignored": "ckpt has none"}, epoch=3,
                  global_step=30, source=source)
    saved = torch.load(path, weights_only=True)
    assert set(saved) == {"state_dict", "epoch", "global_step"}
    assert (saved["epoch"], saved["global_step"]) == (5, 70)
    assert set(saved["state_dict"]) == set(base_state)
    assert_loaded_equal(models, load_single_file(name, path, tiny_models, torch.float16), torch.float16)


def test_base_file_tensors_are_carried_as_kohya_carries_them(trained_models, tiny_models, tmp_path):
    """SD 1.x/2.x: every base tensor without a place in the model (EMA, schedule buffers) is written unchanged;
    SDXL: only OpenCLIP's logit_scale."""
    for name, extras in (("sd15", {"model_ema.decay": torch.tensor(0.9999), "betas": torch.linspace(0, 1, 1000,
                                                                                                     dtype=torch.float64)}),
                         ("sdxl", {ck.SDXL_OPEN_CLIP_PREFIX + "logit_scale": torch.tensor(4.6052),
                                   "model_ema.decay": torch.tensor(0.9999)})):
        with safe_open(str(tiny_models[f"{name}_file"]), framework="pt") as handle:
            state = {key: handle.get_tensor(key) for key in handle.keys()}
        base = tmp_path / f"{name}_base.safetensors"
        save_file({**state, **extras}, str(base))
        models = trained_models[name]
        source = checkpoint_files.read_source_checkpoint(base, models)
        carried = {"sd15": set(extras), "sdxl": {ck.SDXL_OPEN_CLIP_PREFIX + "logit_scale"}}[name]
        assert set(source.extra_tensors) == carried and (source.epoch, source.global_step) == (0, 0)
        out = tmp_path / f"{name}_out.safetensors"
        fm.save_model(models, out, fm.ModelFormat(True, True), torch.bfloat16, source=source)
        with safe_open(str(out), framework="pt") as handle:
            assert set(handle.keys()) == set(state) | carried
            for key in carried:  # unchanged, not cast
                assert torch.equal(handle.get_tensor(key), extras[key])
        reloaded = components(ml.load_models(out, sdxl=name == "sdxl", v2=name == "sd2",
                                             model_config_dir=tiny_models[f"{name}_config"]))
        for component, model in components(models).items():
            theirs = reloaded[component].state_dict()
            assert all(torch.equal(theirs[key], value.to(torch.bfloat16).float())
                       for key, value in model.state_dict().items() if value.is_floating_point())
    assert checkpoint_files.read_source_checkpoint(tiny_models["sdxl"], trained_models["sdxl"]) == \
        checkpoint_files.SourceCheckpoint()


@pytest.mark.parametrize("save_model_as", ["diffusers", "diffusers_safetensors"])
@pytest.mark.parametrize("name", KINDS)
def test_diffusers_folder_loads_with_from_pretrained(name, save_model_as, trained_models, tmp_path):
    from diffusers import DiffusionPipeline

    models = trained_models[name]
    model_format = fm.ModelFormat.resolve(save_model_as, False, base_is_single_file=True)
    path = tmp_path / fm.step_model_name("run", 12, model_format)
    assert path.name == "run-step00000012"
    fm.save_model(models, path, model_format, torch.float16)
    weights = {p.name for p in path.rglob("*") if p.suffix in (".bin", ".safetensors")}
    assert weights == ({"diffusion_pytorch_model.safetensors", "model.safetensors"} if model_format.safetensors
                       else {"diffusion_pytorch_model.bin", "pytorch_model.bin"})
    pipeline = DiffusionPipeline.from_pretrained(path, local_files_only=True, torch_dtype=torch.float16)
    assert type(pipeline).__name__ == ("StableDiffusionXLPipeline" if name == "sdxl" else "StableDiffusionPipeline")
    assert type(pipeline.scheduler).__name__ == ("EulerDiscreteScheduler" if name == "sdxl" else "DDIMScheduler")
    assert_loaded_equal(models, {c: getattr(pipeline, c) for c in components(models)}, torch.float16)
    assert [t("a cat").input_ids for t in models.tokenizers] == \
        [t("a cat").input_ids for t in [pipeline.tokenizer] + ([pipeline.tokenizer_2] if name == "sdxl" else [])]
    # the models in memory were not cast by saving (kohya's SDXL saver casts them in place)
    assert all(p.dtype == torch.float32 for m in components(models).values() for p in m.parameters())


def test_format_rule_and_names_follow_kohya():
    """train_util / sdxl_train.py: --save_model_as decides, else the base's form; safetensors by name or
    --use_safetensors; epoch/step/last names with kohya's defaults (epoch, at, last)."""
    resolve = fm.ModelFormat.resolve
    assert resolve(None, False, True) == fm.ModelFormat(True, False)
    assert resolve(None, True, True) == fm.ModelFormat(True, True)
    assert resolve(None, False, False) == fm.ModelFormat(False, False)
    assert resolve(None, True, False) == fm.ModelFormat(False, True)
    assert resolve("ckpt", False, False) == fm.ModelFormat(True, False)
    assert resolve("ckpt", True, False) == fm.ModelFormat(True, True)  # kohya: --use_safetensors wins
    assert resolve("safetensors", False, False) == fm.ModelFormat(True, True)
    assert resolve("diffusers", False, True) == fm.ModelFormat(False, False)
    assert resolve("diffusers_safetensors", False, True) == fm.ModelFormat(False, True)
    single = fm.ModelFormat(True, True)
    assert fm.epoch_model_name(None, 1, single) == "epoch-000001.safetensors"
    assert fm.step_model_name(None, 500, fm.ModelFormat(True, False)) == "at-step00000500.ckpt"
    assert fm.final_model_name(None, fm.ModelFormat(False, True)) == "last"
    assert fm.epoch_model_name("x", 12, fm.ModelFormat(False, False)) == "x-000012"
    parser = argparse.ArgumentParser()
    fm.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.save_model_as, args.use_safetensors, args.save_precision) == (None, False, None)
    with pytest.raises(SystemExit):
        parser.parse_args(["--save_model_as", "pt"])


def test_checkpoint_metadata_is_a_checkpoints_model_spec():
    args = argparse.Namespace(output_name=None, v_parameterization=False, metadata_title="Mine", metadata_author="me")
    metadata = fm.checkpoint_metadata(args, "sdxl", (1024, 1024), 0.0)
    assert metadata["modelspec.architecture"] == "stable-diffusion-xl-v1-base"
    assert metadata["modelspec.implementation"] == "https://github.com/Stability-AI/generative-models"
    assert (metadata["modelspec.title"], metadata["modelspec.author"]) == ("Mine", "me")
    assert not any(key.startswith("ss_") for key in metadata)
    args = argparse.Namespace(output_name=None, v_parameterization=True)
    metadata = fm.checkpoint_metadata(args, "sd2", (768, 768), 0.0)
    assert metadata["modelspec.architecture"] == "stable-diffusion-v2-768-v"
    assert metadata["modelspec.title"] == "Checkpoint@0.0" and metadata["modelspec.prediction_type"] == "v"


@pytest.mark.parametrize("save_model_as", ["safetensors", "ckpt", "diffusers_safetensors"])
def test_a_save_that_fails_leaves_the_previous_one(save_model_as, trained_models, tmp_path):
    models = trained_models["sd15"]
    model_format = fm.ModelFormat.resolve(save_model_as, False, base_is_single_file=True)
    path = tmp_path / fm.final_model_name("m", model_format)
    fm.save_model(models, path, model_format, torch.float16)
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    atomic_files.simulate_full_disk(1000)
    try:
        with pytest.raises(DiskFull):
            fm.save_model(models, path, model_format, None)
    finally:
        atomic_files.simulate_full_disk(None)
    after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before
    assert fm.remove_model(path) and not path.exists() and not fm.remove_model(path)


def test_only_single_file_suffixes_and_whole_models(trained_models, tmp_path):
    with pytest.raises(UserError, match="single files"):
        fm.save_model(trained_models["sd15"], tmp_path / "m.pt", fm.ModelFormat(True, True))
    import dataclasses

    without_vae = dataclasses.replace(trained_models["sd15"], vae=None)
    with pytest.raises(ValueError, match="VAE and text encoders"):
        fm.save_model(without_vae, tmp_path / "m.safetensors", fm.ModelFormat(True, True))
    assert not list(tmp_path.iterdir())


def test_saver_names_counts_and_rotates_as_kohya(trained_models, tmp_path):
    """Epoch saves every 2 epochs keeping 2 (kohya removes epoch E - 2*2), step saves every 3 steps keeping the
    last 6 steps (removes S - 6 - 1 rounded down to a multiple of 3), .ckpt counters as kohya passes them."""
    models = trained_models["sd15"]
    saver = fm.ModelSaver(tmp_path, None, fm.ModelFormat(True, False), torch.float16,
                          save_every_n_epochs=2, save_last_n_epochs=2, save_every_n_steps=3, save_last_n_steps=6)
    for epoch in (2, 4, 6):
        saver.save_epoch(models, epoch, epoch * 10)
    for step in (3, 6, 9, 12):
        saver.save_step(models, step, step // 5)
    final = saver.save_final(models, 5, 60)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "at-step00000006.ckpt", "at-step00000009.ckpt", "at-step00000012.ckpt",
        "epoch-000004.ckpt", "epoch-000006.ckpt", "last.ckpt"]
    counters = lambda name: (lambda c: (c["epoch"], c["global_step"]))(torch.load(tmp_path / name, weights_only=True))  # noqa: E731
    assert counters("epoch-000006.ckpt") == (6, 60) and counters("at-step00000012.ckpt") == (2, 12)
    assert counters(final.name) == (5, 60)
    folders = fm.ModelSaver(tmp_path / "folders", "run", fm.ModelFormat(False, True), save_last_n_steps=1,
                            save_every_n_steps=1)
    for step in (1, 2, 3):
        folders.save_step(models, step, 0)
    assert sorted(p.name for p in (tmp_path / "folders").iterdir()) == ["run-step00000002", "run-step00000003"]
