"""Batches scored again and again, encoded once (library/fixed_batches.py): validation, the effect monitor's
probe and the learning-rate finder score their fixed batches with the VAE's latents and, where nothing can
change it, the text conditioning computed at the first pass; every figure and file stays bit-identical."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import model_args, run_trainer
from test_know_your_lora import three_images  # noqa: F401 (a fixture)
from test_validation import CAPTION_EXTENSION, jsonl_rows, safetensors_parts, trainer_args

import sdxl_train
import sdxl_train_network
import train_network
from library import lr_finder, validation
from library.training import diffusion_loss

TIMESTEPS = (200, 800)


def lora_argv(tiny_models, dataset: Path, output_dir: Path, *extra: str, model: str = "sdxl") -> list[str]:
    """``trainer_args``' run with a LoRA on the UNet and the text encoders unless ``extra`` says otherwise."""
    return [arg for arg in trainer_args(tiny_models, dataset, output_dir, model=model)
            if arg != "--network_train_unet_only"] + list(extra)


def built_run(trainer_class: type, setup_parser, argv: list[str]):
    """The trainer and the run it builds from ``argv`` (models loaded, what trains attached), not trained."""
    from accelerate.state import AcceleratorState, GradientState

    built = {}

    class Building(trainer_class):
        def train(self, args, explicit):
            built["trainer"], built["run"] = self, self.build_run(args, explicit)

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    train_network.main(Building, setup_parser, argv)
    built["run"].states.close()
    return built["trainer"], built["run"]


def losses_of(trainer, run, batch) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batch's (loss, weight sum) at each of ``TIMESTEPS``, as a validation pass computes them."""
    size = len(batch["sample_indices"])
    with torch.no_grad():
        return [trainer.validation_loss(run.loss, batch, torch.full((size,), timestep, dtype=torch.long),
                                        validation.draw_epoch(timestep), 11) for timestep in TIMESTEPS]


def assert_same_bits(first: list[tuple[torch.Tensor, torch.Tensor]], second: list[tuple[torch.Tensor, torch.Tensor]]
                     ) -> None:
    assert len(first) == len(second) == len(TIMESTEPS)
    for (loss, weights), (other_loss, other_weights) in zip(first, second):
        assert torch.equal(loss, other_loss) and torch.equal(weights, other_weights), (loss, other_loss)


@pytest.mark.device
@pytest.mark.parametrize("model,precision", [("sdxl", "fp16"), ("sd15", "no")])
def test_an_encoded_batch_gives_the_bits_of_the_batch(model, precision, tiny_models, three_images, tmp_path):
    """A UNet LoRA: the VAE's distribution replaces the images and the conditioning is kept (SDXL: hidden
    states and pooled; SD1.5: one tensor), both equal to the bit to what the loss path computes from the
    images and captions under the run's autocast, and the losses are the same bits."""
    script = sdxl_train_network if model == "sdxl" else train_network
    trainer_class = sdxl_train_network.SdxlNetworkTrainer if model == "sdxl" else train_network.NetworkTrainer
    trainer, run = built_run(trainer_class, script.setup_parser, lora_argv(
        tiny_models, three_images, tmp_path, "--network_train_unet_only", "--mixed_precision", precision,
        model=model))
    assert run.loss.text_encoding_fixed
    batch = lr_finder.probe_batches(run, 1)[0]
    fixed = trainer.fixed_batches(run.loss, [batch])
    encoded = fixed[0]
    assert fixed[0] is encoded and len(fixed) == 1  # encoded once, kept
    assert "images" in batch and "images" not in encoded and "text_encoder_outputs" not in batch
    models, indices = run.models, batch["sample_indices"].tolist()
    with torch.no_grad(), run.loss.autocast:
        latents = diffusion_loss.encode_latents(models.vae, batch["images"], 11, -201, indices)
        conditioning = trainer.encode_prompts(run.args, models, batch["captions"])
    cached = diffusion_loss.sample_latents(encoded["latent_distribution"], models.vae.config.scaling_factor, 11, -201,
                                           indices)
    assert torch.equal(cached, latents)
    kept = encoded["text_encoder_outputs"]
    if model == "sdxl":
        assert isinstance(kept, tuple) and len(kept) == 2
        assert all(torch.equal(mine, theirs) for mine, theirs in zip(kept, conditioning))
    else:
        assert torch.equal(kept, conditioning)
    assert_same_bits(losses_of(trainer, run, encoded), losses_of(trainer, run, batch))


def test_a_text_encoder_lora_keeps_the_conditioning_computed_at_every_pass(tiny_models, three_images, tmp_path):
    """With a LoRA in the text encoders the captions are encoded at every pass: the conditioning moves
    with the adapters' weights and multiplier (the monitor's base pass sets it to 0). Only the latents are
    kept, and the losses at multipliers 1 and 0 are those of the batch itself, and differ."""
    trainer, run = built_run(sdxl_train_network.SdxlNetworkTrainer, sdxl_train_network.setup_parser,
                             lora_argv(tiny_models, three_images, tmp_path))
    network = run.network
    assert network.text_encoder_loras and not run.loss.text_encoding_fixed
    with torch.no_grad():  # trained text encoder adapters: their up weights no longer 0
        generator = torch.Generator().manual_seed(0)
        for parameter in (p for lora in network.text_encoder_loras for p in lora.parameters()):
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    batch = lr_finder.probe_batches(run, 1)[0]
    encoded = trainer.fixed_batches(run.loss, [batch])[0]
    assert "images" not in encoded and "text_encoder_outputs" not in encoded and "latent_distribution" in encoded
    with_lora = losses_of(trainer, run, encoded)
    assert_same_bits(with_lora, losses_of(trainer, run, batch))
    network.set_multiplier(0.0)
    base = losses_of(trainer, run, encoded)
    assert_same_bits(base, losses_of(trainer, run, batch))
    assert all(not torch.equal(lora[0], plain[0]) for lora, plain in zip(with_lora, base))


@pytest.mark.parametrize("extra,fixed", [((), True), (("--train_text_encoder",), False)])
def test_a_full_fine_tune_keeps_the_conditioning_unless_a_text_encoder_trains(extra, fixed, tiny_models,
                                                                            three_images, tmp_path):
    _, run = built_run(sdxl_train.FullModelTrainer, sdxl_train.setup_parser, model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(three_images), "--caption_extension", CAPTION_EXTENSION, "--output_dir",
        str(tmp_path), "--resolution", "64", "--seed", "1", "--max_data_loader_n_workers", "0",
        "--max_train_steps", "1", *extra])
    assert run.loss.text_encoding_fixed is fixed


def scored_keys(rows: list[dict]) -> list[dict]:
    """What a run's JSON lines say about its losses and the LoRA's effect (no clock times)."""
    return [{key: value for key, value in row.items() if key == "step" or key.startswith(("loss/", "effect/"))}
            for row in rows]


@pytest.mark.device
@pytest.mark.parametrize("extra", [
    # the finder and the validation passes, the conditioning kept
    ("--network_train_unet_only", "--find_lr", "--find_lr_steps", "2", "--validation_split", "0.34",
     "--validate_every_n_steps", "2"),
    # the monitor's training probe (checked at steps 1-4) with a text encoder LoRA: only the latents kept
    (),
], ids=["finder_validation", "probe_text_encoder_lora"])
def test_runs_with_and_without_encoding_once_are_the_same_bits(extra, tiny_models, three_images, tmp_path,
                                                             monkeypatch):
    """Every loss, effect and validation figure, the finder's CSV and the LoRA's bytes are those of the same
    run encoding every pass's batches anew (the fixed batches switched off: read as they are)."""
    def train(name: str) -> tuple[list[dict], bytes, str]:
        log = tmp_path / f"{name}.jsonl"
        run_trainer("sdxl_train_network", lora_argv(tiny_models, three_images, tmp_path / name, "--max_train_steps",
                                                    "4", "--log_jsonl", str(log), *extra))
        finder = tmp_path / name / "last-lr_find.csv"
        return (scored_keys(jsonl_rows(log)), safetensors_parts(tmp_path / name / "last.safetensors")[2],
                finder.read_text() if finder.exists() else "")

    once = train("once")
    with monkeypatch.context() as patch:
        patch.setattr(diffusion_loss, "fixed_batch_encoder", lambda hooks, run: None)
        every_pass = train("every_pass")
    rows = once[0]
    kinds = {key for row in rows for key in row}
    assert {"effect/output_rel", "effect/weight_rel_median"} <= kinds
    assert ("loss/validation/step_average" in kinds) == bool(extra)
    assert ("effect/probe_rel" in kinds) == (not extra)
    assert bool(once[2]) == bool(extra)
    assert once == every_pass
