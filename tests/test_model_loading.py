"""Model loading: diffusers folders, single files (ours and diffusers' reading of them), name maps, errors."""
from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from library import checkpoint_keys as ck
from library import checkpoint_files, clip_tokenizers
from library import model_loading as ml
from library.errors import UserError

# fixture name -> (load_models kwargs)
KINDS = {"sdxl": dict(sdxl=True), "sd15": dict(sdxl=False), "sd2": dict(sdxl=False, v2=True)}


def tensors_of(models: ml.StableDiffusionModels) -> dict[str, torch.Tensor]:
    return dict(checkpoint_files.iter_model_tensors(models))


def assert_identical(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    assert expected.keys() == actual.keys()
    different = [name for name in expected if not torch.equal(expected[name], actual[name])]
    assert not different, f"{len(different)} tensors differ, first {different[0]}"


@pytest.fixture(scope="module")
def folder_models(tiny_models):
    """Each tiny model loaded from its diffusers folder (shared, read-only)."""
    return {name: ml.load_models(tiny_models[name], **kwargs) for name, kwargs in KINDS.items()}


@pytest.mark.parametrize("name", KINDS)
def test_single_file_equals_diffusers_folder(tiny_models, folder_models, name):
    from_file = ml.load_models(tiny_models[f"{name}_file"], model_config_dir=tiny_models[f"{name}_config"],
                               **KINDS[name])
    from_folder = folder_models[name]
    assert_identical(tensors_of(from_folder), tensors_of(from_file))
    assert all(t.dtype == torch.float32 and t.device.type == "cpu"
               for n, t in tensors_of(from_file).items() if t.is_floating_point())
    assert from_file.kind == from_folder.kind
    assert from_file.name == name and from_folder.name == name
    assert from_file.scheduler_config == from_folder.scheduler_config
    assert not from_file.unet.training
    probe = "a photo of a cat!!"
    assert [t(probe).input_ids for t in from_file.tokenizers] == [t(probe).input_ids for t in from_folder.tokenizers]


@pytest.mark.parametrize("source", ["sdxl_file", "sdxl"])
def test_stored_in_dtypes_reads_components_straight_into_their_dtype(tiny_models, source):
    """A full fine-tune's load (``stored_in_dtypes``): the named components' floating tensors come out in
    their dtype, equal to a float32 load cast afterwards (one rounding either way); the others float32."""
    config = {"model_config_dir": tiny_models["sdxl_config"]} if source.endswith("_file") else {}
    dtypes = {"unet": torch.bfloat16, "text_encoder_2": torch.float16, "vae": torch.float32}
    plain = tensors_of(ml.load_models(tiny_models[source], sdxl=True, **config))
    stored = tensors_of(ml.load_models(tiny_models[source], sdxl=True, stored_as=ml.stored_in_dtypes(dtypes),
                                       **config))
    assert plain.keys() == stored.keys()
    for name, tensor in stored.items():
        dtype = dtypes.get(name.partition(".")[0], torch.float32) if tensor.is_floating_point() else plain[name].dtype
        assert tensor.dtype == dtype, name
        assert torch.equal(tensor, plain[name].to(dtype)), name
    assert ml.stored_in_dtypes({"unet": torch.float32}) is None  # nothing to convert: the plain load


@pytest.mark.parametrize("name", KINDS)
def test_diffusers_reads_our_single_file(tiny_models, folder_models, name):
    """diffusers' own converter reads our file to the same weights: the writer uses the real layout."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    pipeline_class = StableDiffusionXLPipeline if name == "sdxl" else StableDiffusionPipeline
    pipeline = pipeline_class.from_single_file(str(tiny_models[f"{name}_file"]),
                                               config=str(tiny_models[f"{name}_config"]), local_files_only=True)
    encoders = [pipeline.text_encoder] + ([pipeline.text_encoder_2] if name == "sdxl" else [])
    theirs = ml.StableDiffusionModels(folder_models[name].kind, [], encoders, pipeline.vae, pipeline.unet, {}, "")
    assert_identical(tensors_of(folder_models[name]), tensors_of(theirs))


def test_sdxl_second_tokenizer_pads_with_bang_but_reads_it_as_text(folder_models):
    first, second = folder_models["sdxl"].tokenizers
    assert second.pad_token == "!" and second.pad_token_id == 0
    prompt = "masterpiece!! a cat!"
    assert first(prompt).input_ids == second(prompt).input_ids  # "!" not cut out as a special token
    padded = second(prompt, padding="max_length", max_length=77).input_ids
    assert len(padded) == 77 and padded[-1] == 0
    assert first.model_max_length == second.model_max_length == 77


def test_tokenizers_from_kohya_cache_dir(tiny_models, folder_models):
    tokenizers = clip_tokenizers.load_tokenizers("sdxl", tokenizer_cache_dir=tiny_models["tokenizers"])
    prompt = "a photo of a cat, best quality!"
    for ours, reference in zip(tokenizers, folder_models["sdxl"].tokenizers):
        assert ours(prompt, padding="max_length", max_length=77).input_ids == \
            reference(prompt, padding="max_length", max_length=77).input_ids
    assert [t.pad_token for t in tokenizers] == ["<|endoftext|>", "!"]
    (sd2_tokenizer,) = clip_tokenizers.load_tokenizers("sd2", tokenizer_cache_dir=tiny_models["tokenizers"])
    assert sd2_tokenizer.pad_token_id == 0


def test_missing_tokenizers_offline_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="build_clip_tokenizers.py.*--tokenizer_cache_dir"):
        clip_tokenizers.load_tokenizers("sdxl", tokenizer_cache_dir=tmp_path)


def test_single_file_with_cache_dir_tokenizers_and_config_without_tokenizers(tiny_models, tmp_path, folder_models):
    import shutil

    config_dir = tmp_path / "config"
    shutil.copytree(tiny_models["sd15_config"], config_dir, ignore=shutil.ignore_patterns("tokenizer*"))
    models = ml.load_models(tiny_models["sd15_file"], sdxl=False, model_config_dir=config_dir,
                            tokenizer_cache_dir=tiny_models["tokenizers"])
    assert models.tokenizers[0]("a cat").input_ids == folder_models["sd15"].tokenizers[0]("a cat").input_ids


def test_ckpt_file_loads_like_safetensors(tiny_models, folder_models, tmp_path):
    with safe_open(str(tiny_models["sd15_file"]), framework="pt") as handle:
        state = {key: handle.get_tensor(key) for key in handle.keys()}
    state["cond_stage_model.transformer.text_model.embeddings.position_ids"] = torch.arange(77)[None]
    state["betas"] = torch.ones(1000)  # noise-schedule buffers of the original code: ignored
    checkpoint = tmp_path / "model.ckpt"
    torch.save({"state_dict": state, "global_step": 7}, checkpoint)
    models = ml.load_models(checkpoint, sdxl=False, model_config_dir=tiny_models["sd15_config"])
    assert_identical(tensors_of(folder_models["sd15"]), tensors_of(models))


def test_save_single_file_round_trip_in_fp16(tiny_models, folder_models, tmp_path):
    target = tmp_path / "half.safetensors"
    checkpoint_files.save_single_file(folder_models["sdxl"], target, dtype=torch.float16, metadata={"ss_note": "x"})
    assert not list(tmp_path.glob(".*.tmp"))
    with safe_open(str(target), framework="pt") as handle:
        assert handle.metadata() == {"ss_note": "x"}
        assert handle.get_tensor("model.diffusion_model.out.2.weight").dtype == torch.float16
    reloaded = ml.load_models(target, sdxl=True, model_config_dir=tiny_models["sdxl_config"])
    expected = {k: v.half().float() for k, v in tensors_of(folder_models["sdxl"]).items()}
    assert_identical(expected, tensors_of(reloaded))


# --- VAE override -------------------------------------------------------------

def test_vae_from_folder_full_file_and_bare_original_file(tiny_models, folder_models, tmp_path):
    reference = folder_models["sd15"].vae.state_dict()
    config = dict(folder_models["sd15"].vae.config)
    bare = tmp_path / "vae.safetensors"
    rules = ck.vae_key_map(folder_models["sd15"].vae, prefix="").rules
    save_file({r.original: r.to_original([reference[n] for n in r.diffusers]).contiguous() for r in rules}, str(bare))
    diffusers_named = tiny_models["sd15"] / "vae" / "diffusion_pytorch_model.safetensors"
    for source in (tiny_models["sd15"] / "vae", tiny_models["sd15"], tiny_models["sd15_file"], bare, diffusers_named):
        vae = ml.load_vae(source, vae_config=config)
        assert_identical(reference, vae.state_dict())
    assert "first_stage_model.encoder.mid.attn_1.q.weight" in {r.original for r in ck.vae_key_map(vae).rules}


def test_load_models_with_vae_override(tiny_models, folder_models):
    models = ml.load_models(tiny_models["sdxl_file"], sdxl=True, model_config_dir=tiny_models["sdxl_config"],
                            vae_path=tiny_models["sdxl"] / "vae")
    assert_identical(folder_models["sdxl"].vae.state_dict(), models.vae.state_dict())


def test_sd2_file_into_text_encoder_with_fewer_layers(tiny_models, folder_models, tmp_path):
    """diffusers' SD2 config keeps 23 of 24 OpenCLIP layers: the extra layers of the file are skipped."""
    import json
    import shutil

    config_dir = tmp_path / "config"
    shutil.copytree(tiny_models["sd2_config"], config_dir)
    config_file = config_dir / "text_encoder" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "num_hidden_layers": 2}))
    models = ml.load_models(tiny_models["sd2_file"], sdxl=False, v2=True, model_config_dir=config_dir)
    reference = folder_models["sd2"].text_encoders[0].state_dict()
    loaded = models.text_encoders[0].state_dict()
    assert len(models.text_encoders[0].encoder.layers) == 2
    assert all(torch.equal(reference[name], tensor) for name, tensor in loaded.items())


# --- name maps ----------------------------------------------------------------

def test_unet_module_name_map_tiny_sdxl(folder_models):
    unet = folder_models["sdxl"].unet
    names = ck.unet_module_name_map(unet.config)
    assert names["down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q"] == \
        "input_blocks.4.1.transformer_blocks.0.attn1.to_q"
    assert names["mid_block.attentions.0.proj_in"] == "middle_block.1.proj_in"
    assert names["up_blocks.0.attentions.2.transformer_blocks.1.ff.net.2"] == \
        "output_blocks.2.1.transformer_blocks.1.ff.net.2"
    assert names["down_blocks.0.downsamplers.0.conv"] == "input_blocks.3.0.op"
    assert names["up_blocks.0.upsamplers.0.conv"] == "output_blocks.2.2.conv"
    assert names["up_blocks.1.resnets.0.conv_shortcut"] == "output_blocks.3.0.skip_connection"
    assert names["time_embedding.linear_1"] == "time_embed.0"
    assert names["add_embedding.linear_2"] == "label_emb.0.2"
    assert len(set(names.values())) == len(names)
    transformer_linears = {n for n, m in unet.named_modules()
                           if ".transformer_blocks." in n and isinstance(m, torch.nn.Linear)}
    assert transformer_linears <= names.keys()
    for name in transformer_linears:  # inside a transformer block the names are the same
        assert names[name].endswith(name[name.index(".transformer_blocks."):])
    # every original name is a real module path in the single file
    original_keys = {r.original for r in ck.unet_key_map(unet).rules}
    assert all(f"{ck.UNET_PREFIX}{original}.weight" in original_keys for original in names.values())


def test_full_size_sdxl_config_on_meta_device():
    unet, vae, encoders, _ = ml.build_empty_models("sdxl", ml.shipped_config_dir("sdxl"))
    assert unet.device.type == "meta"
    names = ck.unet_module_name_map(unet.config)
    inside_transformers = [n for n in names if re.search(r"attentions\.\d+\.", n)]
    assert len(inside_transformers) == 722
    tails = {re.sub(r".*attentions\.\d+\.(transformer_blocks\.\d+\.)?", "", n) for n in inside_transformers}
    assert tails == {"proj_in", "proj_out", "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                     "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ff.net.0.proj", "ff.net.2"}
    maps = ck.checkpoint_key_maps("sdxl", unet, vae, encoders)
    originals = {r.original for _, key_map in maps.values() for r in key_map.rules}
    # 2515 tensors in sd_xl_base_1.0.safetensors, less CLIP-L position_ids and bigG logit_scale
    assert len(originals) == 2513
    for key in ("model.diffusion_model.input_blocks.7.1.transformer_blocks.9.attn2.to_k.weight",
                "model.diffusion_model.output_blocks.5.2.conv.weight",
                "conditioner.embedders.1.model.transformer.resblocks.31.attn.in_proj_weight",
                "conditioner.embedders.1.model.text_projection",
                "conditioner.embedders.0.transformer.text_model.final_layer_norm.bias",
                "first_stage_model.decoder.up.0.block.0.nin_shortcut.weight"):
        assert key in originals


@pytest.mark.parametrize("kind", ["sd1", "sd2"])
def test_full_size_sd_configs_cover_every_tensor(kind):
    unet, vae, encoders, _ = ml.build_empty_models(kind, ml.shipped_config_dir(kind))
    maps = ck.checkpoint_key_maps(kind, unet, vae, encoders)
    for model, key_map in maps.values():
        assert set(key_map.by_diffusers) == set(model.state_dict())
    originals = {r.original for _, key_map in maps.values() for r in key_map.rules}
    assert "model.diffusion_model.output_blocks.2.1.conv.weight" in originals  # upsampler of an UpBlock2D
    if kind == "sd2":
        assert "cond_stage_model.model.transformer.resblocks.23.attn.in_proj_weight" in originals


# --- user errors --------------------------------------------------------------

def test_missing_path_is_a_user_error(tmp_path):
    missing = tmp_path / "nope.safetensors"
    with pytest.raises(UserError, match=r"--pretrained_model_name_or_path: .*nope\.safetensors does not exist"):
        ml.load_models(missing, sdxl=True)
    with pytest.raises(UserError, match="--vae"):
        ml.load_vae(missing, vae_config={})


def test_truncated_safetensors_is_a_user_error(tiny_models, tmp_path):
    truncated = tmp_path / "truncated.safetensors"
    data = tiny_models["sdxl_file"].read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match=r"truncated\.safetensors"):
        ml.load_models(truncated, sdxl=True, model_config_dir=tiny_models["sdxl_config"])
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint" * 10)
    with pytest.raises(UserError, match=r"garbage\.ckpt"):
        ml.load_models(garbage, sdxl=True, model_config_dir=tiny_models["sdxl_config"])


def test_wrong_model_kind_is_a_user_error(tiny_models):
    with pytest.raises(UserError, match="SDXL checkpoint; train it with sdxl_train_network.py"):
        ml.load_models(tiny_models["sdxl_file"], sdxl=False, model_config_dir=tiny_models["sd15_config"])
    with pytest.raises(UserError, match="not SDXL"):
        ml.load_models(tiny_models["sd15_file"], sdxl=True, model_config_dir=tiny_models["sdxl_config"])
    with pytest.raises(UserError, match="pass --v2"):
        ml.load_models(tiny_models["sd2_file"], sdxl=False, model_config_dir=tiny_models["sd15_config"])
    with pytest.raises(UserError, match="SDXL model"):
        ml.load_models(tiny_models["sdxl"], sdxl=False)
    with pytest.raises(UserError, match="SD1.x model; drop --v2"):
        ml.load_models(tiny_models["sd15"], sdxl=False, v2=True)
    with pytest.raises(UserError, match="SD2.x model; pass --v2"):
        ml.load_models(tiny_models["sd2"], sdxl=False)
    with pytest.raises(UserError, match="--v2"):
        ml.load_models(tiny_models["sdxl"], sdxl=True, v2=True)


def test_architecture_mismatch_names_the_tensor_and_the_flag(tiny_models, tmp_path):
    import json
    import shutil

    # tiny file, full-size shipped config: the tiny text encoders have fewer layers
    with pytest.raises(UserError, match=r"lacks .*--model_config_dir"):
        ml.load_models(tiny_models["sdxl_file"], sdxl=True)
    config_dir = tmp_path / "config"
    shutil.copytree(tiny_models["sd15_config"], config_dir)
    config_file = config_dir / "text_encoder" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "intermediate_size": 80}))
    with pytest.raises(UserError, match=r"mlp\.fc1\.(weight|bias) has shape \[64.* expects \[80.*--model_config_dir"):
        ml.load_models(tiny_models["sd15_file"], sdxl=False, model_config_dir=config_dir)


def _copy_state(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


def test_missing_and_unexpected_tensors_are_user_errors(tiny_models, tmp_path):
    state = _copy_state(tiny_models["sdxl_file"])
    dropped = "model.diffusion_model.input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight"
    broken = tmp_path / "missing.safetensors"
    save_file({k: v for k, v in state.items() if k != dropped}, str(broken))
    with pytest.raises(UserError, match=rf"missing\.safetensors lacks 1 tensor.*first: {re.escape(dropped)}"):
        ml.load_models(broken, sdxl=True, model_config_dir=tiny_models["sdxl_config"])
    extra = tmp_path / "extra.safetensors"
    save_file({**state, "model.diffusion_model.input_blocks.99.0.weight": torch.zeros(1)}, str(extra))
    with pytest.raises(UserError, match=r"extra\.safetensors has 1 tensor.*input_blocks\.99\.0\.weight"):
        ml.load_models(extra, sdxl=True, model_config_dir=tiny_models["sdxl_config"])


def test_bad_config_dir_and_non_model_folder(tiny_models, tmp_path):
    with pytest.raises(UserError, match="--model_config_dir: .* has no text_encoder_2/config.json"):
        ml.load_models(tiny_models["sdxl_file"], sdxl=True, model_config_dir=tiny_models["sd15_config"])
    with pytest.raises(UserError, match="not a diffusers model"):
        ml.load_models(tmp_path, sdxl=True)


def test_add_arguments_has_kohya_names_and_documented_defaults():
    parser = argparse.ArgumentParser()
    ml.add_arguments(parser)
    args = parser.parse_args(["--pretrained_model_name_or_path", "m.safetensors", "--v2"])
    assert args.pretrained_model_name_or_path == "m.safetensors" and args.v2
    assert args.vae is None and args.tokenizer_cache_dir is None and args.model_config_dir is None
    for action in parser._actions:
        if action.dest != "help":
            assert "default" in action.help, action.dest
    with pytest.raises(UserError, match="--pretrained_model_name_or_path is required"):
        ml.load_models_from_args(parser.parse_args([]), sdxl=True)


def test_build_clip_tokenizers_from_pypi_wheel(tmp_path):
    """Real-size tokenizers built offline; skipped when the wheel cannot be downloaded."""
    from tools import build_clip_tokenizers as bct

    try:
        wheel = bct.download_wheel(tmp_path)
    except UserError as error:
        pytest.skip(f"open_clip_torch wheel not downloadable here: {error}")
    written = bct.build_clip_tokenizers(tmp_path / "cache", wheel=wheel)
    assert set(written) == set(bct.TOKENIZER_FOLDERS)
    tokenizers = clip_tokenizers.load_tokenizers("sdxl", tokenizer_cache_dir=tmp_path / "cache")
    for tokenizer in tokenizers:
        assert len(tokenizer) == 49408
        assert tokenizer("a photo of a cat").input_ids == bct.CHECK_IDS
    assert tokenizers[1]("hi!!").input_ids == tokenizers[0]("hi!!").input_ids
    assert tokenizers[1].pad_token_id == 0 and tokenizers[0].pad_token_id == 49407
    # kohya's own trainer pins transformers 4, whose CLIPTokenizer reads vocab.json and merges.txt only
    from transformers import CLIPTokenizer

    for folder in written.values():
        legacy = tmp_path / "legacy" / folder.name
        legacy.mkdir(parents=True)
        for name in ("vocab.json", "merges.txt"):
            shutil.copyfile(folder / name, legacy / name)
        assert CLIPTokenizer.from_pretrained(legacy)("a photo of a cat").input_ids == bct.CHECK_IDS


def test_lowram_and_highvram_parse_and_keep_cpu_loading_on_cpu():
    import argparse

    from library import model_loading

    parser = argparse.ArgumentParser()
    model_loading.add_arguments(parser)
    args = parser.parse_args(["--lowram", "--highvram"])
    assert args.lowram and args.highvram
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert torch.device(model_loading.load_device(args)).type == expected
    assert torch.device(model_loading.load_device(parser.parse_args([]))).type == "cpu"
