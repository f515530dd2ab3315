"""The reference the benchmarks compare our trainer with: a bare diffusers + peft SDXL LoRA loop.

The same diffusers UNet the trainer loads (its weights read with our loader and then left alone),
peft LoRA on the Linear / 1x1 layers kohya's LoRA wraps inside the Transformer2DModels at the same
rank (float32 trainable weights, as kohya's and ours), ``torch.autocast`` + ``torch.amp.GradScaler``
(fp16), AdamW, DDPM noising and an MSE loss on random latents and text embeddings of the trainer's
shapes, and nothing else.
"""
from __future__ import annotations

import torch

# The Linear / 1x1 layers kohya's LoRA wraps inside SDXL's Transformer2DModels (722 in the full model).
LORA_TARGETS = (r".*attentions\.\d+\.(proj_in|proj_out|transformer_blocks\.\d+\."
                r"(attn1\.to_q|attn1\.to_k|attn1\.to_v|attn1\.to_out\.0|attn2\.to_q|attn2\.to_k|attn2\.to_v|"
                r"attn2\.to_out\.0|ff\.net\.0\.proj|ff\.net\.2))")
SAMPLES = 8  # random latents / embeddings the steps cycle through


class BareLoop:
    """One step per :meth:`step`; ``unet`` is changed in place (frozen, cast, adapters added)."""

    def __init__(self, unet: torch.nn.Module, precision: str, batch: int, checkpointing: bool, rank: int,
                 learning_rate: float, resolution: int, device: torch.device) -> None:
        from diffusers import DDPMScheduler
        from peft import LoraConfig

        self.device, self.batch = device, batch
        self.dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision, torch.float32)
        unet.requires_grad_(False)
        unet.to(device, self.dtype)
        unet.add_adapter(LoraConfig(r=rank, lora_alpha=rank, init_lora_weights="gaussian", target_modules=LORA_TARGETS))
        self.lora_modules = len({name.rpartition(".lora_A")[0] for name, _ in unet.named_parameters()
                                 if ".lora_A" in name})
        parameters = [p for p in unet.parameters() if p.requires_grad]
        for parameter in parameters:  # trainable weights in float32, as kohya's (and ours) are
            parameter.data = parameter.data.float()
        if checkpointing:
            unet.enable_gradient_checkpointing()
        unet.train()
        self.unet = unet
        self.optimizer = torch.optim.AdamW(parameters, lr=learning_rate)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.scheduler = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                       num_train_timesteps=1000, clip_sample=False)
        config = unet.config
        generator = torch.Generator(device).manual_seed(0)
        latent = resolution // 8
        self.latents = torch.randn(SAMPLES, config.in_channels, latent, latent, device=device,
                                   generator=generator) * 0.13025
        self.context = torch.randn(SAMPLES, 77, config.cross_attention_dim, device=device, generator=generator)
        pooled_dim = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
        self.pooled = torch.randn(SAMPLES, pooled_dim, device=device, generator=generator)
        self.time_ids = torch.tensor([[resolution, resolution, 0, 0, resolution, resolution]] * batch, device=device,
                                     dtype=torch.float32)

    def step(self, index: int) -> torch.Tensor:
        """Optimizer step number ``index``; returns its loss (not synchronised)."""
        samples = torch.arange(index * self.batch, (index + 1) * self.batch, device=self.device) % SAMPLES
        clean = self.latents[samples]
        noise = torch.randn_like(clean)
        timesteps = torch.randint(0, 1000, (self.batch,), device=self.device)
        noisy = self.scheduler.add_noise(clean, noise, timesteps)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            prediction = self.unet(noisy, timesteps, self.context[samples],
                                   added_cond_kwargs={"text_embeds": self.pooled[samples],
                                                      "time_ids": self.time_ids}).sample
        loss = torch.nn.functional.mse_loss(prediction.float(), noise.float())
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            loss.backward()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss
