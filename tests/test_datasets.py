"""Datasets as kohya users keep them: real image files, kohya's buckets, SDXL conditioning, captions, configs."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import sdxl_train_network
from library.datasets import buckets
from library.datasets.captions import CaptionOptions, process_caption
from library.datasets.dataset import build_dataset
from library.datasets.images import load_image, probe_image
from library.errors import UserError


# -- helpers shared by the dataset tests ---------------------------------------------------------
def write_image(path: Path, size_wh: tuple[int, int], mode: str = "RGB", orientation: int | None = None,
                pixels: np.ndarray | None = None, caption: str | None = None, caption_extension: str = ".txt") -> Path:
    """A real image file (png/jpg/webp/bmp by suffix); ``orientation`` adds an EXIF orientation tag."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if pixels is None:
        rng = np.random.default_rng(abs(hash(path.name)) % 2**32)
        channels = 4 if mode == "RGBA" else 3
        pixels = rng.integers(0, 256, (size_wh[1], size_wh[0], channels), dtype=np.uint8)
    image = Image.fromarray(pixels, mode)
    kwargs = {}
    if orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = orientation
        kwargs["exif"] = exif.tobytes()
    image.save(path, **kwargs)
    if caption is not None:
        path.with_suffix(caption_extension).write_text(caption + "\n", encoding="utf-8")
    return path


def gradient_pixels(size_wh: tuple[int, int]) -> np.ndarray:
    """R grows with x, G with y (linear, 0..255): a pixel's colour says where it came from."""
    width, height = size_wh
    x = np.linspace(0, 255, width)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height)[:, None].repeat(width, 1)
    return np.stack([x, y, np.full_like(x, 128)], axis=-1).round().astype(np.uint8)


def parse(*argv: str):
    return sdxl_train_network.setup_parser().parse_args(list(argv))


def dataset_from(*argv: str, seed: int = 3):
    return build_dataset(parse("--seed", str(seed), *argv), min_bucket_steps=32)


# -- images ---------------------------------------------------------------------------------------
def test_exif_rotation_is_applied_to_size_and_pixels(tmp_path):
    pixels = np.zeros((20, 40, 3), np.uint8)  # stored 40 wide, 20 high; top-left corner red
    pixels[:4, :4] = (255, 0, 0)
    path = write_image(tmp_path / "rotated.jpg", (40, 20), pixels=pixels, orientation=6)  # "rotate 90 CW to view"
    assert probe_image(str(path)) == (20, 40)
    upright = np.asarray(load_image(str(path)))
    assert upright.shape == (40, 20, 3)
    assert upright[:4, -4:, 0].mean() > 200  # the red corner is now top-right
    assert upright[:4, :4, 0].mean() < 60


def test_rgba_is_composited_on_white_unless_alpha_is_kept(tmp_path):
    pixels = np.zeros((8, 8, 4), np.uint8)
    pixels[:, :, 0] = 200
    pixels[:, 4:, 3] = 255  # left half transparent
    path = write_image(tmp_path / "rgba.png", (8, 8), mode="RGBA", pixels=pixels)
    composited = np.asarray(load_image(str(path)))
    assert composited.shape == (8, 8, 3)
    assert (composited[:, :4] == 255).all() and (composited[:, 4:] == (200, 0, 0)).all()
    kept = np.asarray(load_image(str(path), keep_alpha=True))
    assert kept.shape == (8, 8, 4) and (kept[:, :4, 0] == 200).all() and (kept[:, :4, 3] == 0).all()


def test_bad_images_are_named_before_training_or_skipped(tmp_path, capsys):
    folder = tmp_path / "data" / "2_thing"
    write_image(folder / "good.png", (64, 64), caption="good")
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "broken.webp").write_bytes(b"RIFF\x00\x00\x00\x00WEBPnot really")
    write_image(folder / "odd.bmp", (67, 71))
    with pytest.raises(UserError, match="broken.webp|empty.jpg") as error:
        dataset_from("--train_data_dir", str(tmp_path / "data"), "--resolution", "64")
    assert "--skip_bad_images" in str(error.value)
    dataset = dataset_from("--train_data_dir", str(tmp_path / "data"), "--resolution", "64", "--skip_bad_images")
    output = capsys.readouterr().out
    assert "skipping" in output and "empty.jpg" in output and "broken.webp" in output
    assert sorted(os.path.basename(image.path) for image in dataset.plan.images) == ["good.png", "odd.bmp"]
    assert dataset.num_train_images == 4  # 2 images x 2 repeats, counted like kohya
    batch = dataset[0]
    assert batch["images"].shape == (1, 3, 64, 64)


def test_truncated_images_are_named_before_training_or_skipped(tmp_path, capsys):
    """Their headers are intact; only decoding the whole file finds them (JPEGs in draft mode too)."""
    folder = tmp_path / "data" / "1_thing"
    write_image(folder / "good.png", (64, 64))
    for name in ("cut.png", "cut.jpg"):
        data = (write_image(tmp_path / name, (96, 96))).read_bytes()
        (folder / name).write_bytes(data[: len(data) // 2])
        assert Image.open(folder / name).size == (96, 96)  # the header still reads
    with pytest.raises(UserError, match=r"cut\.(jpg|png) cannot be read \(image file is truncated") as error:
        dataset_from("--train_data_dir", str(tmp_path / "data"), "--resolution", "64")
    assert "--skip_bad_images" in str(error.value) and "\n" not in str(error.value)
    dataset = dataset_from("--train_data_dir", str(tmp_path / "data"), "--resolution", "64", "--skip_bad_images")
    assert "skipping" in capsys.readouterr().out
    assert [os.path.basename(image.path) for image in dataset.plan.images] == ["good.png"]


def test_sixteen_bit_grayscale_png_keeps_its_levels(tmp_path):
    """PIL opens it as mode I;16 and its convert("RGB") clips at 255: nearly white before the fix."""
    levels = np.linspace(0, 65535, 256 * 4).round().astype(np.uint16).reshape(4, 256)
    sixteen = tmp_path / "gray16.png"
    Image.fromarray(levels).save(sixteen)
    assert Image.open(sixteen).mode in ("I;16", "I")
    eight = tmp_path / "gray8.png"
    Image.fromarray((levels / 257).round().astype(np.uint8), "L").save(eight)
    assert probe_image(str(sixteen)) == (256, 4)
    decoded = np.asarray(load_image(str(sixteen))).astype(int)
    reference = np.asarray(load_image(str(eight))).astype(int)
    assert decoded.shape == (4, 256, 3) and decoded.min() == 0 and decoded.max() == 255
    assert len(np.unique(decoded)) == 256
    assert np.abs(decoded - reference).max() <= 1
    assert np.asarray(load_image(str(sixteen), keep_alpha=True))[..., 3].min() == 255


@pytest.mark.parametrize("repeats", [0, -1])
def test_num_repeats_below_one_is_named(tmp_path, repeats):
    write_image(tmp_path / "images" / "a.png", (64, 64))
    path = write_config(tmp_path, f"[[datasets]]\n[[datasets.subsets]]\nimage_dir = '{tmp_path / 'images'}'\n"
                                  f"num_repeats = {repeats}\n")
    with pytest.raises(UserError) as error:
        dataset_from("--dataset_config", str(path), "--resolution", "64")
    message = str(error.value)
    assert f"[[datasets.subsets]] #1 has num_repeats {repeats}" in message and "1 or more" in message
    write_image(tmp_path / "data" / f"{repeats}_thing" / "a.png", (64, 64))
    with pytest.raises(UserError, match=f"the repeat count of {repeats}_thing is less than 1.*1 or more"):
        dataset_from("--train_data_dir", str(tmp_path / "data"), "--resolution", "64")


def test_empty_folder_is_ignored_and_a_flat_folder_explained(tmp_path, capsys):
    write_image(tmp_path / "data" / "3_cat" / "a.png", (64, 64))
    (tmp_path / "data" / "5_empty").mkdir()
    (tmp_path / "data" / "notes").mkdir()
    dataset = dataset_from("--train_data_dir", str(tmp_path / "data"), "--resolution", "64")
    output = capsys.readouterr().out
    assert "5_empty has no usable images" in output and "notes" in output
    assert dataset[0]["captions"] == ["cat"]  # class tokens when no caption file (default .caption)
    write_image(tmp_path / "flat" / "a.png", (64, 64))
    with pytest.raises(UserError, match="holds images directly"):
        dataset_from("--train_data_dir", str(tmp_path / "flat"), "--resolution", "64")
    with pytest.raises(UserError, match="--train_data_dir"):
        dataset_from("--resolution", "64")


# -- buckets --------------------------------------------------------------------------------------
# Reference values produced by running kohya-ss sd-scripts' own BucketManager on these inputs:
# (resolution, min, max, steps, no_upscale, image size) -> (bucket, resized size), all (width, height).
KOHYA_BUCKETS = [
    ((128, 128), 64, 256, 32, False, (64, 64), (128, 128), (128, 128)),
    ((128, 128), 64, 256, 32, False, (100, 60), (160, 96), (160, 96)),
    ((128, 128), 64, 256, 32, False, (60, 100), (96, 160), (96, 160)),
    ((128, 128), 64, 256, 32, False, (1920, 1080), (160, 96), (171, 96)),
    ((128, 128), 64, 256, 32, False, (333, 777), (64, 192), (82, 192)),
    ((128, 128), 64, 256, 32, False, (127, 65), (160, 96), (188, 96)),
    ((128, 128), 64, 256, 32, False, (4000, 3000), (128, 128), (171, 128)),
    ((128, 128), 64, 256, 32, False, (513, 511), (128, 128), (129, 128)),
    ((128, 128), 64, 256, 32, False, (200, 50), (256, 64), (256, 64)),
    ((128, 128), 64, 256, 32, False, (768, 1344), (96, 160), (96, 168)),
    ((128, 128), 64, 256, 32, False, (130, 70), (160, 96), (178, 96)),
    ((1024, 1024), 256, 2048, 64, False, (1920, 1080), (1344, 768), (1365, 768)),
    ((1024, 1024), 256, 2048, 64, False, (333, 777), (640, 1536), (658, 1536)),
    ((1024, 1024), 256, 2048, 64, False, (4000, 3000), (1152, 896), (1195, 896)),
    ((1024, 1024), 256, 2048, 64, False, (513, 511), (1024, 1024), (1028, 1024)),
    ((1024, 1024), 256, 2048, 64, False, (130, 70), (1344, 768), (1426, 768)),
    ((128, 96), 64, 256, 32, True, (100, 60), (96, 32), (100, 60)),
    ((128, 96), 64, 256, 32, True, (1920, 1080), (128, 64), (128, 72)),
    ((128, 96), 64, 256, 32, True, (127, 65), (96, 64), (127, 65)),
    ((128, 96), 64, 256, 32, True, (768, 1344), (64, 128), (73, 128)),
    ((128, 96), 64, 256, 32, True, (4000, 3000), (128, 96), (128, 96)),
]


@pytest.mark.parametrize("resolution, low, high, steps, no_upscale, size, bucket, resized", KOHYA_BUCKETS)
def test_bucket_assignment_matches_kohya(resolution, low, high, steps, no_upscale, size, bucket, resized):
    choice = buckets.BucketRule(resolution, True, low, high, steps, no_upscale).select(*size)
    assert (choice.bucket_wh, choice.resized_wh) == (bucket, resized)


def test_bucket_table_matches_kohya():
    assert buckets.make_bucket_resolutions((128, 128), 64, 256, 32) == [
        (64, 192), (64, 224), (64, 256), (96, 160), (128, 128), (160, 96), (192, 64), (224, 64), (256, 64)]
    table = buckets.make_bucket_resolutions((1024, 1024), 256, 2048, 64)
    assert (1024, 1024) in table and (832, 1216) in table and (2048, 512) in table and len(table) == 41


def test_bucket_limits_are_put_on_the_grid_and_checked(capsys):
    assert buckets.adjust_bucket_limits((128, 128), 70, 250, 32, "x") == (64, 256)
    with pytest.raises(UserError, match="min_bucket_reso 192 is larger"):
        buckets.adjust_bucket_limits((128, 128), 192, 256, 32, "x")


def test_buckets_group_batches_and_print_a_summary(tmp_path, capsys):
    folder = tmp_path / "data" / "1_x"
    for index, size in enumerate([(200, 120), (210, 120), (120, 200), (64, 64), (130, 130)]):
        write_image(folder / f"{index}.png", size)
    dataset = dataset_from("--train_data_dir", str(tmp_path / "data"), "--resolution", "128", "--enable_bucket",
                           "--min_bucket_reso", "64", "--max_bucket_reso", "256", "--bucket_reso_steps", "32",
                           "--train_batch_size", "2")
    summary = capsys.readouterr().out
    assert "resolution (96, 160), count: 1" in summary and "resolution (160, 96), count: 2" in summary
    assert "resolution (128, 128), count: 2" in summary
    sizes = [tuple(dataset[i]["images"].shape) for i in range(len(dataset))]
    assert sorted(sizes) == [(1, 3, 160, 96), (2, 3, 96, 160), (2, 3, 128, 128)]


# -- SDXL conditioning against the pixels ---------------------------------------------------------
@pytest.mark.parametrize("size", [(210, 120), (120, 210)])
def test_sdxl_conditioning_describes_the_pixels(tmp_path, size):
    """original_size, crop_top_left and target_size locate every trained pixel in the source image."""
    write_image(tmp_path / "data" / "4_x" / "g.png", size, pixels=gradient_pixels(size))
    dataset = dataset_from("--train_data_dir", str(tmp_path / "data"), "--resolution", "128", "--enable_bucket",
                           "--min_bucket_reso", "64", "--max_bucket_reso", "256", "--bucket_reso_steps", "32",
                           "--random_crop", "--flip_aug")
    seen = set()
    for epoch in range(1, 6):
        dataset.set_epoch(epoch)
        for index in range(len(dataset)):
            batch = dataset[index]
            original_h, original_w = batch["original_sizes_hw"][0].tolist()
            top, left = batch["crop_top_lefts"][0].tolist()
            target_h, target_w = batch["target_sizes_hw"][0].tolist()
            flipped = bool(batch["flipped"][0])
            assert (original_w, original_h) == size and batch["images"].shape[2:] == (target_h, target_w)
            image = dataset.image_of(batch["sample_indices"][0].item())
            scale = image.resized_wh[0] / original_w
            pixels = (batch["images"][0].permute(1, 2, 0).numpy() + 1) * 127.5
            # In the (mirrored, if flipped) resized image the window starts at (top, left).
            columns = left + np.arange(target_w) + 0.5
            rows = top + np.arange(target_h) + 0.5
            source_x = np.clip(columns / scale - 0.5, 0, original_w - 1)
            if flipped:
                source_x = original_w - 1 - source_x
            source_y = np.clip(rows / scale - 0.5, 0, original_h - 1)
            expected_red = source_x * 255 / (original_w - 1)
            expected_green = source_y * 255 / (original_h - 1)
            assert np.abs(pixels[:, :, 0].mean(axis=0) - expected_red).max() < 3.0
            assert np.abs(pixels[:, :, 1].mean(axis=1) - expected_green).max() < 3.0
            seen.add((top, left, flipped))
    assert len(seen) > 2  # random crops and flips were exercised


# -- captions -------------------------------------------------------------------------------------
def caption_with(options: CaptionOptions, caption: str, epoch: int = 1, seed: int = 0) -> str:
    return process_caption(options, caption, epoch, np.random.default_rng(seed))


def test_caption_transforms_follow_kohya():
    tags = "sks, red hat, smiling, outdoors, night"
    assert caption_with(CaptionOptions(caption_prefix="best", caption_suffix="end"), "a b") == "best a b end"
    shuffled = caption_with(CaptionOptions(shuffle_caption=True, keep_tokens=1), tags, seed=5)
    assert shuffled.startswith("sks, ") and sorted(shuffled.split(", ")) == sorted(tags.split(", "))
    assert shuffled == caption_with(CaptionOptions(shuffle_caption=True, keep_tokens=1), tags, seed=5)
    assert {caption_with(CaptionOptions(shuffle_caption=True), tags, seed=s) for s in range(8)} != {tags}
    separated = "sks, style ||| a, b, c ||| tail1, tail2"
    result = caption_with(CaptionOptions(shuffle_caption=True, keep_tokens_separator="|||"), separated, seed=2)
    assert result.startswith("sks, style, ") and result.endswith(", tail1, tail2")
    assert caption_with(CaptionOptions(caption_tag_dropout_rate=1.0, keep_tokens=2), tags) == "sks, red hat"
    assert caption_with(CaptionOptions(caption_dropout_rate=1.0), tags) == ""
    every_2 = CaptionOptions(caption_dropout_every_n_epochs=2)
    assert caption_with(every_2, tags, epoch=1) == tags and caption_with(every_2, tags, epoch=2) == ""
    assert caption_with(CaptionOptions(shuffle_caption=True, secondary_separator=";;;"), "a;;;b", seed=1) == "a,b"
    wildcard = caption_with(CaptionOptions(enable_wildcard=True), "a {red|blue} {{x}}\nsecond line", seed=3)
    assert wildcard in {"a red {x}", "a blue {x}", "second line"}
    assert caption_with(CaptionOptions(caption_separator=";", shuffle_caption=True), "x; y", seed=0) in {"x, y", "y, x"}


def test_per_sample_choices_do_not_depend_on_batch_size(tmp_path):
    folder = tmp_path / "data" / "3_sks"
    for index in range(5):
        write_image(folder / f"{index}.png", (64, 64), caption=f"sks, tag{index}, a, b, c, d")
    common = ["--train_data_dir", str(tmp_path / "data"), "--resolution", "64", "--caption_extension", ".txt",
              "--shuffle_caption", "--keep_tokens", "1", "--caption_tag_dropout_rate", "0.3", "--flip_aug"]

    def per_sample(batch_size: str, epoch: int) -> dict:
        dataset = dataset_from(*common, "--train_batch_size", batch_size)
        dataset.set_epoch(epoch)
        result = {}
        for index in range(len(dataset)):
            batch = dataset[index]
            for sample, caption, flipped, pixels in zip(batch["sample_indices"].tolist(), batch["captions"],
                                                         batch["flipped"].tolist(), batch["images"]):
                result[sample] = (caption, flipped, float(pixels[0, 0, 0]))
        return result

    one, four = per_sample("1", 2), per_sample("4", 2)
    assert one == four and sorted(one) == list(range(15))
    assert per_sample("1", 3) != one  # another epoch draws again
    assert all(caption.startswith("sks") for caption, _, _ in one.values())


def test_epoch_order_is_keyed_by_seed_and_epoch(tmp_path):
    for index in range(6):
        write_image(tmp_path / "data" / "2_x" / f"{index}.png", (64, 64))
    args = ["--train_data_dir", str(tmp_path / "data"), "--resolution", "64", "--train_batch_size", "3"]
    first, second = dataset_from(*args), dataset_from(*args)
    orders = {}
    for epoch in (1, 2, 1):
        first.set_epoch(epoch)
        orders.setdefault(epoch, []).append([first.batch_sample_ids(i) for i in range(len(first))])
    second.set_epoch(2)
    assert orders[1][0] == orders[1][1]
    assert orders[2][0] == [second.batch_sample_ids(i) for i in range(len(second))]
    assert orders[1][0] != orders[2][0]
    assert sorted(sum(orders[2][0], [])) == list(range(12))
    assert orders[1][0] != [dataset_from(*args, seed=4).batch_sample_ids(i) for i in range(4)]


def test_persistent_workers_follow_set_epoch(tmp_path):
    for index in range(4):
        write_image(tmp_path / "data" / "1_x" / f"{index}.png", (64, 64), caption=f"a, b, c, {index}")
    dataset = dataset_from("--train_data_dir", str(tmp_path / "data"), "--resolution", "64", "--shuffle_caption",
                           "--caption_extension", ".txt")
    loader = torch.utils.data.DataLoader(dataset, batch_size=1, shuffle=False, num_workers=1, persistent_workers=True,
                                         collate_fn=lambda items: items[0])
    for epoch in (1, 2, 3):
        dataset.set_epoch(epoch)
        from_workers = [(batch["sample_indices"].tolist(), batch["captions"]) for batch in loader]
        in_process = [(dataset[i]["sample_indices"].tolist(), dataset[i]["captions"]) for i in range(len(dataset))]
        assert from_workers == in_process, epoch


def test_regularisation_images_are_balanced_like_kohya(tmp_path):
    for index in range(3):
        write_image(tmp_path / "train" / "2_sks dog" / f"{index}.png", (64, 64))
    for index in range(4):
        write_image(tmp_path / "reg" / "1_dog" / f"{index}.png", (64, 64))
    dataset = dataset_from("--train_data_dir", str(tmp_path / "train"), "--reg_data_dir", str(tmp_path / "reg"),
                           "--resolution", "64", "--prior_loss_weight", "0.5")
    reg = [image for image in dataset.plan.images if image.is_reg]
    assert [image.num_repeats for image in reg] == [2, 2, 1, 1]  # 6 train samples: a second pass adds 2
    assert dataset.num_train_images == 6 and dataset.num_reg_images == 4
    weights = sorted(w for i in range(len(dataset)) for w in dataset[i]["loss_weights"].tolist())
    assert weights == [0.5] * 6 + [1.0] * 6
    for index in range(5):
        write_image(tmp_path / "reg2" / "1_dog" / f"{index}.png", (64, 64))
    (tmp_path / "train2" / "1_sks dog").mkdir(parents=True)
    write_image(tmp_path / "train2" / "1_sks dog" / "a.png", (64, 64))
    write_image(tmp_path / "train2" / "1_sks dog" / "b.png", (64, 64))
    small = dataset_from("--train_data_dir", str(tmp_path / "train2"), "--reg_data_dir", str(tmp_path / "reg2"),
                         "--resolution", "64")
    assert [os.path.basename(i.path) for i in small.plan.images if i.is_reg] == ["0.png", "1.png"]  # rest unused


# -- dataset config files -------------------------------------------------------------------------
def write_config(tmp_path: Path, text: str, name: str = "dataset.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("body, expected", [
    ("[general]\nflip_augg = true\n", r"\[general\]: unknown key 'flip_augg' \(did you mean 'flip_aug'\?\)"),
    ("[[datasets]]\nbatch_size = '4'\n", r"\[\[datasets\]\] #1: 'batch_size' must be an integer, got '4'"),
    ("[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'x'\nnum_repeats = 1.5\n",
     r"\[\[datasets\]\] #1, \[\[datasets.subsets\]\] #1: 'num_repeats' must be an integer, got 1.5"),
    ("[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'x'\n[[datasets.subsets]]\nis_reg = 1\nimage_dir = 'y'\n",
     r"\[\[datasets.subsets\]\] #2: 'is_reg' must be true or false, got 1"),
    ("[[datasets]]\n[[datasets.subsets]]\nclass_tokens = 'x'\n", r"#1: 'image_dir' is required"),
    ("[[datasets]]\nresolution = [1, 2, 3]\n", r"'resolution' must be an integer or \[width, height\]"),
    ("[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'x'\n[[datasets.subsets]]\nmetadata_file = 'm.json'\n",
     "mixes DreamBooth subsets"),
    ("[datasets]\nresolution = 5\n", "'datasets' must be a list of tables"),
    ("[general\n", "not valid TOML"),
])
def test_config_mistakes_are_one_clear_line(tmp_path, body, expected):
    path = write_config(tmp_path, body)
    with pytest.raises(UserError, match=expected) as error:
        dataset_from("--dataset_config", str(path), "--resolution", "64")
    message = str(error.value)
    assert message.startswith(f"--dataset_config {path}: ") and "\n" not in message


def test_config_values_fall_back_like_kohya(tmp_path):
    for name in ("a", "b", "c"):
        write_image(tmp_path / name / "0.png", (64, 64), caption="x, y, z", caption_extension=".cap")
    path = write_config(tmp_path, f"""
[general]
caption_extension = ".cap"
keep_tokens = 1
enable_bucket = true
min_bucket_reso = 64
bucket_reso_steps = 32

[[datasets]]
resolution = 64
batch_size = 2
keep_tokens = 2

  [[datasets.subsets]]
  image_dir = '{tmp_path / "a"}'
  num_repeats = 3

  [[datasets.subsets]]
  image_dir = '{tmp_path / "b"}'
  keep_tokens = 3
  caption_prefix = "pre"

[[datasets]]
resolution = [96, 64]

  [[datasets.subsets]]
  image_dir = '{tmp_path / "c"}'
""")
    dataset = dataset_from("--dataset_config", str(path), "--shuffle_caption", "--train_batch_size", "5",
                           "--resolution", "128")
    first, second = dataset.plan.datasets
    assert first.spec.batch_size == 2 and second.spec.batch_size == 5  # dataset value, else the flag
    assert first.spec.resolution_wh == (64, 64) and second.spec.resolution_wh == (96, 64)
    assert first.spec.enable_bucket and second.spec.enable_bucket  # from [general]
    a, b, c = first.spec.subsets + second.spec.subsets
    assert (a.captions.keep_tokens, b.captions.keep_tokens, c.captions.keep_tokens) == (2, 3, 1)
    assert a.num_repeats == 3 and b.num_repeats == 1
    assert all(s.captions.shuffle_caption for s in (a, b, c))  # command-line flag as the last fallback
    assert b.captions.caption_prefix == "pre" and a.captions.caption_prefix is None
    assert a.caption_extension == ".cap"


def test_unsupported_options_are_refused_by_name(tmp_path):
    path = write_config(tmp_path, "[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'x'\n"
                                  "face_crop_aug_range = [2.0, 4.0]\n")
    with pytest.raises(UserError, match="face_crop_aug_range .* is not supported"):
        dataset_from("--dataset_config", str(path), "--resolution", "64")
    missing = write_config(tmp_path, "[[datasets]]\n[[datasets.subsets]]\nimage_dir = 'nowhere'\n", "m.toml")
    with pytest.raises(UserError, match="image_dir nowhere is not a folder"):
        dataset_from("--dataset_config", str(missing), "--resolution", "64")
    no_resolution = write_config(tmp_path, f"[[datasets]]\n[[datasets.subsets]]\nimage_dir = '{tmp_path}'\n", "r.toml")
    with pytest.raises(UserError, match="no resolution"):
        dataset_from("--dataset_config", str(no_resolution))


def test_finetuning_metadata_subsets(tmp_path):
    write_image(tmp_path / "img" / "one.png", (64, 64))
    write_image(tmp_path / "img" / "two.jpg", (80, 64))
    (tmp_path / "meta.json").write_text(
        '{"one.png": {"caption": "a photo", "tags": "red, round"}, "two": {"tags": "blue"}}', encoding="utf-8")
    path = write_config(tmp_path, f"""
[[datasets]]
resolution = 64
  [[datasets.subsets]]
  metadata_file = '{tmp_path / "meta.json"}'
  image_dir = '{tmp_path / "img"}'
  num_repeats = 2
""")
    dataset = dataset_from("--dataset_config", str(path))
    captions = {os.path.basename(image.path): image.caption for image in dataset.plan.images}
    assert captions == {"one.png": "a photo,red, round", "two.jpg": "blue"}
    assert len(dataset) == 4


def test_cache_info_and_in_json(tmp_path):
    write_image(tmp_path / "data" / "1_x" / "a.png", (80, 64), caption="first")
    args = ["--train_data_dir", str(tmp_path / "data"), "--resolution", "64", "--caption_extension", ".txt",
            "--cache_info"]
    dataset_from(*args)
    info = tmp_path / "data" / "1_x" / "metadata_cache.json"
    assert info.is_file()
    (tmp_path / "data" / "1_x" / "a.txt").write_text("edited", encoding="utf-8")
    assert dataset_from(*args).plan.images[0].caption == "first"  # kohya: the cached info wins until deleted
    (tmp_path / "meta.json").write_text('{"a.png": {"caption": "from json"}}', encoding="utf-8")
    dataset = dataset_from("--in_json", str(tmp_path / "meta.json"), "--train_data_dir", str(tmp_path / "data" / "1_x"),
                           "--resolution", "64", "--dataset_repeats", "3")
    assert dataset.plan.images[0].caption == "from json" and len(dataset) == 3


# -- token warm-up -----------------------------------------------------------------------------
def test_token_warmup_keeps_a_growing_prefix_of_the_flexible_tags():
    options = CaptionOptions(keep_tokens=1, token_warmup_min=1, token_warmup_step=8)
    caption = "sks, a, b, c, d"  # keep_tokens=1: "sks" is fixed, 4 flexible tags
    rng = np.random.default_rng(0)
    kept = [process_caption(options, caption, 1, rng, step=step) for step in (0, 2, 4, 6, 8, 100)]
    # floor(step * (4 - 1) / 8) + 1 flexible tags while step < 8, then all of them
    assert kept == ["sks, a", "sks, a", "sks, a, b", "sks, a, b, c", "sks, a, b, c, d", "sks, a, b, c, d"]
    fraction = CaptionOptions(token_warmup_min=2, token_warmup_step=0.5)  # half of 20 steps
    assert process_caption(fraction, "a, b, c, d, e, f", 1, rng, step=5, max_train_steps=20) == "a, b, c, d"
    assert process_caption(fraction, "a, b, c, d, e, f", 1, rng, step=10, max_train_steps=20) == "a, b, c, d, e, f"
    assert CaptionOptions(token_warmup_step=4).is_random  # captions change with the step: no text cache
    # kohya divides first: 49 * (2 / 98) rounds to 0.999..., so one tag, not two
    assert process_caption(CaptionOptions(token_warmup_step=98), "a, b, c", 1, rng, step=49) == "a"


def test_token_warmup_follows_each_batch_optimizer_step(tmp_path):
    from library.datasets.dataset import StepLayout

    for index in range(4):
        write_image(tmp_path / "2_sks" / f"{index}.png", (64, 64), caption="sks, a, b, c, d, e")
    dataset = dataset_from("--train_data_dir", str(tmp_path), "--caption_extension", ".txt", "--resolution", "64",
                           "--keep_tokens", "1", "--token_warmup_step", "6")
    assert len(dataset) == 8
    # two processes, two micro-batches per step: batch index i trains in step first + i // 2 // 2
    dataset.step_layout = StepLayout(accumulation_steps=2, world_size=2, max_train_steps=20)
    dataset.set_epoch(2, first_step=2)
    tag_counts = [len(dataset[index]["captions"][0].split(", ")) for index in range(8)]
    steps = [2 + index // 4 for index in range(8)]
    assert tag_counts == [1 + (step * 4) // 6 + 1 for step in steps]  # fixed "sks" + warm-up share of 5 tags


def test_token_warmup_refuses_a_text_encoder_cache(tmp_path):
    write_image(tmp_path / "1_sks" / "0.png", (64, 64), caption="sks, a, b")
    with pytest.raises(UserError, match="token_warmup_step"):
        dataset_from("--train_data_dir", str(tmp_path), "--caption_extension", ".txt", "--resolution", "64",
                     "--token_warmup_step", "4", "--cache_text_encoder_outputs", "--network_train_unet_only")


def test_debug_dataset_prints_the_first_epoch_without_training(tmp_path, capsys):
    from conftest import run_trainer

    for index, size in enumerate([(64, 64), (96, 64)]):
        write_image(tmp_path / "data" / "2_sks" / f"{index}.png", size, caption=f"sks, tag{index}")
    run_trainer("sdxl_train_network", [
        "--pretrained_model_name_or_path", str(tmp_path / "no_model_needed.safetensors"), "--debug_dataset",
        "--train_data_dir", str(tmp_path / "data"), "--caption_extension", ".txt", "--resolution", "64",
        "--enable_bucket", "--min_bucket_reso", "32", "--max_bucket_reso", "128", "--bucket_reso_steps", "32",
        "--output_dir", str(tmp_path / "out"), "--seed", "1", "--max_data_loader_n_workers", "0"])
    lines = capsys.readouterr().out.splitlines()
    lines = lines[lines.index("epoch 1: 4 batches"):]  # after the bucket summary
    samples = [line for line in lines if line.startswith("  ") and ".png" in line]
    assert len(samples) == 4 and sum("1.png" in line for line in samples) == 2  # 2 repeats of each image
    # the 96x64 image is centre-cropped into the 64x64 bucket
    assert any('caption: "sks, tag1", original size: (64, 96), crop top left: (0, 16), target size: (64, 64)' in line
               for line in samples)
    assert not (tmp_path / "out").exists()  # nothing trained or written


def test_weighted_captions_are_checked_when_the_dataset_is_built(tmp_path):
    write_image(tmp_path / "1_sks" / "0.png", (64, 64), caption="sks, (red:1.2.3) hat")
    with pytest.raises(UserError, match="--weighted_captions: weight '1.2.3'"):
        dataset_from("--train_data_dir", str(tmp_path), "--caption_extension", ".txt", "--resolution", "64",
                     "--weighted_captions")
