"""Metadata written into LoRA files: kohya's ``ss_*`` keys, ``modelspec.*`` and addnet hashes.

A1111, ComfyUI and LoRA browsers read these keys; their names and string formats
follow kohya-ss sd-scripts.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import io
import json
import os
import time
from typing import Any, Mapping

import torch
from safetensors.torch import save

ARCHITECTURES = {"sd1": "stable-diffusion-v1", "sd2": "stable-diffusion-v2-512", "sdxl": "stable-diffusion-xl-v1-base"}
BASE_MODEL_VERSIONS = {"sd1": "sd_v1", "sd2": "sd_2.0", "sdxl": "sdxl_base_v1-0"}
IMPLEMENTATION = "https://github.com/Stability-AI/generative-models"


def training_metadata(args: argparse.Namespace, model_kind: str, facts: Mapping[str, Any]) -> dict[str, str]:
    """kohya's ``ss_*`` metadata of a run; ``facts`` holds what the trainer computed
    (image counts, batches per epoch, epochs, optimizer string, session id, start time)."""
    metadata: dict[str, Any] = {
        "ss_session_id": facts["session_id"],
        "ss_training_started_at": facts["training_started_at"],
        "ss_output_name": args.output_name,
        "ss_learning_rate": args.learning_rate,
        "ss_text_encoder_lr": args.text_encoder_lr[0] if args.text_encoder_lr and len(args.text_encoder_lr) == 1 else args.text_encoder_lr,
        "ss_unet_lr": args.unet_lr,
        "ss_num_train_images": facts["num_train_images"],
        "ss_num_reg_images": facts["num_reg_images"],
        "ss_num_batches_per_epoch": facts["num_batches_per_epoch"],
        "ss_num_epochs": facts["num_epochs"],
        "ss_gradient_checkpointing": args.gradient_checkpointing,
        "ss_gradient_accumulation_steps": args.gradient_accumulation_steps,
        "ss_max_train_steps": args.max_train_steps,
        "ss_lr_warmup_steps": args.lr_warmup_steps,
        "ss_lr_scheduler": args.lr_scheduler,
        "ss_network_module": args.network_module,
        "ss_network_dim": args.network_dim,
        "ss_network_alpha": args.network_alpha,
        "ss_network_dropout": args.network_dropout,
        "ss_mixed_precision": args.mixed_precision,
        "ss_full_fp16": False,
        "ss_v2": bool(args.v2),
        "ss_base_model_version": BASE_MODEL_VERSIONS[model_kind],
        "ss_clip_skip": args.clip_skip,
        "ss_max_token_length": None,
        "ss_cache_latents": False,
        "ss_seed": args.seed,
        "ss_noise_offset": args.noise_offset,
        "ss_training_comment": args.training_comment,
        "ss_optimizer": facts["optimizer"],
        "ss_max_grad_norm": args.max_grad_norm,
        "ss_prior_loss_weight": args.prior_loss_weight,
        "ss_loss_type": args.loss_type,
        "ss_huber_schedule": args.huber_schedule,
        "ss_huber_c": args.huber_c,
        "ss_huber_scale": args.huber_scale,
        "ss_min_snr_gamma": args.min_snr_gamma,
        "ss_debiased_estimation": bool(args.debiased_estimation_loss),
        "ss_zero_terminal_snr": bool(args.zero_terminal_snr),
        "ss_ip_noise_gamma": args.ip_noise_gamma,
        "ss_multires_noise_iterations": args.multires_noise_iterations,
        "ss_multires_noise_discount": args.multires_noise_discount,
        "ss_adaptive_noise_scale": args.adaptive_noise_scale,
        "ss_min_timestep": args.min_timestep,
        "ss_max_timestep": args.max_timestep,
        "ss_batch_size_per_device": args.train_batch_size,
        "ss_total_batch_size": facts["total_batch_size"],
        "ss_resolution": args.resolution,
        "ss_dataset_dirs": json.dumps(facts.get("dataset_dirs", {})),
        "ss_network_args": json.dumps(facts.get("network_args", {})),
        "ss_sd_model_name": facts["model_name"],
    }
    return {key: str(value) for key, value in metadata.items()}


def wall_clock() -> float:
    """Seconds since the epoch, or ``SOURCE_DATE_EPOCH`` when set (reproducible files: two runs
    of the same settings then write byte-identical LoRA files)."""
    fixed = os.environ.get("SOURCE_DATE_EPOCH")
    return float(fixed) if fixed else time.time()


def modelspec_metadata(
    args: argparse.Namespace, model_kind: str, resolution_hw: tuple[int, int], timestamp: float
) -> dict[str, str]:
    """Stability AI's model spec keys for a LoRA of ``model_kind``."""
    architecture = ARCHITECTURES[model_kind]
    if model_kind == "sd2" and args.v_parameterization:
        architecture = "stable-diffusion-v2-768-v"
    return {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": f"{architecture}/lora",
        "modelspec.implementation": IMPLEMENTATION,
        "modelspec.title": args.output_name,
        "modelspec.resolution": f"{resolution_hw[1]}x{resolution_hw[0]}",
        "modelspec.date": datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).isoformat(timespec="seconds"),
        "modelspec.prediction_type": "v" if args.v_parameterization else "epsilon",
    }


def addnet_hashes(state: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> dict[str, str]:
    """``sshs_model_hash`` and ``sshs_legacy_hash`` as the additional-networks extension computes them.

    Only the immutable ``ss_*`` training metadata takes part, so editing a title later
    does not change the hash.
    """
    training_only = {key: value for key, value in metadata.items() if key.startswith("ss_")}
    data = save(dict(state), training_only)
    header_length = int.from_bytes(data[:8], "little")
    model_hash = hashlib.sha256(data[8 + header_length :]).hexdigest()
    buffer = io.BytesIO(data)
    buffer.seek(0x100000)
    legacy_hash = hashlib.sha256(buffer.read(0x10000)).hexdigest()[:8]
    return {"sshs_model_hash": model_hash, "sshs_legacy_hash": legacy_hash}
