"""The Finetuning tab's preparation commands, as the kohya_ss GUI v26 writes them, and training from their output.

The commands below are what the GUI's own ``finetune_gui.train_model`` ran (recorded by the harness
/work/harness_ft_prep: the tab built headless, the preset "SDXL - AI_Now PagedAdamW8bit v1.0" applied with
the GUI's preset loader, model = the tiny SDXL folder, Max resolution 128,128, buckets 64..256; the other
SDXL preset differs only in --batch_size 1 and --mixed_precision fp16, the SD 1.5 presets run only the first
command). Only paths are substituted: ``{python}`` is the GUI's interpreter, ``{sd_scripts}`` this repository.
The GUI runs them with ``subprocess.run(argv, env=setup_environment())`` (PYTHONPATH=<gui>:<sd-scripts>).

The harness also ran the same command lines with kohya's own scripts: identical metadata files, byte for
byte; kohya's FineTuningDataset took all four latent caches written here (encoded none of them).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, SCRIPT_ENV, run_trainer
from PIL import Image

MERGE_CAPTIONS = ["{python}", "{sd_scripts}/finetune/merge_captions_to_metadata.py", "--caption_extension", ".txt",
                  "{images}", "{train}/meta_cap.json", "--full_path"]
PREPARE_BUCKETS_LATENTS = ["{python}", "{sd_scripts}/finetune/prepare_buckets_latents.py", "{images}",
                           "{train}/meta_cap.json", "{train}/meta_lat.json", "{model}", "--batch_size", "4",
                           "--max_resolution", "128,128", "--min_bucket_reso", "64", "--max_bucket_reso", "256",
                           "--mixed_precision", "bf16", "--full_path", "--mixed_precision=no"]
SIZES = {"img0": (128, 128), "img1": (192, 128), "img2": (128, 192), "img3": (160, 144)}
# kohya's prepare_buckets_latents.py on the same command line and image sizes (the harness).
KOHYA_TRAIN_RESOLUTION = {"img0": [128, 128], "img1": [128, 128], "img2": [64, 192], "img3": [128, 128]}


def gui_command(template: list[str], **paths: Path) -> list[str]:
    values = {"python": sys.executable, "sd_scripts": str(REPO), **{k: str(v) for k, v in paths.items()}}
    return [part.format(**values) for part in template]


def run_as_gui(argv: list[str], cwd: Path, expect: int = 0) -> subprocess.CompletedProcess:
    result = subprocess.run(argv, cwd=cwd, env={**SCRIPT_ENV, "PYTHONPATH": str(REPO)}, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == expect, (result.stdout + result.stderr)[-3000:]
    return result


@pytest.fixture
def finetune_folder(tmp_path: Path) -> Path:
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for stem, (width, height) in SIZES.items():
        Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(images / f"{stem}.png")
        (images / f"{stem}.txt").write_text(f"a photo of {stem}, red, square\n", encoding="utf-8")
    return images


@pytest.mark.slow
def test_gui_preparation_commands_then_training_from_their_metadata(tiny_models, finetune_folder, tmp_path):
    train = tmp_path / "train dir"  # the GUI's train_dir; a preset name with spaces is usual
    paths = {"images": finetune_folder, "train": train, "model": tiny_models["sdxl"]}
    run_as_gui(gui_command(MERGE_CAPTIONS, **paths), cwd=tmp_path)
    captions = json.loads((train / "meta_cap.json").read_text(encoding="utf-8"))
    assert captions == {str(finetune_folder / f"{stem}.png"): {"caption": f"a photo of {stem}, red, square"}
                        for stem in SIZES}

    run_as_gui(gui_command(PREPARE_BUCKETS_LATENTS, **paths), cwd=tmp_path)
    latents_meta = json.loads((train / "meta_lat.json").read_text(encoding="utf-8"))
    assert latents_meta == {str(finetune_folder / f"{stem}.png"): {
        "caption": f"a photo of {stem}, red, square", "train_resolution": KOHYA_TRAIN_RESOLUTION[stem]}
        for stem in SIZES}
    caches = {}
    for stem, (width, height) in SIZES.items():
        cache = finetune_folder / f"{stem}_{width:04d}x{height:04d}_sdxl.npz"  # kohya v0.11.1's SDXL name
        bucket_w, bucket_h = KOHYA_TRAIN_RESOLUTION[stem]
        with np.load(cache) as npz:
            suffix = f"_{bucket_h // 8}x{bucket_w // 8}"  # kohya v0.11.1's key suffix: latent h x w
            assert npz[f"latents{suffix}"].shape == (4, bucket_h // 8, bucket_w // 8)
            assert npz[f"original_size{suffix}"].tolist() == [width, height]
        caches[cache] = cache.read_bytes()

    # The trainer's --in_json reads the metadata and takes every prepared cache (none rewritten).
    output = tmp_path / "out"
    run_trainer("sdxl_train_network", [
        "--pretrained_model_name_or_path", str(tiny_models["sdxl"]), "--in_json", str(train / "meta_lat.json"),
        "--train_data_dir", str(finetune_folder), "--resolution", "128", "--enable_bucket", "--min_bucket_reso", "64",
        "--max_bucket_reso", "256", "--bucket_reso_steps", "64", "--cache_latents", "--cache_latents_to_disk",
        "--network_module", "networks.lora", "--network_dim", "2", "--network_train_unet_only", "--max_train_steps", "1",
        "--learning_rate", "1e-3", "--output_dir", str(output), "--output_name", "ft", "--seed", "1"])
    assert (output / "ft.safetensors").is_file()
    assert {cache: cache.read_bytes() for cache in caches} == caches
    assert sorted(p.name for p in finetune_folder.glob("*.npz")) == sorted(p.name for p in caches)


def test_merge_keeps_other_fields_and_updates_in_place(finetune_folder, tmp_path):
    """kohya's merging: without --in_json an existing out_json is updated; fields it does not set are kept."""
    from finetune import merge_captions_to_metadata, merge_dd_tags_to_metadata

    for stem in SIZES:
        (finetune_folder / f"{stem}.caption").write_text(f"caption {stem}", encoding="utf-8")
    meta = tmp_path / "meta.json"
    meta.write_text(json.dumps({"img0": {"train_resolution": [64, 64]}, "gone": {"caption": "kept"}}), encoding="utf-8")
    merge_captions_to_metadata.main([str(finetune_folder), str(meta)])
    merge_dd_tags_to_metadata.main([str(finetune_folder), str(meta)])
    merged = json.loads(meta.read_text(encoding="utf-8"))
    assert list(merged) == ["img0", "gone", "img1", "img2", "img3"]
    assert merged["img0"] == {"train_resolution": [64, 64], "caption": "caption img0", "tags": "a photo of img0, red, square"}
    assert merged["gone"] == {"caption": "kept"}


@pytest.mark.parametrize("argv, message", [
    (["{images}", "{out}", "--recursive"], "--recursive needs --full_path"),
    (["{images}", "{out}", "--caption_extension", ".caption"], "img0.caption and 3 more not found"),
    (["{images}", "{out}", "--in_json", "{broken}"], "is not a metadata JSON file"),
    (["{images}", "{images}/meta.txt"], "only .json is written"),
])
def test_merge_bad_input_is_one_line_exit_2(finetune_folder, tmp_path, argv, message):
    broken = tmp_path / "broken.json"
    broken.write_text("{not json", encoding="utf-8")
    out = tmp_path / "meta.json"
    values = {"images": finetune_folder, "out": out, "broken": broken}
    result = run_as_gui([sys.executable, str(REPO / "finetune" / "merge_captions_to_metadata.py"),
                         *[part.format(**values) for part in argv]], cwd=tmp_path, expect=2)
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not out.exists()


def test_prepare_refuses_before_loading_a_model(finetune_folder, tmp_path, capsys):
    from finetune import prepare_buckets_latents
    from library.errors import exit_on_user_error

    def stderr_of(argv: list[str]) -> str:
        capsys.readouterr()
        with pytest.raises(SystemExit) as stopped:
            exit_on_user_error(lambda: prepare_buckets_latents.main(argv))
        assert stopped.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    no_model = str(tmp_path / "no_model")
    missing_json = stderr_of([str(finetune_folder), str(tmp_path / "none.json"), str(tmp_path / "out.json"), no_model])
    assert "in_json" in missing_json and "none.json does not exist" in missing_json
    (tmp_path / "meta.json").write_text("{}", encoding="utf-8")
    assert "--max_resolution '512x512'" in stderr_of([str(finetune_folder), str(tmp_path / "meta.json"),
                                                      str(tmp_path / "out.json"), no_model, "--max_resolution",
                                                      "512x512"])
    assert "model_name_or_path" in stderr_of([str(finetune_folder), str(tmp_path / "meta.json"),
                                              str(tmp_path / "out.json"), no_model])
    assert not (tmp_path / "out.json").exists() and not list(finetune_folder.glob("*.npz"))


@pytest.mark.slow
def test_sd15_prepared_caches_are_sd_files_that_train_network_reuses(tiny_models, finetune_folder, tmp_path):
    """An SD 1.x model names the caches ``_sd.npz`` (kohya's SD strategy); train_network --in_json takes them."""
    from finetune import merge_captions_to_metadata, prepare_buckets_latents

    merge_captions_to_metadata.main([str(finetune_folder), str(tmp_path / "meta_cap.json"), "--caption_extension", ".txt"])
    prepare_buckets_latents.main([str(finetune_folder), str(tmp_path / "meta_cap.json"), str(tmp_path / "meta_lat.json"),
                                  str(tiny_models["sd15"]), "--max_resolution", "128,128", "--min_bucket_reso", "64",
                                  "--max_bucket_reso", "256", "--flip_aug"])
    caches = sorted(finetune_folder.glob("*.npz"))
    assert [cache.name for cache in caches] == [f"{stem}_{w:04d}x{h:04d}_sd.npz" for stem, (w, h) in SIZES.items()]
    with np.load(caches[2]) as npz:  # img2: bucket 64x192, latents 24x8, flipped too
        assert npz["latents_24x8"].shape == npz["latents_flipped_24x8"].shape == (4, 24, 8)
    before = {cache: cache.read_bytes() for cache in caches}
    run_trainer("train_network", [
        "--pretrained_model_name_or_path", str(tiny_models["sd15"]), "--in_json", str(tmp_path / "meta_lat.json"),
        "--train_data_dir", str(finetune_folder), "--resolution", "128", "--enable_bucket", "--min_bucket_reso", "64",
        "--max_bucket_reso", "256", "--flip_aug", "--cache_latents", "--cache_latents_to_disk",
        "--network_module", "networks.lora", "--network_dim", "2", "--network_train_unet_only", "--max_train_steps", "1",
        "--output_dir", str(tmp_path / "out"), "--output_name", "ft", "--seed", "1"])
    assert (tmp_path / "out" / "ft.safetensors").is_file()
    assert {cache: cache.read_bytes() for cache in caches} == before
