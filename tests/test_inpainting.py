"""--train_inpainting (kohya v0.10.4+): the 9-channel UNet input, the keyed random masks, the refusals."""
from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import SCRIPT_ENV, model_args, run_trainer, run_training_process, train_expecting_user_error
from safetensors.torch import load_file

from library import inpainting, noise
from library.model_loading import load_models


@pytest.fixture(scope="module")
def tiny_inpainting(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tools.build_tiny_models import build_tiny_inpainting_models

    return build_tiny_inpainting_models(tmp_path_factory.mktemp("tiny_inpainting"))


def lora_argv(model: list[str], dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    return [*model, "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
            "--output_dir", str(output_dir), "--output_name", "inpaint", "--seed", "7",
            "--max_data_loader_n_workers", "0", "--network_module", "networks.lora", "--network_dim", "4",
            "--network_alpha", "4", "--optimizer_type", "AdamW", "--mixed_precision", "no", *extra]


# ---------------------------------------------------------------------------
# masks
# ---------------------------------------------------------------------------

def test_masks_are_keyed_by_seed_epoch_and_sample():
    batch = inpainting.training_masks(11, 2, [0, 5, 9], 64, 48)
    assert batch.shape == (3, 1, 64, 48)
    assert torch.equal(batch[1], inpainting.training_masks(11, 2, [5], 64, 48)[0])  # batch-independent
    assert torch.equal(batch, inpainting.training_masks(11, 2, [0, 5, 9], 64, 48))  # same key, same bytes
    assert not torch.equal(batch[0], inpainting.training_masks(12, 2, [0], 64, 48)[0])  # another seed
    assert not torch.equal(batch[0], inpainting.training_masks(11, 3, [0], 64, 48)[0])  # another epoch
    assert set(batch.unique().tolist()) <= {0.0, 1.0}


def test_mask_kinds_and_coverage_follow_kohya():
    """kohya's random_mask: cloud 40% (a third united with a polygon or shape), polygon 35%, shape 25%;
    clouds mask 10-30% of the area; a shape's box 10-60%."""
    kinds, coverage = Counter(), {}
    for index in range(600):
        mask, kind = inpainting.random_mask(96, 64, noise.sample_generator(3, 0, index, noise.STREAM_INPAINTING_MASK))
        kinds[kind] += 1
        coverage.setdefault(kind, []).append(mask.mean().item())
    assert set(kinds) == {"cloud", "cloud+polygon", "cloud+shape", "polygon", "shape"}
    clouds = kinds["cloud"] + kinds["cloud+polygon"] + kinds["cloud+shape"]
    # Binomial(600, p): 4 standard deviations.
    for observed, p in ((clouds, 0.40), (kinds["polygon"], 0.35), (kinds["shape"], 0.25),
                        (kinds["cloud+polygon"] + kinds["cloud+shape"], 0.40 * 0.33)):
        assert abs(observed - 600 * p) < 4 * (600 * p * (1 - p)) ** 0.5
    assert all(0.1 - 0.01 <= c <= 0.3 + 0.01 for c in coverage["cloud"])  # the quantile cut, ties aside
    # PIL fills the box's last row and column too: one pixel more each way than the drawn sides.
    largest_box = (0.6 ** 0.5 * 96 + 1) * (0.6 ** 0.5 * 64 + 1) / (96 * 64)
    assert all(0.0 < c <= largest_box for c in coverage["shape"])


# kohya's own random_mask (library/mask_generator.py, commit 063ef100, run outside the project in
# /work/harness_inpaint): the masked fraction of 2000 masks at 128x96, seeds 0..1999.
KOHYA_COVERAGE = {"mean": 0.2140, "std": 0.1084, "quantiles": (0.0552, 0.1353, 0.2020, 0.2771, 0.4154)}


def test_mask_coverage_matches_kohyas_generator():
    """The same distribution of masked area as kohya's generator. Two independent means of 2000 draws
    with std 0.11 differ by about 0.0035: 4 of those; a quantile's sampling error is of the same order
    (density-dependent, 0.02 allows for the tails)."""
    coverage = torch.tensor([
        inpainting.random_mask(128, 96, noise.sample_generator(0, 0, index, noise.STREAM_INPAINTING_MASK))[0].mean()
        for index in range(2000)], dtype=torch.float64)
    assert abs(coverage.mean().item() - KOHYA_COVERAGE["mean"]) < 0.014
    assert abs(coverage.std(unbiased=False).item() - KOHYA_COVERAGE["std"]) < 0.01
    found = torch.quantile(coverage, torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=torch.float64))
    for ours, kohyas in zip(found.tolist(), KOHYA_COVERAGE["quantiles"]):
        assert abs(ours - kohyas) < 0.02


def test_sample_mask_is_one_blob_of_about_a_fifth():
    mask = inpainting.sample_mask(128, 128, seed=4)
    assert torch.equal(mask, inpainting.sample_mask(128, 128, seed=4))
    assert 0.1 < mask.mean().item() < 0.35


def test_unet_input_channels_in_kohya_order():
    images = torch.rand(2, 3, 32, 32) * 2 - 1
    masks = torch.zeros(2, 1, 32, 32)
    masks[:, :, :16] = 1.0
    seen = []

    def encode(masked: torch.Tensor) -> torch.Tensor:
        seen.append(masked)
        return masked[:, :, ::8, ::8].repeat(1, 2, 1, 1)[:, :4] * 0.5

    extra = inpainting.conditioning_channels(images, masks, encode)
    assert extra.shape == (2, 5, 4, 4)
    assert torch.equal(extra[:, 0, :2], torch.ones(2, 2, 4)) and torch.equal(extra[:, 0, 2:], torch.zeros(2, 2, 4))
    assert torch.equal(seen[0][:, :, :16], torch.zeros(2, 3, 16, 32))  # the masked region is mid-grey
    assert torch.equal(seen[0][:, :, 16:], images[:, :, 16:])


# ---------------------------------------------------------------------------
# models and refusals
# ---------------------------------------------------------------------------

def test_nine_channel_conv_in_is_read_from_the_checkpoint(tiny_inpainting, tiny_models):
    """The inpainting single file loads with the base model's configs: its conv_in decides the input."""
    models = load_models(tiny_inpainting["sd15_inpaint_file"], sdxl=False, model_config_dir=tiny_models["sd15_config"])
    assert models.unet.config.in_channels == 9
    stored = load_file(tiny_inpainting["sd15_inpaint_file"])["model.diffusion_model.input_blocks.0.0.weight"]
    assert torch.equal(models.unet.conv_in.weight, stored)


def test_inpainting_on_a_four_channel_model_is_refused(tiny_models, one_image_dataset, tmp_path, capsys):
    error = train_expecting_user_error(
        lora_argv(model_args(tiny_models, "sdxl"), one_image_dataset, tmp_path, "--train_inpainting"), capsys)
    assert error.startswith("error: --train_inpainting:") and "4 channels" in error and "9" in error


def test_an_inpainting_model_without_the_flag_is_refused(tiny_models, tiny_inpainting, one_image_dataset, tmp_path,
                                                         capsys):
    model = ["--pretrained_model_name_or_path", str(tiny_inpainting["sdxl_inpaint_file"]),
             "--model_config_dir", str(tiny_models["sdxl_config"])]
    error = train_expecting_user_error(lora_argv(model, one_image_dataset, tmp_path), capsys)
    assert "inpainting model" in error and "--train_inpainting" in error


@pytest.mark.parametrize("flag", ["--cache_latents", "--cache_latents_to_disk"])
def test_latent_caching_is_refused(flag, tiny_models, one_image_dataset, tmp_path, capsys):
    error = train_expecting_user_error(
        lora_argv(model_args(tiny_models, "sdxl"), one_image_dataset, tmp_path, "--train_inpainting", flag), capsys)
    assert error.startswith(f"error: {flag} cannot be used with --train_inpainting")
    assert not list(tmp_path.iterdir())  # refused before anything was written


# ---------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------

def losses_of(log: Path) -> list[float]:
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return [row["loss/current"] for row in rows if "loss/current" in row]


@pytest.mark.slow
@pytest.mark.parametrize("name,script", [("sdxl", "sdxl_train_network"), ("sd15", "train_network")])
def test_an_inpainting_lora_trains(name, script, tiny_models, tiny_inpainting, one_image_dataset, tmp_path):
    model = ["--pretrained_model_name_or_path", str(tiny_inpainting[f"{name}_inpaint_file"]),
             "--model_config_dir", str(tiny_models[f"{name}_config"])]
    log = tmp_path / "run.jsonl"
    run_trainer(script, lora_argv(model, one_image_dataset, tmp_path, "--train_inpainting", "--learning_rate", "2e-2",
                                  "--max_train_steps", "24", "--train_batch_size", "4", "--min_timestep", "500",
                                  "--max_timestep", "501", "--log_jsonl", str(log)))
    losses = losses_of(log)
    assert len(losses) == 24
    first, last = sum(losses[:6]) / 6, sum(losses[-6:]) / 6
    print(f"{name}: mean loss of the first 6 steps {first:.4f}, of the last 6 {last:.4f}")
    assert last < first
    weights = load_file(tmp_path / "inpaint.safetensors")
    assert any(key.startswith("lora_unet_") for key in weights)


@pytest.mark.slow
def test_killed_then_resumed_gives_the_uninterrupted_lora_bytes(tiny_models, tiny_inpainting, one_image_dataset,
                                                               tmp_path, capsys, monkeypatch):
    """kill -9 mid-epoch, then ``--resume auto``: the resumed run draws the uninterrupted run's masks (keyed
    by seed, epoch and sample, not by a stream position), so its LoRA is the same bytes."""
    model = ["--pretrained_model_name_or_path", str(tiny_inpainting["sd15_inpaint_file"]),
             "--model_config_dir", str(tiny_models["sd15_config"])]

    def argv(output_dir: Path, *extra: str) -> list[str]:
        return lora_argv(model, one_image_dataset, output_dir, "--train_inpainting", "--learning_rate", "1e-3",
                         "--train_batch_size", "2", "--max_train_steps", "6", "--save_state",
                         "--save_every_n_steps", "2", *extra)  # 5 steps an epoch: the kill is mid-epoch

    monkeypatch.setenv("SOURCE_DATE_EPOCH", SCRIPT_ENV["SOURCE_DATE_EPOCH"])  # the metadata's times, as the killed run's
    run_trainer("train_network", argv(tmp_path / "reference"))
    # dies writing step 4's state, in a process of its own (a fork of this one: no imports to wait for)
    killed = run_training_process("train_network", argv(tmp_path / "run", "--debug_kill_in_state_write", "2"))
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:]
    run_trainer("train_network", argv(tmp_path / "run", "--resume", "auto"))
    assert "resumed at step 2 " in capsys.readouterr().out
    name = "inpaint.safetensors"
    assert (tmp_path / "run" / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()


def test_sample_prompts_with_img_and_mask(tiny_models, tiny_inpainting, one_image_dataset, tmp_path):
    """``--img`` (and ``--mask``) in a sample prompt feed the inpainting pipeline; a prompt without
    ``--img`` draws the whole picture; a missing image skips that prompt only (kohya's rule)."""
    from PIL import Image

    source = next(one_image_dataset.rglob("*.png"))
    mask = tmp_path / "mask.png"
    blank = Image.new("L", (64, 64), 0)
    blank.paste(255, (16, 16, 48, 48))
    blank.save(mask)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"a cat --img {source} --w 64 --h 64 --d 1 --s 2\n"
                       f"a cat --img {source} --mask {mask} --w 64 --h 64 --d 2 --s 2\n"
                       f"a dog --w 64 --h 64 --d 3 --s 2\n"
                       f"a cow --img {tmp_path / 'missing.png'} --w 64 --h 64 --d 4 --s 2\n")
    model = ["--pretrained_model_name_or_path", str(tiny_inpainting["sd15_inpaint_file"]),
             "--model_config_dir", str(tiny_models["sd15_config"])]
    output_dir = tmp_path / "out"
    run_trainer("train_network", lora_argv(model, one_image_dataset, output_dir, "--train_inpainting",
                                           "--max_train_steps", "1", "--sample_at_first",
                                           "--sample_prompts", str(prompts)))
    written = sorted(path.name for path in (output_dir / "sample").iterdir())
    assert [name.split("_")[2] for name in written] == ["00", "01", "02"]
    with Image.open(next((output_dir / "sample").glob("*_01_*.png"))) as sample:
        assert sample.size == (64, 64)


# ---------------------------------------------------------------------------
# full fine-tuning (sdxl_train.py, train_db.py, fine_tune.py)
# ---------------------------------------------------------------------------

CONV_IN_KEY = "model.diffusion_model.input_blocks.0.0.weight"  # the UNet's conv_in in the original layout


def full_argv(model: list[str], dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    return [*model, "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
            "--output_dir", str(output_dir), "--output_name", "ft", "--seed", "1", "--max_data_loader_n_workers", "0",
            "--optimizer_type", "AdamW", "--mixed_precision", "no", "--save_model_as", "safetensors", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("name,script", [("sdxl", "sdxl_train"), ("sd15", "train_db")])
def test_a_full_inpainting_fine_tune_trains_and_its_checkpoint_reloads(name, script, tiny_models, tiny_inpainting,
                                                                       one_image_dataset, tmp_path):
    """The whole 9-channel UNet trains (the mask and masked-image input channels of conv_in included); the
    checkpoint keeps the 9-channel conv_in and loads back, in our loader (the base configs: conv_in read
    from the file) and in diffusers' inpainting pipeline from the single file (given an inpainting
    config: diffusers takes in_channels from the config), holding the trained tensors."""
    import diffusers

    base_file = tiny_inpainting[f"{name}_inpaint_file"]
    model = ["--pretrained_model_name_or_path", str(base_file), "--model_config_dir", str(tiny_models[f"{name}_config"])]
    log = tmp_path / "run.jsonl"
    run_trainer(script, full_argv(model, one_image_dataset, tmp_path, "--train_inpainting", "--learning_rate", "1e-3",
                                  "--max_train_steps", "12", "--min_timestep", "500", "--max_timestep", "501",
                                  "--log_jsonl", str(log)))
    losses = losses_of(log)
    assert len(losses) == 12
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    print(f"{script}: mean loss of the first 3 steps {first:.4f}, of the last 3 {last:.4f}")
    assert last < first
    saved = load_file(tmp_path / "ft.safetensors")[CONV_IN_KEY]
    base = load_file(base_file)[CONV_IN_KEY]
    assert saved.shape[1] == inpainting.INPAINTING_IN_CHANNELS
    assert not torch.equal(saved[:, 4:], base[:, 4:])  # the mask / masked-image weights trained too
    reloaded = load_models(str(tmp_path / "ft.safetensors"), sdxl=name == "sdxl",
                           model_config_dir=tiny_models[f"{name}_config"])
    assert reloaded.unet.config.in_channels == inpainting.INPAINTING_IN_CHANNELS
    assert torch.equal(reloaded.unet.conv_in.weight, saved)
    pipeline_class = (diffusers.StableDiffusionXLInpaintPipeline if name == "sdxl"
                      else diffusers.StableDiffusionInpaintPipeline)
    pipeline = pipeline_class.from_single_file(str(tmp_path / "ft.safetensors"),
                                               config=str(tiny_inpainting[f"{name}_inpaint"]),
                                               local_files_only=True, torch_dtype=torch.float32)
    assert pipeline.unet.config.in_channels == inpainting.INPAINTING_IN_CHANNELS
    assert torch.equal(pipeline.unet.conv_in.weight, saved)


@pytest.mark.parametrize("script", ["sdxl_train", "train_db", "fine_tune"])
def test_full_fine_tune_refuses_latent_caching_with_inpainting(script, tiny_models, one_image_dataset, tmp_path,
                                                               capsys):
    name = "sdxl" if script == "sdxl_train" else "sd15"
    error = train_expecting_user_error(
        full_argv(model_args(tiny_models, name), one_image_dataset, tmp_path, "--train_inpainting", "--cache_latents"),
        capsys, script=script)
    assert error.startswith("error: --cache_latents cannot be used with --train_inpainting")


def test_full_fine_tune_refuses_inpainting_on_a_four_channel_model(tiny_models, one_image_dataset, tmp_path, capsys):
    error = train_expecting_user_error(
        full_argv(model_args(tiny_models, "sdxl"), one_image_dataset, tmp_path, "--train_inpainting"),
        capsys, script="sdxl_train")
    assert error.startswith("error: --train_inpainting:") and "4 channels" in error


@pytest.mark.slow
def test_textual_inversion_on_an_inpainting_model(tiny_models, tiny_inpainting, one_image_dataset, tmp_path):
    """kohya lists train_textual_inversion.py among the --train_inpainting scripts: the new vectors train
    through the 9-channel UNet (the mask input as for a LoRA)."""
    model = ["--pretrained_model_name_or_path", str(tiny_inpainting["sd15_inpaint_file"]),
             "--model_config_dir", str(tiny_models["sd15_config"])]
    run_trainer("train_textual_inversion", [
        *model, "--train_data_dir", str(one_image_dataset), "--resolution", "64", "--output_dir", str(tmp_path),
        "--output_name", "emb", "--seed", "1", "--max_data_loader_n_workers", "0", "--token_string", "zqx",
        "--init_word", "red", "--optimizer_type", "AdamW", "--learning_rate", "1e-2", "--max_train_steps", "3",
        "--save_model_as", "safetensors", "--train_inpainting"])
    from library.trainables import embeddings

    vectors = load_file(tmp_path / "emb.safetensors")["emb_params"]
    base = load_models(str(tiny_inpainting["sd15_inpaint_file"]), sdxl=False, model_config_dir=tiny_models["sd15_config"])
    table = embeddings.token_embedding_module(base.text_encoders[0]).token_embedding.weight.detach()
    start = embeddings.initial_vectors(base.tokenizers[0], table, 1, "red", 1)
    assert vectors.shape == start.shape and torch.isfinite(vectors).all()
    assert not torch.equal(vectors, start.to(vectors.dtype))  # trained away from the init word's vector
