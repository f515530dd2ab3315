"""LECO / concept-slider training (kohya sd-scripts v0.11.1 ``train_leco.py`` / ``sdxl_train_leco.py``).

No image dataset: the LoRA is trained against the frozen UNet's own predictions. One step:

1. pick a prompt pair (``library.leco_prompts``), start from pure noise at the pair's resolution;
2. partially denoise it (``--max_denoising_steps`` DDPM steps, a random number of them, LoRA at the
   pair's multiplier, classifier-free guidance ``--leco_denoise_guidance_scale``), without gradients;
3. at the matching training timestep the frozen UNet (LoRA at 0) predicts noise for the pair's
   positive, neutral and unconditional prompts: the target (``leco_target``);
4. the UNet with the LoRA at the pair's multiplier predicts for the pair's target prompt; the loss
   is their mean squared error (``--min_snr_gamma`` weighted) times the pair's weight.

The denoising runs without gradients as in the original LECO (kohya's records the graph through
the denoising chain; the target and the trained prediction are the same either way).
"""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable, Optional

import torch

from library import losses, noise
from library.errors import UserError
from library.leco_prompts import PromptPair, leco_target, load_prompt_pairs

CHECKPOINT_TIMESTEPS = 1000


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
    if getattr(args, "network_train_text_encoder_only", False):
        raise UserError("--network_train_text_encoder_only: LECO trains a UNet LoRA only; remove the option")
    for flag in ("save_state", "save_state_on_train_end", "resume"):
        if getattr(args, flag, None):
            raise UserError(f"--{flag}: training states are not available for LECO here yet; remove the option "
                            f"(the LoRA files are written as usual)")
    pairs = load_prompt_pairs(args.prompts_file)
    for pair in pairs:
        height, width = pair.resolution
        if height % 8 or width % 8 or height < 64 or width < 64:
            raise UserError(f"--prompts_file {args.prompts_file}: resolution {pair.resolution} must be multiples of "
                            f"8, at least 64")
    return pairs


def metadata(args: argparse.Namespace, pairs: list[PromptPair]) -> dict[str, str]:
    """kohya's LECO metadata (``ss_leco_*``) besides the network's."""
    return {
        "ss_leco_prompt_count": str(len(pairs)),
        "ss_leco_prompts_file": os.path.basename(args.prompts_file),
        "ss_leco_preview": json.dumps([pair.preview() for pair in pairs[:16]], ensure_ascii=False),
    }


def random_resolution(pair: PromptPair, generator: Optional[torch.Generator] = None) -> tuple[int, int]:
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
    return {"original_sizes_hw": rows(original), "crop_top_lefts": rows(crop), "target_sizes_hw": rows((height, width))}


class LecoStep:
    """One LECO example's loss for a network on a family's UNet (``predict(latents, timesteps,
    prompt, sizes)`` runs the UNet with the conditioning of a cached prompt)."""

    def __init__(self, network: Any, predict: Callable[..., torch.Tensor], max_denoising_steps: int,
                 denoise_guidance_scale: float, zero_terminal_snr: bool = False,
                 min_snr_gamma: Optional[float] = None, v_parameterization: bool = False,
                 noise_offset: Optional[float] = None) -> None:
        self.network, self.predict = network, predict
        self.max_denoising_steps, self.denoise_guidance_scale = max_denoising_steps, denoise_guidance_scale
        self.scheduler = noise.training_noise_scheduler(zero_terminal_snr)
        self.min_snr_gamma, self.v_parameterization, self.noise_offset = min_snr_gamma, v_parameterization, noise_offset

    def draw(self, pair: PromptPair, device: torch.device, generator: Optional[torch.Generator] = None
             ) -> tuple[torch.Tensor, int, dict[str, torch.Tensor]]:
        """Initial noise, the number of denoising steps and the size conditioning of one example."""
        denoise_to = int(torch.randint(1, self.max_denoising_steps, (1,), generator=generator))
        height, width = random_resolution(pair, generator)
        latents = torch.randn((pair.batch_size, 4, height // 8, width // 8), generator=generator)
        self.scheduler.set_timesteps(self.max_denoising_steps)
        latents = latents * self.scheduler.init_noise_sigma
        if self.noise_offset:
            latents = latents + self.noise_offset * torch.randn((pair.batch_size, 4, 1, 1), generator=generator)
        sizes = size_conditioning(height, width, pair.batch_size, pair.dynamic_crops, generator)
        return latents.to(device), denoise_to, sizes

    def denoise(self, pair: PromptPair, latents: torch.Tensor, denoise_to: int, sizes: dict[str, torch.Tensor]
                ) -> torch.Tensor:
        """The partial denoising with the LoRA at the pair's multiplier and guidance (no gradients)."""
        self.network.set_multiplier(pair.multiplier)
        self.scheduler.set_timesteps(self.max_denoising_steps, device=latents.device)
        with torch.no_grad():
            for timestep in self.scheduler.timesteps[:denoise_to]:
                timesteps = timestep.expand(latents.shape[0])
                unconditional = self.predict(latents, timesteps, pair.unconditional, sizes)
                conditional = self.predict(latents, timesteps, pair.target, sizes)
                guided = unconditional + self.denoise_guidance_scale * (conditional - unconditional)
                latents = self.scheduler.step(guided.float(), timestep, latents.float()).prev_sample.to(latents.dtype)
        return latents

    def training_timestep(self, denoise_to: int) -> int:
        """The 1000-step schedule's timestep where the partial denoising stopped."""
        self.scheduler.set_timesteps(CHECKPOINT_TIMESTEPS)
        return int(self.scheduler.timesteps[int(denoise_to * CHECKPOINT_TIMESTEPS / self.max_denoising_steps)])

    def targets(self, pair: PromptPair, latents: torch.Tensor, timestep: int, sizes: dict[str, torch.Tensor]
                ) -> torch.Tensor:
        """The frozen UNet's (LoRA at 0) target for the pair at these latents."""
        self.network.set_multiplier(0.0)
        timesteps = torch.full((latents.shape[0],), timestep, device=latents.device, dtype=torch.long)
        with torch.no_grad():
            positive, neutral, unconditional = (self.predict(latents, timesteps, prompt, sizes).float() for prompt in
                                                (pair.positive, pair.neutral, pair.unconditional))
        return leco_target(pair, positive, neutral, unconditional)

    def loss(self, pair: PromptPair, device: torch.device, generator: Optional[torch.Generator] = None
             ) -> torch.Tensor:
        """The example's loss (a scalar with the graph through the LoRA)."""
        latents, denoise_to, sizes = self.draw(pair, device, generator)
        latents = self.denoise(pair, latents, denoise_to, sizes)
        timestep = self.training_timestep(denoise_to)
        target = self.targets(pair, latents, timestep, sizes)
        self.network.set_multiplier(pair.multiplier)
        timesteps = torch.full((latents.shape[0],), timestep, device=device, dtype=torch.long)
        prediction = self.predict(latents, timesteps, pair.target, sizes).float()
        per_sample = torch.nn.functional.mse_loss(prediction, target, reduction="none").mean(dim=(1, 2, 3))
        if self.min_snr_gamma:
            options = losses.LossOptions(min_snr_gamma=self.min_snr_gamma,
                                         v_parameterization=self.v_parameterization)
            snr = losses.timestep_snr(self.scheduler.alphas_cumprod, timesteps)
            per_sample = per_sample * losses.timestep_weights(options, snr).to(per_sample.device)
        return per_sample.mean() * pair.weight


def train(family: Any, args: argparse.Namespace) -> None:
    """A LECO run: the prompt file read, the family's models loaded, a UNet LoRA of
    ``--network_module`` attached (``LoraTrainable``), ``--max_train_steps`` LECO steps, the LoRA
    written as the LoRA trainer writes its files (kohya's names and metadata, ``ss_leco_*`` added)."""
    from library import compatibility, lora_files, lora_metadata, optimizers
    from library.trainables.lora import LoraTrainable
    from library.training import build

    pairs = validate_arguments(args)
    args.network_train_unet_only = True  # LECO trains the UNet's LoRA only (kohya)
    args.output_name = args.output_name or "last"
    trainable = LoraTrainable()
    trainable.configure(args)
    if args.seed is None:
        args.seed = int(torch.randint(0, 2**31 - 1, (1,)))
        print(f"--seed not given: using {args.seed}")
    build.seed_everything(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast_dtype = build.MIXED_PRECISION_DTYPES[args.mixed_precision]
    models = family.load_models(args)
    compatibility.select_attention(args, models.unet, device.type, announce=print)
    trainable.attach(models, family.unet_module_names(models))
    network = trainable.module
    for model in [models.unet, *models.text_encoders]:
        model.requires_grad_(False).eval()
        model.to(device, dtype=autocast_dtype)
    trainable.place(device, autocast_dtype)
    autocast = torch.autocast(device.type, dtype=autocast_dtype, enabled=args.mixed_precision != "no")
    with torch.no_grad(), autocast:  # every prompt encoded once; the text encoders are not needed after
        cache = {prompt: family.encode_prompts(args, models, [prompt]) for prompt in
                 sorted({p for pair in pairs for p in (pair.target, pair.positive, pair.unconditional, pair.neutral)})}
    for text_encoder in models.text_encoders:
        text_encoder.to("cpu")
    if args.gradient_checkpointing:
        models.unet.enable_gradient_checkpointing()
        models.unet.train()

    def predict(latents: torch.Tensor, timesteps: torch.Tensor, prompt: str, sizes: dict[str, torch.Tensor]
                ) -> torch.Tensor:
        conditioning = repeat_conditioning(cache[prompt], latents.shape[0])
        with autocast:
            return family.predict(models, latents, timesteps, conditioning, sizes)

    leco_step = LecoStep(network, predict, args.max_denoising_steps, args.leco_denoise_guidance_scale,
                         args.zero_terminal_snr, args.min_snr_gamma, args.v_parameterization, args.noise_offset)
    optimizer_name, optimizer_args, optimizer = optimizers.build_optimizer(args, trainable.param_groups())
    lr_scheduler = optimizers.build_lr_scheduler(args, optimizer, args.max_train_steps)
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    file_metadata = {
        **lora_metadata.training_metadata(args, models.kind, {
            "session_id": torch.randint(0, 2**31 - 1, (1,)).item(), "training_started_at": lora_metadata.wall_clock(),
            "num_train_images": 0, "num_reg_images": 0, "num_batches_per_epoch": args.max_train_steps,
            "num_epochs": 1, "optimizer": optimizer_name + (f"({optimizer_args})" if optimizer_args else ""),
            "network_args": trainable.config.network_args}),
        **lora_metadata.base_model_metadata(args), **metadata(args, pairs)}
    writer = lora_files.LoraWriter(args, file_metadata)
    print(f"training: {len(pairs)} LECO prompt pairs, {args.max_train_steps} optimizer steps, mixed precision "
          f"{args.mixed_precision} on {device.type}")
    network.train()
    for step in range(1, args.max_train_steps + 1):
        window_loss = 0.0
        for _ in range(args.gradient_accumulation_steps):  # one random pair per micro-batch, as kohya
            pair = pairs[int(torch.randint(0, len(pairs), (1,)))]
            loss = leco_step.loss(pair, device) / args.gradient_accumulation_steps
            if not torch.isfinite(loss):
                raise SystemExit(f"step {step}: the LECO loss is {loss.item()}; stopping (no file written)")
            loss.backward()
            window_loss += loss.item()
        if args.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(parameters, args.max_grad_norm)
        optimizer.step()
        optimizers.step_schedule(lr_scheduler, window_loss)
        optimizer.zero_grad(set_to_none=True)
        network.set_multiplier(1.0)
        print(f"step {step}/{args.max_train_steps}: loss {window_loss:.6g} (last pair: multiplier "
              f"{pair.multiplier:g}, {pair.action})", flush=True)
        if step < args.max_train_steps:
            writer.on_step(network, step, 1)
    path = writer.write(network, lora_files.final_file_name(args.output_name), args.max_train_steps, 1)
    print(f"done: {args.max_train_steps} steps; LoRA written to {path}")


def repeat_conditioning(conditioning: Any, batch_size: int) -> Any:
    """A cached prompt's conditioning (a tensor, or SDXL's (hidden states, pooled)) for a batch."""
    if isinstance(conditioning, tuple):
        return tuple(repeat_conditioning(part, batch_size) for part in conditioning)
    return conditioning.expand(batch_size, *conditioning.shape[1:])
