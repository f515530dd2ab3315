"""The LECO / concept-slider trainable (kohya sd-scripts v0.11.1 ``train_leco.py`` / ``sdxl_train_leco.py``).

A UNet LoRA of any ``--network_module`` (the LoRA trainable's network, files and metadata) trained
without an image dataset, against the frozen UNet's own predictions. Its batches
(``PromptPairData``, the core's ``Trainable.training_data`` hook) are the prompt file's pairs
(``library.leco_prompts``), one per micro-batch; everything random in a micro-batch (the pair, the
number of denoising steps, the resolution, the initial noise, SDXL's size conditioning) is drawn
from a generator keyed by (``--seed``, epoch, position), so a resumed run draws what the
uninterrupted one drew. Its loss (``compute_loss``), per micro-batch:

1. partially denoise the initial noise (``--max_denoising_steps`` DDPM steps, the drawn number of
   them, LoRA at the pair's multiplier, classifier-free guidance ``--leco_denoise_guidance_scale``),
   without gradients;
2. at the matching training timestep the frozen UNet (LoRA at 0) predicts noise for the pair's
   positive, neutral and unconditional prompts: the target (``leco_prompts.leco_target``);
3. the UNet with the LoRA at the pair's multiplier predicts for the pair's target prompt; the loss is
   the core's (``losses.batch_loss``: ``--loss_type``, ``--min_snr_gamma``) times the pair's weight.

The denoising runs without gradients as in the original LECO (kohya's records the graph through
the denoising chain; the target and the trained prediction are the same either way). The loop,
guard, fp16 scaler, healing, states and files are the core's.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from accelerate import Accelerator

from library import losses, lora_metadata, noise, sampling, train_state
from library.errors import UserError
from library.leco_prompts import PromptPair, leco_target, load_prompt_pairs
from library.model_loading import StableDiffusionModels
from library.run_data import Window
from library.trainables.lora import LoraTrainable

CHECKPOINT_TIMESTEPS = 1000
DRAW_STREAM = 11  # the keyed generator's stream of LECO's draws (noise.sample_generator)
SIZE_KEYS = ("original_sizes_hw", "crop_top_lefts", "target_sizes_hw")
# Options of an image dataset or of the image loss path that a LECO run has no use for.
NOT_FOR_LECO = ("train_data_dir", "dataset_config", "cache_latents", "cache_text_encoder_outputs", "validation_split",
                "max_train_epochs", "debiased_loss", "train_inpainting", "network_train_text_encoder_only",
                "find_lr", "find_lr_only")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """kohya's LECO options."""
    parser.add_argument("--prompts_file", type=str, default=None,
                        help="LECO prompt file (TOML; .yaml/.yml read as YAML): LECO pairs or ai-toolkit slider targets")
    parser.add_argument("--max_denoising_steps", type=int, default=40,
                        help="number of partial denoising steps per iteration (default 40)")
    parser.add_argument("--leco_denoise_guidance_scale", type=float, default=3.0,
                        help="guidance scale for the partial denoising pass (default 3.0)")


def validate_arguments(args: argparse.Namespace) -> list[PromptPair]:
    """The LECO options checked and the prompt file read, before any model loads."""
    if not args.prompts_file:
        raise UserError("--prompts_file: required; give the LECO prompt file (TOML, or YAML as .yaml/.yml)")
    if not args.output_dir:
        raise UserError("--output_dir: required; give the folder the LoRA is written to")
    if args.max_denoising_steps < 2:
        raise UserError(f"--max_denoising_steps {args.max_denoising_steps}: must be at least 2")
    for flag in NOT_FOR_LECO:
        if getattr(args, flag, None):
            raise UserError(f"--{flag}: LECO trains a UNet LoRA from prompts alone (no images, no epochs); remove "
                            f"the option")
    pairs = load_prompt_pairs(args.prompts_file)
    for pair in pairs:
        height, width = pair.resolution
        if height % 8 or width % 8 or height < 64 or width < 64:
            raise UserError(f"--prompts_file {args.prompts_file}: resolution {pair.resolution} must be multiples of "
                            f"8, at least 64")
    return pairs


def random_resolution(pair: PromptPair, generator: torch.Generator) -> tuple[int, int]:
    """The pair's (height, width); ``dynamic_resolution`` (square ones): a random multiple of 64
    between half and the full size for each side, as kohya's bucket draw."""
    height, width = pair.resolution
    if not (pair.dynamic_resolution and height == width):
        return height, width
    low, high = height // 2 // 64, height // 64
    drawn = torch.randint(low, high + 1, (2,), generator=generator)
    return int(drawn[0]) * 64, int(drawn[1]) * 64


def size_conditioning(height: int, width: int, batch_size: int, dynamic_crops: bool,
                      generator: Optional[torch.Generator] = None) -> dict[str, torch.Tensor]:
    """SDXL's micro-conditioning for the drawn latents (``dynamic_crops``: a random larger original
    size and crop, as kohya's ``get_add_time_ids``)."""
    original, crop = (height, width), (0, 0)
    if dynamic_crops:
        scale = float(torch.rand(1, generator=generator)) * 2 + 1
        original = (int(height * scale), int(width * scale))
        crop = (int(torch.randint(0, max(original[0] - height, 1), (1,), generator=generator)),
                int(torch.randint(0, max(original[1] - width, 1), (1,), generator=generator)))
    rows = lambda pair: torch.tensor([pair], dtype=torch.float32).repeat(batch_size, 1)  # noqa: E731
    return dict(zip(SIZE_KEYS, (rows(original), rows(crop), rows((height, width)))))


def repeat_conditioning(conditioning: Any, batch_size: int) -> Any:
    """A cached prompt's conditioning (a tensor, or SDXL's (hidden states, pooled)) for a batch."""
    if isinstance(conditioning, tuple):
        return tuple(repeat_conditioning(part, batch_size) for part in conditioning)
    return conditioning.expand(batch_size, *conditioning.shape[1:])


def training_timestep(scheduler: Any, denoise_to: int, max_denoising_steps: int) -> int:
    """The 1000-step schedule's timestep where the partial denoising of ``denoise_to`` steps stopped."""
    scheduler.set_timesteps(CHECKPOINT_TIMESTEPS)
    return int(scheduler.timesteps[int(denoise_to * CHECKPOINT_TIMESTEPS / max_denoising_steps)])


@dataclass(frozen=True)
class PromptPairItem:
    """A prompt pair as the healing and the NaN report name a sample: where it is and its prompt."""

    path: str
    caption: str


class PromptPairSet:
    """The pairs in the role of the image dataset (what the healing, its quarantine and the NaN
    report read): a sample id is the pair's index."""

    unit = "prompt pairs"

    def __init__(self, prompts_file: str, pairs: list[PromptPair]) -> None:
        self.pairs = pairs
        self.images = [PromptPairItem(f"{prompts_file} (pair {index + 1}: {pair.action} {pair.positive!r} at "
                                      f"multiplier {pair.multiplier:g})", pair.target)
                       for index, pair in enumerate(pairs)]
        self.plan = self  # ``dataset.plan.images``
        self.num_train_images = len(pairs)
        self.max_batch_size = max(pair.batch_size for pair in pairs)

    def image_index_of(self, sample_id: int) -> int:
        return sample_id

    def image_of(self, sample_id: int) -> PromptPairItem:
        return self.images[sample_id]


class PromptPairData:
    """A LECO run's batches with ``library.run_data.TrainingData``'s interface: one epoch of
    ``--max_train_steps`` windows of ``--gradient_accumulation_steps`` micro-batches, each one pair
    (a random one, as kohya's) with its draws keyed by (seed, epoch, position, process)."""

    validation_dataset = None
    num_workers = 0

    def __init__(self, args: argparse.Namespace, pairs: list[PromptPair], rank: int, world_size: int,
                 device: torch.device) -> None:
        self.dataset = PromptPairSet(args.prompts_file, pairs)
        self.pairs, self.rank, self.world_size, self.device = pairs, rank, world_size, device
        self.seed, self.accumulation = args.seed, args.gradient_accumulation_steps
        self.max_denoising_steps, self.noise_offset = args.max_denoising_steps, args.noise_offset
        self.scheduler = noise.training_noise_scheduler(args.zero_terminal_snr)
        self.steps_per_epoch = args.max_train_steps
        self.num_epochs = 1
        self.quarantined: frozenset[int] = frozenset()  # pair indices, kept current by the trainer

    def __len__(self) -> int:
        """Micro-batches per epoch on this process."""
        return self.steps_per_epoch * self.accumulation

    def windows(self, progress: train_state.Progress, max_steps: int, stopped: Callable[[], bool],
                on_epoch_start: Callable[[], None] = lambda: None) -> Iterator[Window]:
        """As ``TrainingData.windows``: from where ``progress`` is, ``progress.batches_done`` advanced
        before each window is yielded."""
        while progress.global_step < max_steps and not stopped():
            on_epoch_start()
            while progress.global_step < max_steps and not stopped():
                position = progress.batches_done
                batches = [self.batch(progress.epoch, position + offset) for offset in range(self.accumulation)]
                progress.batches_done += self.accumulation
                window = Window(progress.epoch, [batch for batch in batches if batch is not None],
                                ends_epoch=progress.batches_done >= len(self))
                window.trains = bool(window.batches)
                yield window
                if window.ends_epoch:
                    break

    def next_epoch(self, progress: train_state.Progress) -> None:
        progress.start_next_epoch()

    def batches_since(self, position: tuple[int, int], progress: train_state.Progress) -> int:
        return progress.batches_since(position, len(self))

    def batch(self, epoch: int, position: int) -> Optional[dict[str, Any]]:
        """The micro-batch at ``position`` of ``epoch``: a pair left in (None when every pair is
        quarantined), its initial noise, denoising steps, training timestep and size conditioning."""
        choices = [index for index in range(len(self.pairs)) if index not in self.quarantined]
        if not choices:
            return None
        generator = noise.sample_generator(self.seed, epoch, position * self.world_size + self.rank, DRAW_STREAM)
        pair_index = choices[int(torch.randint(0, len(choices), (1,), generator=generator))]
        pair = self.pairs[pair_index]
        denoise_to = int(torch.randint(1, self.max_denoising_steps, (1,), generator=generator))
        height, width = random_resolution(pair, generator)
        latents = torch.randn((pair.batch_size, 4, height // 8, width // 8), generator=generator)
        latents = latents * self.scheduler.init_noise_sigma
        if self.noise_offset:
            latents = latents + self.noise_offset * torch.randn((pair.batch_size, 4, 1, 1), generator=generator)
        sizes = size_conditioning(height, width, pair.batch_size, pair.dynamic_crops, generator)
        timestep = training_timestep(self.scheduler, denoise_to, self.max_denoising_steps)
        step_noise_seed = int(torch.randint(0, 2**62, (1,), generator=generator))  # the DDPM steps' noise
        batch = {"pair": pair_index, "denoise_to": denoise_to, "step_noise_seed": step_noise_seed, "latents": latents,
                 "sample_indices": torch.full((pair.batch_size,), pair_index, dtype=torch.long),
                 "timesteps": torch.full((pair.batch_size,), timestep, dtype=torch.long),
                 "loss_weights": torch.full((pair.batch_size,), pair.weight, dtype=torch.float32), **sizes}
        return {key: value.to(self.device) if isinstance(value, torch.Tensor) else value
                for key, value in batch.items()}


class LecoTrainable(LoraTrainable):
    """A UNet LoRA trained by LECO (see the module's docstring); what trains, its files and states
    are the LoRA trainable's."""

    def __init__(self) -> None:
        super().__init__()
        self.pairs: list[PromptPair] = []
        self.conditioning: dict[str, Any] = {}  # prompt -> its encoded conditioning (batch of one)
        self.denoiser = None  # the partial denoising's own DDPM scheduler (set_timesteps changes it)

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        super().add_arguments(parser)
        add_arguments(parser)

    def validate_arguments(self, args: argparse.Namespace, sdxl: bool) -> None:
        self.pairs = validate_arguments(args)  # its own first: a bad prompt file is named before the rest
        args.network_train_unet_only = True  # LECO trains the UNet's LoRA only (kohya)
        super().validate_arguments(args, sdxl)

    def configure(self, args: argparse.Namespace) -> None:
        super().configure(args)
        self.max_denoising_steps, self.guidance_scale = args.max_denoising_steps, args.leco_denoise_guidance_scale
        self.denoiser = noise.training_noise_scheduler(args.zero_terminal_snr)

    def training_data(self, args: argparse.Namespace, accelerator: Accelerator) -> PromptPairData:
        return PromptPairData(args, self.pairs, accelerator.process_index, accelerator.num_processes,
                              accelerator.device)

    def metadata(self, args: argparse.Namespace, accelerator: Accelerator, models: StableDiffusionModels,
                 data: Any, optimization: Any, progress: train_state.Progress) -> dict[str, str]:
        """The LoRA's training and base-model metadata (no dataset), and kohya's ``ss_leco_*``."""
        pairs = self.pairs
        return {
            **lora_metadata.training_metadata(args, models.kind, {
                "session_id": progress.session_id, "training_started_at": progress.training_started_at,
                "num_train_images": 0, "num_reg_images": 0, "num_batches_per_epoch": len(data),
                "num_epochs": data.num_epochs,
                "optimizer": optimization.optimizer_name + (f"({optimization.optimizer_args})"
                                                            if optimization.optimizer_args else ""),
                "network_args": self.config.network_args}),
            **lora_metadata.base_model_metadata(args),
            "ss_leco_prompt_count": str(len(pairs)),
            "ss_leco_prompts_file": os.path.basename(args.prompts_file),
            "ss_leco_preview": json.dumps([pair.preview() for pair in pairs[:16]], ensure_ascii=False),
        }

    def before_training(self, trainer: Any, run: Any) -> None:
        """Every prompt encoded once; the text encoders then leave the device (unless images are sampled)."""
        prompts = sorted({prompt for pair in self.pairs
                          for prompt in (pair.target, pair.positive, pair.unconditional, pair.neutral)})
        with torch.no_grad(), run.loss.autocast:
            self.conditioning = {prompt: trainer.encode_prompts(run.args, run.models, [prompt]) for prompt in prompts}
        if not sampling.is_scheduled(run.args):
            for text_encoder in run.models.text_encoders:
                text_encoder.to("cpu")

    def compute_loss(self, hooks: Any, run: Any, batch: dict[str, Any], epoch: int, plan: losses.BatchWeights,
                     timesteps: Optional[torch.Tensor] = None, seed: Optional[int] = None) -> losses.WeightedLoss:
        """The micro-batch's LECO loss (the module's docstring): denoise, target, prediction."""
        pair = self.pairs[batch["pair"]]
        sizes = {key: batch[key] for key in SIZE_KEYS}
        timesteps = batch["timesteps"] if timesteps is None else timesteps

        def predict(latents: torch.Tensor, step_timesteps: torch.Tensor, prompt: str) -> torch.Tensor:
            conditioning = repeat_conditioning(self.conditioning[prompt], latents.shape[0])
            return hooks.predict(run.models, latents, step_timesteps, conditioning, sizes)

        network = self.module
        with torch.no_grad():
            network.set_multiplier(pair.multiplier)
            latents = self.denoise(predict, batch["latents"], batch["denoise_to"], pair,
                                   torch.Generator("cpu").manual_seed(batch["step_noise_seed"]))
            network.set_multiplier(0.0)
            positive, neutral, unconditional = (predict(latents, timesteps, prompt).float()
                                                for prompt in (pair.positive, pair.neutral, pair.unconditional))
            target = leco_target(pair, positive, neutral, unconditional)
        network.set_multiplier(pair.multiplier)
        prediction = predict(latents, timesteps, pair.target)
        network.set_multiplier(1.0)  # what a file and a sample mean by the LoRA (the graph keeps the pair's)
        return losses.batch_loss(prediction.float(), target, plan, run.loss_options)

    def denoise(self, predict: Callable[..., torch.Tensor], latents: torch.Tensor, denoise_to: int,
                pair: PromptPair, generator: torch.Generator) -> torch.Tensor:
        """The first ``denoise_to`` of ``--max_denoising_steps`` DDPM steps with guidance (``generator``:
        the steps' variance noise, keyed like the batch)."""
        scheduler = self.denoiser
        scheduler.set_timesteps(self.max_denoising_steps, device=latents.device)
        for timestep in scheduler.timesteps[:denoise_to]:
            step_timesteps = timestep.expand(latents.shape[0])
            unconditional = predict(latents, step_timesteps, pair.unconditional)
            conditional = predict(latents, step_timesteps, pair.target)
            guided = unconditional + self.guidance_scale * (conditional - unconditional)
            latents = scheduler.step(guided.float(), timestep, latents.float(),
                                     generator=generator).prev_sample.to(latents.dtype)
        return latents
