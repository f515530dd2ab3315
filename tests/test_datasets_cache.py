"""Latent and text-encoder caches on the tiny SDXL: round trips, keyed sampling, staleness, refusals."""
from __future__ import annotations

import copy
import json
import os

import numpy as np
import pytest
import torch
from test_datasets import dataset_from, write_config, write_image

import train_network
from library import model_loading, text_encoding
from library.datasets import latents, text_cache
from library.errors import UserError


@pytest.fixture(scope="module")
def sdxl(tiny_models):
    return model_loading.load_models(str(tiny_models["sdxl"]), sdxl=True)


def image_folder(tmp_path, sizes=((64, 64), (96, 64)), captions=("a red thing", "a blue thing")):
    for index, (size, caption) in enumerate(zip(sizes, captions)):
        write_image(tmp_path / "data" / "2_x" / f"{index}.png", size, caption=caption)
    return ["--train_data_dir", str(tmp_path / "data"), "--caption_extension", ".txt", "--resolution", "64",
            "--enable_bucket", "--min_bucket_reso", "64", "--max_bucket_reso", "128", "--bucket_reso_steps", "32"]


def test_cached_latents_reproduce_the_uncached_keyed_sample(sdxl, tmp_path):
    args = image_folder(tmp_path) + ["--flip_aug"]
    cached, plain = dataset_from(*args), dataset_from(*args)
    cached.latent_store = latents.cache_latents(cached.plan.images, sdxl.vae, to_disk=True, is_sdxl=True,
                                                vae_batch_size=2)
    files = sorted(name for name in os.listdir(tmp_path / "data" / "2_x") if name.endswith(".npz"))
    assert files == ["0_0064x0064_sdxl.npz", "1_0096x0064_sdxl.npz"]  # kohya's names: image size, _sdxl
    with np.load(tmp_path / "data" / "2_x" / files[1]) as npz:  # kohya v0.11.1's keys: _<latent h>x<latent w>
        kohya_keys = {"latents_8x8", "latents_flipped_8x8", "original_size_8x8", "crop_ltrb_8x8"}
        assert set(npz.files) == kohya_keys | {"latents_std_8x8", "latents_flipped_std_8x8", "cache_meta_8x8"}
        assert npz["latents_8x8"].shape == (4, 8, 8) and npz["original_size_8x8"].tolist() == [96, 64]  # 64x64
    flips = set()
    with torch.no_grad():
        for epoch in (1, 2, 3):
            cached.set_epoch(epoch)
            plain.set_epoch(epoch)
            for index in range(len(cached)):
                from_cache, from_pixels = cached[index], plain[index]
                assert "images" not in from_cache and torch.equal(from_cache["sample_indices"],
                                                                  from_pixels["sample_indices"])
                for key in ("original_sizes_hw", "crop_top_lefts", "target_sizes_hw", "flipped"):
                    assert torch.equal(from_cache[key], from_pixels[key])
                ids = from_pixels["sample_indices"].tolist()
                expected = train_network.encode_latents(sdxl.vae, from_pixels["images"], 7, epoch, ids)
                sampled = latents.sample_cached_latents(from_cache, 7, epoch)
                torch.testing.assert_close(sampled, expected, atol=1e-5, rtol=1e-4)
                flips.update(from_cache["flipped"].tolist())
    assert flips == {True, False}


def test_disk_cache_is_reused_and_rebuilt_when_stale(sdxl, tmp_path, capsys):
    args = image_folder(tmp_path)
    folder = tmp_path / "data" / "2_x"
    path = folder / "0_0064x0064_sdxl.npz"

    def cache(*extra):
        dataset = dataset_from(*args, *extra)
        latents.cache_latents(dataset.plan.images, sdxl.vae, to_disk=True, is_sdxl=True)
        suffix = latents.latent_size_suffix(dataset.plan.images[0].bucket_wh)
        with np.load(path) as npz:
            return npz["latents" + suffix].copy(), json.loads(str(npz["cache_meta" + suffix]))

    first, meta = cache()
    assert meta["bucket"] == [64, 64] and meta["vae"] == latents.vae_fingerprint(sdxl.vae)
    written_at = path.stat().st_mtime_ns
    again, _ = cache()
    assert path.stat().st_mtime_ns == written_at and np.array_equal(again, first)  # fresh: not rewritten

    write_image(folder / "0.png", (64, 64), pixels=np.full((64, 64, 3), 30, np.uint8))  # the image changed
    os.utime(folder / "0.png", ns=(written_at + 10**9, written_at + 10**9))
    changed, _ = cache()
    assert "rebuilding 1 stale latent cache" in capsys.readouterr().out
    assert not np.allclose(changed, first)

    bigger, meta = cache("--resolution", "128", "--max_bucket_reso", "256")  # the bucket changed
    assert bigger.shape == (4, 16, 16) and meta["bucket"] == [128, 128]

    # a kohya-written file (no metadata) for another bucket: rebuilt
    np.savez(path, latents=np.zeros((4, 8, 8), np.float32), original_size=np.array([64, 64]),
             crop_ltrb=np.array([0.0, 0.0, 64.0, 64.0]))
    rebuilt, meta = cache("--resolution", "128", "--max_bucket_reso", "256")
    assert np.allclose(rebuilt, bigger) and meta["format"] == latents.CACHE_FORMAT


def kohya_get_crop_ltrb(bucket_wh, image_wh):
    """kohya's BucketManager.get_crop_ltrb, written out (floats, its own convention)."""
    bucket_ar, image_ar = bucket_wh[0] / bucket_wh[1], image_wh[0] / image_wh[1]
    width, height = (bucket_wh[1] * image_ar, bucket_wh[1]) if bucket_ar > image_ar else (bucket_wh[0],
                                                                                        bucket_wh[0] / image_ar)
    left, top = (bucket_wh[0] - width) // 2, (bucket_wh[1] - height) // 2
    return [left, top, left + width, top + height]


def test_kohyas_latent_cache_files_are_reused_and_ours_are_kohyas(sdxl, tmp_path, capsys):
    """kohya's --cache_latents_to_disk format (learned from files its trainer wrote): one VAE sample as
    ``latents`` (unscaled), ``original_size`` (W, H), ``crop_ltrb`` floats by its get_crop_ltrb,
    ``latents_flipped`` with flip_aug; no metadata. Its own reader checks the keys only."""
    args = image_folder(tmp_path, sizes=((64, 64), (96, 64), (64, 112))) + ["--flip_aug"]
    dataset = dataset_from(*args)
    latents.cache_latents(dataset.plan.images, sdxl.vae, to_disk=True, is_sdxl=True)
    images = dataset.plan.images
    for image in images:  # ours carry kohya's fields with kohya's values, under v0.11.1's suffix
        suffix = f"_{image.bucket_wh[1] // 8}x{image.bucket_wh[0] // 8}"
        with np.load(latents.npz_path(image, True)) as npz:
            assert npz["crop_ltrb" + suffix].tolist() == kohya_get_crop_ltrb(image.bucket_wh, image.size_wh)
            assert npz["original_size" + suffix].tolist() == list(image.size_wh)
            assert npz["latents" + suffix].shape == (4, image.bucket_wh[1] // 8, image.bucket_wh[0] // 8)
    assert any(value % 1 for image in images for value in kohya_get_crop_ltrb(image.bucket_wh, image.size_wh))

    generator = np.random.default_rng(0)
    samples = {}
    for image in images[:2]:  # kohya's files before v0.10.2 (keys without suffix) for this run's buckets
        width, height = image.bucket_wh
        samples[image.path] = generator.standard_normal((4, height // 8, width // 8)).astype(np.float32)
        np.savez(latents.npz_path(image, True), latents=samples[image.path], latents_flipped=-samples[image.path],
                 original_size=np.array(image.size_wh),
                 crop_ltrb=np.array(kohya_get_crop_ltrb(image.bucket_wh, image.size_wh)))
    capsys.readouterr()
    dataset = dataset_from(*args)
    dataset.latent_store = latents.cache_latents(dataset.plan.images, sdxl.vae, to_disk=True, is_sdxl=True)
    assert "reused 2 latent cache files written by kohya-ss" in capsys.readouterr().out
    scale = float(sdxl.vae.config.scaling_factor)
    checked = set()
    for epoch in (1, 2):  # kohya's fixed sample (its flipped one for flipped draws) at every epoch
        dataset.set_epoch(epoch)
        for index in range(len(dataset)):
            item = dataset[index]
            path = dataset.image_of(int(item["sample_indices"][0])).path
            if path in samples:
                flipped = bool(item["flipped"][0])
                expected = torch.from_numpy(samples[path]) * scale * (-1 if flipped else 1)
                torch.testing.assert_close(latents.sample_cached_latents(item, 3, epoch)[0], expected)
                checked.add((path, epoch))
    assert len(checked) == 4
    with np.load(latents.npz_path(images[0], True)) as npz:
        assert "cache_meta" not in npz.files  # kohya's file is used as it is, never rewritten


def test_one_image_at_two_buckets_keeps_both_entries(sdxl, tmp_path):
    write_image(tmp_path / "img" / "a.png", (64, 64))
    config = write_config(tmp_path, f"""
[general]
enable_bucket = true
min_bucket_reso = 64
bucket_reso_steps = 32
[[datasets]]
resolution = 64
  [[datasets.subsets]]
  image_dir = '{tmp_path / "img"}'
[[datasets]]
resolution = 128
  [[datasets.subsets]]
  image_dir = '{tmp_path / "img"}'
""")
    dataset = dataset_from("--dataset_config", str(config), "--max_bucket_reso", "256")
    dataset.latent_store = latents.cache_latents(dataset.plan.images, sdxl.vae, to_disk=True, is_sdxl=True)
    with np.load(tmp_path / "img" / "a_0064x0064_sdxl.npz") as npz:
        assert npz["latents_8x8"].shape == (4, 8, 8) and npz["latents_16x16"].shape == (4, 16, 16)
    shapes = sorted(tuple(dataset[i]["latents"].shape) for i in range(len(dataset)))
    assert shapes == [(1, 4, 8, 8), (1, 4, 16, 16)]


def test_nan_latents_name_the_image_and_suggest_no_half_vae(sdxl, tmp_path):
    dataset = dataset_from(*image_folder(tmp_path))
    broken_vae = copy.deepcopy(sdxl.vae)
    with torch.no_grad():
        broken_vae.encoder.conv_in.weight.fill_(float("nan"))
    with pytest.raises(UserError, match=r"0\.png contain NaN.*--no_half_vae"):
        latents.cache_latents(dataset.plan.images, broken_vae, to_disk=False, is_sdxl=True)


def test_caches_that_would_be_wrong_are_refused(tmp_path):
    args = image_folder(tmp_path)
    with pytest.raises(UserError, match="--cache_latents cannot be used with random_crop"):
        dataset_from(*args, "--cache_latents", "--random_crop")
    config = write_config(tmp_path, f"[[datasets]]\nresolution = 64\n[[datasets.subsets]]\n"
                                    f"image_dir = '{tmp_path / 'data' / '2_x'}'\ncolor_aug = true\n")
    with pytest.raises(UserError, match=r"color_aug \(--dataset_config .*subsets\]\] #1\)"):
        dataset_from("--dataset_config", str(config), "--cache_latents_to_disk")
    with pytest.raises(UserError, match="needs --network_train_unet_only"):
        dataset_from(*args, "--cache_text_encoder_outputs")
    with pytest.raises(UserError, match="cannot be used with shuffle_caption, caption_tag_dropout_rate"):
        dataset_from(*args, "--cache_text_encoder_outputs_to_disk", "--network_train_unet_only", "--shuffle_caption",
                     "--caption_tag_dropout_rate", "0.1")
    dataset = dataset_from(*args, "--cache_latents", "--flip_aug")  # flips are cached, kohya allows them
    assert dataset.plan.images


def test_text_cache_matches_the_encoder_and_follows_caption_changes(sdxl, tmp_path):
    args = image_folder(tmp_path) + ["--caption_prefix", "photo of", "--max_token_length", "150"]
    fingerprint = text_cache.text_encoders_fingerprint(sdxl.text_encoders)

    def encode_parts(captions):
        return text_encoding.encode_sdxl_parts(sdxl.tokenizers, sdxl.text_encoders, captions, 150)

    def cached_dataset():
        dataset = dataset_from(*args)
        dataset.text_store = text_cache.cache_text_encoder_outputs(dataset.plan.images, encode_parts, fingerprint,
                                                                   150, to_disk=True)
        return dataset

    dataset = cached_dataset()
    batch = dataset[0]
    hidden, pooled = batch["text_encoder_outputs"]
    with torch.no_grad():
        expected_hidden, expected_pooled = text_encoding.encode_sdxl(sdxl.tokenizers, sdxl.text_encoders,
                                                                     batch["captions"], 150)
    assert batch["captions"][0].startswith("photo of a ") and hidden.shape == (1, 152, 96)
    torch.testing.assert_close(hidden, expected_hidden)
    torch.testing.assert_close(pooled, expected_pooled)
    npz_path = tmp_path / "data" / "2_x" / "0_te_outputs.npz"
    with np.load(npz_path) as npz:
        assert npz["hidden_state1"].shape == (152, 32) and npz["pool2"].shape == (64,)
        assert json.loads(str(npz["cache_meta"]))["caption"] == "photo of a red thing"
    (tmp_path / "data" / "2_x" / "0.txt").write_text("a green thing\n", encoding="utf-8")
    dataset = cached_dataset()
    with np.load(npz_path) as npz:
        assert json.loads(str(npz["cache_meta"]))["caption"] == "photo of a green thing"
    assert "photo of a green thing" in dataset.text_store.by_caption


def test_alpha_masks_reach_the_batch_mirrored_with_the_pixels(sdxl, tmp_path):
    pixels = np.zeros((64, 64, 4), np.uint8)
    pixels[:, :32, 3] = 255  # only the left half is opaque
    write_image(tmp_path / "alpha" / "1_x" / "a.png", (64, 64), mode="RGBA", pixels=pixels)
    args = ["--train_data_dir", str(tmp_path / "alpha"), "--resolution", "64", "--alpha_mask", "--flip_aug"]
    batches = []
    for extra in ([], ["--cache_latents"]):
        dataset = dataset_from(*args, *extra)
        if extra:
            dataset.latent_store = latents.cache_latents(dataset.plan.images, sdxl.vae, False, True)
        for epoch in range(1, 5):
            dataset.set_epoch(epoch)
            batches.append(dataset[0])
    for batch in batches:
        mask = batch["alpha_masks"][0]
        opaque_left = bool(mask[:, :32].mean() == 1.0 and mask[:, 32:].sum() == 0)
        opaque_right = bool(mask[:, 32:].mean() == 1.0 and mask[:, :32].sum() == 0)
        assert opaque_left != bool(batch["flipped"][0]) and opaque_left != opaque_right


def test_sd1_long_captions_and_clip_skip(tiny_models):
    """SD1: a short caption's first chunk is the same with 75 or 225 tokens; clip_skip re-normalises."""
    sd1 = model_loading.load_models(str(tiny_models["sd15"]), sdxl=False)
    tokenizer, encoder = sd1.tokenizers[0], sd1.text_encoders[0]
    with torch.no_grad():
        short = text_encoding.encode_sd(tokenizer, encoder, ["a red circle"], None, clip_skip=2)
        long = text_encoding.encode_sd(tokenizer, encoder, ["a red circle"], 225, clip_skip=2)
        last_layer = text_encoding.encode_sd(tokenizer, encoder, ["a red circle"], None)
    assert short.shape[1] == 77 and long.shape[1] == 227
    torch.testing.assert_close(long[:, :76], short[:, :76])
    assert not torch.allclose(short, last_layer)
