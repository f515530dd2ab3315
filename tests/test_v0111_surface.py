"""kohya-ss sd-scripts v0.11.1's SDXL/SD1.x LoRA surface (the kohya_ss GUI v26 pins v0.11.1).

What v0.10.2 - v0.11.1 changed for these trainers, and what is checked here:
* ``skip_image_resolution`` (v0.10.2): the ``--skip_image_resolution`` flag ('size' or 'width,height')
  and the dataset-config key (size or [width, height], in [general] or [[datasets]]): an image whose
  original width * height is at most that area is left out before the validation split, the
  regularisation balancing and bucketing; kohya's metadata reports it (``ss_skip_image_resolution``,
  ``ss_datasets[].skip_image_resolution``).
* SD/SDXL latent caches (v0.10.2, multi-resolution datasets): ``<stem>_<W:04d>x<H:04d>_sdxl.npz``
  (``_sd.npz``), every key suffixed with the latent size ``_<h>x<w>``; kohya v0.11.1 reads an
  unsuffixed entry when its ``latents`` have the bucket's latent size.
* the option set of ``sdxl_train_network.py`` / ``train_network.py`` (v0.10.4 added
  ``--train_inpainting``, see test_inpainting) and ``--lowvram`` (never a kohya option).
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from test_datasets import dataset_from, write_config, write_image

import sdxl_train_network
import train_network
from library import config_file, model_loading
from library.datasets import latents
from library.errors import UserError
from library.lora_metadata import dataset_metadata

# Every option of kohya v0.11.1's sdxl_train_network.py parser, as names (facts, not code): kohya's
# setup_parser() at 48d368fa read programmatically, plus the options of v0.11's library/args.py
# add_dataset_arguments() that it lacks (skip_image_resolution, train_inpainting).
KOHYA_V0111_SDXL_OPTIONS = """
adaptive_noise_scale alpha_mask async_upload base_weights base_weights_multiplier bucket_no_upscale
bucket_reso_steps cache_info cache_latents cache_latents_to_disk cache_text_encoder_outputs
cache_text_encoder_outputs_to_disk caption_dropout_every_n_epochs caption_dropout_rate caption_extension
caption_extention caption_prefix caption_separator caption_suffix caption_tag_dropout_rate clip_skip color_aug
conditioning_data_dir config_file console_log_file console_log_level console_log_simple
cpu_offload_checkpointing dataset_class dataset_config dataset_repeats ddp_gradient_as_bucket_view
ddp_static_graph ddp_timeout debiased_estimation_loss debug_dataset deepspeed dim_from_weights
disable_mmap_load_safetensors dynamo_backend enable_bucket enable_wildcard face_crop_aug_range flip_aug
fp16_master_weights_and_gradients fp8_base fp8_base_unet full_bf16 full_fp16 fused_backward_pass
gradient_accumulation_steps gradient_checkpointing highvram huber_c huber_scale huber_schedule
huggingface_path_in_repo huggingface_repo_id huggingface_repo_type huggingface_repo_visibility huggingface_token
in_json initial_epoch initial_step ip_noise_gamma ip_noise_gamma_random_strength keep_tokens
keep_tokens_separator learning_rate log_config log_prefix log_tracker_config log_tracker_name log_with
logging_dir loss_type lowram lr_decay_steps lr_scheduler lr_scheduler_args lr_scheduler_min_lr_ratio
lr_scheduler_num_cycles lr_scheduler_power lr_scheduler_timescale lr_scheduler_type lr_warmup_steps masked_loss
max_bucket_reso max_data_loader_n_workers max_grad_norm max_timestep max_token_length max_train_epochs
max_train_steps max_validation_steps mem_eff_attn metadata_author metadata_description
metadata_is_negative_embedding metadata_license metadata_merged_from metadata_preprocessor metadata_tags
metadata_thumbnail metadata_title metadata_trigger_phrase metadata_usage_hint min_bucket_reso min_snr_gamma
min_timestep mixed_precision multires_noise_discount multires_noise_iterations network_alpha network_args
network_dim network_dropout network_module network_train_text_encoder_only network_train_unet_only
network_weights no_half_vae no_metadata noise_offset noise_offset_random_strength offload_optimizer_device
offload_optimizer_nvme_path offload_param_device offload_param_nvme_path optimizer_args optimizer_type
output_config output_dir output_name persistent_data_loader_workers pretrained_model_name_or_path
prior_loss_weight random_crop reg_data_dir resize_interpolation resolution resume resume_from_huggingface
sample_at_first sample_every_n_epochs sample_every_n_steps sample_prompts sample_sampler save_every_n_epochs
save_every_n_steps save_last_n_epochs save_last_n_epochs_state save_last_n_steps save_last_n_steps_state
save_model_as save_n_epoch_ratio save_precision save_state save_state_on_train_end save_state_to_huggingface
scale_v_pred_loss_like_noise_pred scale_weight_norms sdpa secondary_separator seed shuffle_caption
skip_cache_check skip_image_resolution skip_until_initial_step text_encoder_lr token_warmup_min
token_warmup_step tokenizer_cache_dir torch_compile train_batch_size train_data_dir train_inpainting
training_comment unet_lr use_8bit_adam use_lion_optimizer v2 v_parameterization v_pred_like_loss vae
vae_batch_size validate_every_n_epochs validate_every_n_steps validation_seed validation_split wandb_api_key
wandb_run_name weighted_captions xformers zero3_init_flag zero3_save_16bit_model zero_stage zero_terminal_snr
""".split()
# train_network.py (SD1.x/2.x) has the same options but these three (SDXL's add_sdxl_training_arguments).
KOHYA_V0111_SDXL_ONLY = {"cache_text_encoder_outputs", "cache_text_encoder_outputs_to_disk",
                         "disable_mmap_load_safetensors"}


def a_valid_value(action) -> list[str]:
    """Command-line words that set ``action`` to a valid non-default value."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(next(choice for choice in action.choices if choice is not None))]
    return [{"lr_scheduler": "cosine"}.get(action.dest, "1")]  # a name checked while parsing


@pytest.mark.parametrize("module", [sdxl_train_network, train_network], ids=["sdxl", "sd"])
def test_every_v0111_option_is_accepted(module):
    assert len(KOHYA_V0111_SDXL_OPTIONS) == len(set(KOHYA_V0111_SDXL_OPTIONS)) == 198
    parser = module.setup_parser()
    actions = {option: action for action in parser._actions for option in action.option_strings}
    names = [name for name in KOHYA_V0111_SDXL_OPTIONS
             if module is sdxl_train_network or name not in KOHYA_V0111_SDXL_ONLY]
    assert [name for name in names if f"--{name}" not in actions] == []
    for name in names:
        action = actions[f"--{name}"]
        args = parser.parse_args([f"--{name}", *a_valid_value(action)])
        assert action.dest == name and getattr(args, name) not in (None, False)


# -- skip_image_resolution ----------------------------------------------------------------------
def images(root, sizes, reg_sizes=()):
    for index, size in enumerate(sizes):
        write_image(root / "train" / "2_x" / f"{size[0]}x{size[1]}_{index}.png", size, caption="a thing")
    for index, size in enumerate(reg_sizes):
        write_image(root / "reg" / "1_y" / f"{size[0]}x{size[1]}_{index}.png", size, caption="a y")


def kept_sizes(dataset, dataset_index=0):
    return sorted(image.size_wh for image in dataset.plan.datasets[dataset_index].images if not image.is_reg)


FOLDER = ["--caption_extension", ".txt", "--resolution", "64", "--enable_bucket", "--min_bucket_reso", "64",
          "--max_bucket_reso", "192", "--bucket_reso_steps", "32"]


def test_skip_image_resolution_flag_drops_images_not_larger_than_its_area(tmp_path, capsys):
    images(tmp_path, [(64, 64), (96, 64), (64, 96), (128, 128), (48, 80)], reg_sizes=[(64, 64), (96, 96)])
    common = ["--train_data_dir", str(tmp_path / "train"), "--reg_data_dir", str(tmp_path / "reg"), *FOLDER]
    everything = dataset_from(*common)
    assert kept_sizes(everything) == [(48, 80), (64, 64), (64, 96), (96, 64), (128, 128)]
    capsys.readouterr()
    # 64: area 4096; "at most" is skipped (64x64 and 48x80 = 3840), larger areas stay whatever their shape
    square = dataset_from(*common, "--skip_image_resolution", "64")
    assert kept_sizes(square) == [(64, 96), (96, 64), (128, 128)]
    assert "filtered 2 images by original resolution from" in capsys.readouterr().out
    # 'width,height' is an area too: 96x64 = 6144 also drops 96x64 and 64x96
    assert kept_sizes(dataset_from(*common, "--skip_image_resolution", "96,64")) == [(128, 128)]
    # reg images are filtered and then balanced to the remaining training samples (3 images x 2 repeats)
    plan = square.plan.datasets[0]
    assert plan.num_train_images == 6 and sorted(image.size_wh for image in plan.images if image.is_reg) == [(96, 96)]
    assert sum(image.num_repeats for image in plan.images if image.is_reg) == 6
    metadata = dataset_metadata(parse_args(common, "64"), square, 1)
    assert metadata["ss_skip_image_resolution"] == "(64, 64)"  # kohya: str() of its parsed tuple
    assert dataset_metadata(parse_args(common), everything, 1)["ss_skip_image_resolution"] == "None"


def parse_args(common, skip=None):
    extra = ["--skip_image_resolution", skip] if skip else []
    return sdxl_train_network.setup_parser().parse_args(["--seed", "3", *common, *extra])


def general(max_bucket_reso: int) -> str:
    return (f"[general]\nenable_bucket = true\nmin_bucket_reso = 64\nmax_bucket_reso = {max_bucket_reso}\n"
            f"bucket_reso_steps = 32\ncaption_extension = \".txt\"\n")


def test_skip_image_resolution_is_applied_before_the_validation_split(tmp_path):
    images(tmp_path, [(64, 64)] * 4 + [(128, 128)] * 4)
    config = write_config(tmp_path, general(192) + f"""
[[datasets]]
resolution = 128
skip_image_resolution = 64
validation_split = 0.5
  [[datasets.subsets]]
  image_dir = '{tmp_path / "train" / "2_x"}'
""")
    dataset = dataset_from("--dataset_config", str(config))
    # the 4 small images are gone first; the split halves the 4 left (kohya filters, then splits)
    assert kept_sizes(dataset) == [(128, 128)] * 2


def test_multi_resolution_config_skips_small_images_in_the_larger_dataset(tmp_path):
    images(tmp_path, [(64, 64), (96, 96), (160, 128)])
    folder = tmp_path / "train" / "2_x"
    config = write_config(tmp_path, general(256) + f"""
[[datasets]]
resolution = 64
  [[datasets.subsets]]
  image_dir = '{folder}'
[[datasets]]
resolution = 128
skip_image_resolution = [96, 96]
  [[datasets.subsets]]
  image_dir = '{folder}'
""")
    dataset = dataset_from("--dataset_config", str(config))
    assert kept_sizes(dataset, 0) == [(64, 64), (96, 96), (160, 128)]
    assert kept_sizes(dataset, 1) == [(160, 128)]
    args = sdxl_train_network.setup_parser().parse_args(["--dataset_config", str(config)])
    entries = json.loads(dataset_metadata(args, dataset, 1)["ss_datasets"])
    assert [entry["skip_image_resolution"] for entry in entries] == [None, [96, 96]]
    keys = list(entries[1])
    assert keys[keys.index("max_bucket_reso") + 1] == "skip_image_resolution"  # kohya's place


def test_skip_image_resolution_keeps_what_kohya_keeps(tmp_path):
    """A multi-resolution config with reg images, run through kohya's own dataset code (PR #2273, the
    v0.10.2 feature; for a single size its sqrt(w*h) <= s rule is v0.11.1's w*h <= s*s) in the
    harness: the images each dataset keeps and the reg repeats, copied from its output."""
    sizes = [(64, 64), (96, 64), (64, 96), (128, 128), (48, 80), (80, 52), (81, 52)]
    for index, (width, height) in enumerate(sizes):
        write_image(tmp_path / "train" / f"{width}x{height}_{index}.png", (width, height), caption="a thing")
    for index, (width, height) in enumerate([(64, 64), (96, 96)]):
        write_image(tmp_path / "reg" / f"{width}x{height}_{index}.png", (width, height), caption="a y")
    subsets = f"""
  [[datasets.subsets]]
  image_dir = '{tmp_path / "train"}'
  num_repeats = 2
  [[datasets.subsets]]
  image_dir = '{tmp_path / "reg"}'
  is_reg = true
"""
    config = write_config(tmp_path, general(256) + "[[datasets]]\nresolution = 64\n" + subsets
                          + "[[datasets]]\nresolution = 128\nskip_image_resolution = 64\n" + subsets)
    dataset = dataset_from("--dataset_config", str(config))
    kept = [sorted((os.path.basename(image.path), image.is_reg, image.num_repeats) for image in plan.images)
            for plan in dataset.plan.datasets]
    kohyas = [
        [("128x128_3.png", False, 2), ("48x80_4.png", False, 2), ("64x64_0.png", False, 2), ("64x64_0.png", True, 7),
         ("64x96_2.png", False, 2), ("80x52_5.png", False, 2), ("81x52_6.png", False, 2), ("96x64_1.png", False, 2),
         ("96x96_1.png", True, 7)],
        [("128x128_3.png", False, 2), ("64x96_2.png", False, 2), ("80x52_5.png", False, 2), ("81x52_6.png", False, 2),
         ("96x64_1.png", False, 2), ("96x96_1.png", True, 10)],
    ]
    assert kept == kohyas


@pytest.mark.parametrize("value, where", [
    ("abc", "--skip_image_resolution abc"), ("64,64,64", "--skip_image_resolution 64,64,64"),
    ("-8", "--skip_image_resolution -8")])
def test_bad_skip_image_resolution_flag_names_it(value, where, tmp_path):
    images(tmp_path, [(64, 64)])
    with pytest.raises(UserError, match=f"^{where}: expected 'size' or 'width,height'"):
        dataset_from("--train_data_dir", str(tmp_path / "train"), *FOLDER, "--skip_image_resolution", value)


def test_bad_skip_image_resolution_key_names_it(tmp_path):
    images(tmp_path, [(64, 64)])
    config = write_config(tmp_path, f"""
[[datasets]]
resolution = 64
skip_image_resolution = "big"
  [[datasets.subsets]]
  image_dir = '{tmp_path / "train" / "2_x"}'
""")
    with pytest.raises(UserError, match="skip_image_resolution"):
        dataset_from("--dataset_config", str(config))


# -- latent cache files of v0.11.1 ---------------------------------------------------------------
@pytest.fixture(scope="module")
def sdxl(tiny_models):
    return model_loading.load_models(str(tiny_models["sdxl"]), sdxl=True)


def kohya_v0111_load(npz_path: str, bucket_wh: tuple[int, int]):
    """kohya v0.11.1's SD/SDXL cache reader (strategy_base._default_load_latents_from_disk with the
    SD/SDXL strategy's latents stride 8 and legacy fallback), written out from its format: the
    entry ``<key>_<h>x<w>`` of the bucket's latent size, else the unsuffixed one if its latents
    have that size."""
    suffix = f"_{bucket_wh[1] // 8}x{bucket_wh[0] // 8}"
    with np.load(npz_path) as npz:
        if "latents" + suffix not in npz.files:
            assert npz["latents"].shape[-2:] == (bucket_wh[1] // 8, bucket_wh[0] // 8)
            suffix = ""
        flipped = npz["latents_flipped" + suffix] if "latents_flipped" + suffix in npz.files else None
        return (npz["latents" + suffix], npz["original_size" + suffix].tolist(), npz["crop_ltrb" + suffix].tolist(),
                flipped)


def cached(sdxl, folder_args):
    dataset = dataset_from(*folder_args)
    dataset.latent_store = latents.cache_latents(dataset.plan.images, sdxl.vae, to_disk=True, is_sdxl=True)
    return dataset


def test_our_cache_files_are_kohya_v0111s(sdxl, tmp_path):
    images(tmp_path, [(96, 64), (64, 128)])
    folder_args = ["--train_data_dir", str(tmp_path / "train"), *FOLDER, "--flip_aug"]
    dataset = cached(sdxl, folder_args)
    scale = float(sdxl.vae.config.scaling_factor)
    for image in dataset.plan.images:
        path = latents.npz_path(image, True)
        width, height = image.size_wh
        assert path == os.path.splitext(image.path)[0] + f"_{width:04d}x{height:04d}_sdxl.npz"
        suffix = f"_{image.bucket_wh[1] // 8}x{image.bucket_wh[0] // 8}"
        with np.load(path) as npz:
            assert {"latents", "latents_flipped", "original_size", "crop_ltrb"} == {
                key[: -len(suffix)] for key in npz.files if key.endswith(suffix) and "std" not in key
                and "cache_meta" not in key}
            assert not [key for key in npz.files if not key.endswith(suffix)]
        kohya_latents, original_size, crop, flipped = kohya_v0111_load(path, image.bucket_wh)
        mean, _, _ = dataset.latent_store.get(image.index, flipped=False)
        mean_flipped, _, _ = dataset.latent_store.get(image.index, flipped=True)
        # what kohya loads is what we train on (ours scaled by the VAE factor: one rounding)
        torch.testing.assert_close(torch.from_numpy(kohya_latents) * scale, mean, rtol=2 ** -23, atol=0)
        torch.testing.assert_close(torch.from_numpy(flipped) * scale, mean_flipped, rtol=2 ** -23, atol=0)
        assert original_size == [width, height] and crop == list(latents.kohya_crop_ltrb(image.bucket_wh,
                                                                                         image.size_wh))


def test_kohya_v0111_cache_files_are_reused(sdxl, tmp_path, capsys):
    images(tmp_path, [(96, 64), (64, 128)])
    folder_args = ["--train_data_dir", str(tmp_path / "train"), *FOLDER]
    planned = dataset_from(*folder_args).plan.images
    samples = {}
    generator = np.random.default_rng(1)
    for image in planned:  # kohya v0.11.1's file, from its format: suffixed keys, no metadata of ours
        width, height = image.bucket_wh
        suffix = f"_{height // 8}x{width // 8}"
        samples[image.path] = generator.standard_normal((4, height // 8, width // 8)).astype(np.float32)
        np.savez(latents.npz_path(image, True), **{
            "latents" + suffix: samples[image.path], "original_size" + suffix: np.array(image.size_wh),
            "crop_ltrb" + suffix: np.array(latents.kohya_crop_ltrb(image.bucket_wh, image.size_wh))})
    capsys.readouterr()
    dataset = cached(sdxl, folder_args)
    assert "reused 2 latent cache files written by kohya-ss" in capsys.readouterr().out
    scale = float(sdxl.vae.config.scaling_factor)
    for image in dataset.plan.images:
        mean, std, _ = dataset.latent_store.get(image.index, flipped=False)
        assert torch.equal(mean, torch.from_numpy(samples[image.path]) * scale) and not std.any()


def test_kohyas_oldest_cache_name_is_still_read(sdxl, tmp_path, capsys):
    """``<stem>.npz`` with unsuffixed keys: kohya v0.11.1 still uses it when it exists; so do we,
    without writing to it."""
    images(tmp_path, [(96, 64)])
    folder_args = ["--train_data_dir", str(tmp_path / "train"), *FOLDER]
    image = dataset_from(*folder_args).plan.images[0]
    width, height = image.bucket_wh
    sample = np.random.default_rng(2).standard_normal((4, height // 8, width // 8)).astype(np.float32)
    old_path = os.path.splitext(image.path)[0] + ".npz"
    np.savez(old_path, latents=sample, original_size=np.array(image.size_wh),
             crop_ltrb=np.array(latents.kohya_crop_ltrb(image.bucket_wh, image.size_wh)))
    written_at = os.stat(old_path).st_mtime_ns
    capsys.readouterr()
    dataset = cached(sdxl, folder_args)
    assert "reused 1 latent cache files written by kohya-ss" in capsys.readouterr().out
    mean, _, _ = dataset.latent_store.get(0, flipped=False)
    assert torch.equal(mean, torch.from_numpy(sample) * float(sdxl.vae.config.scaling_factor))
    assert os.stat(old_path).st_mtime_ns == written_at and not os.path.exists(latents.npz_path(image, True))


def test_cache_files_written_before_the_suffix_are_still_read(sdxl, tmp_path, capsys):
    """Ours from before (one unsuffixed entry with its metadata) is fresh and kept as it is; when the
    bucket changes the file is rewritten in v0.11.1's keys only."""
    images(tmp_path, [(96, 64)])
    folder_args = ["--train_data_dir", str(tmp_path / "train"), *FOLDER]
    image = cached(sdxl, folder_args).plan.images[0]
    path = latents.npz_path(image, True)
    with np.load(path) as npz:
        old_layout = {key.replace("_8x8", ""): npz[key] for key in npz.files}
    np.savez(path, **old_layout)
    written_at = os.stat(path).st_mtime_ns
    capsys.readouterr()
    dataset = cached(sdxl, folder_args)
    assert os.stat(path).st_mtime_ns == written_at and "rebuilding" not in capsys.readouterr().out
    mean, _, _ = dataset.latent_store.get(0, flipped=False)
    assert torch.equal(mean, torch.from_numpy(old_layout["latents"]) * float(sdxl.vae.config.scaling_factor))
    bigger = cached(sdxl, ["--train_data_dir", str(tmp_path / "train"), *FOLDER[:2], "--resolution", "128",
                           *FOLDER[4:]]).plan.images[0]  # another bucket
    suffix = latents.latent_size_suffix(bigger.bucket_wh)
    assert bigger.bucket_wh != image.bucket_wh and suffix != "_8x8"
    with np.load(path) as npz:
        assert sorted(npz.files) == sorted(key + suffix for key in
                                           ("latents", "latents_std", "original_size", "crop_ltrb", "cache_meta"))


# -- --lowvram ----------------------------------------------------------------------------------
def test_lowvram_is_no_option_as_in_kohya(tmp_path, caplog):
    """kohya's trainers never had --lowvram (kohya's low-memory options are --lowram and --highvram;
    older kohya_ss GUIs wrote a lowvram key that v26 no longer writes): a lowvram key in --config_file
    is ignored with a warning naming it (kohya ignores unknown keys silently), --lowvram on the command
    line is an unknown option (exit 2), as in kohya."""
    config = tmp_path / "gui.toml"
    config.write_text("lowvram = true\nlowram = true\n", encoding="utf-8")
    args, _ = config_file.parse_args(sdxl_train_network.setup_parser(), ["--config_file", str(config)])
    assert args.lowram is True and not hasattr(args, "lowvram")
    assert "lowvram" in caplog.text
    with pytest.raises(UserError, match="^unrecognized arguments: --lowvram"):  # exit code 2 in the script
        sdxl_train_network.setup_parser().parse_args(["--lowvram"])
