"""kohya-ss options that front-ends and presets pass, handled the way this trainer works.

kohya_ss GUI and most shared ``.bat``/``.sh`` presets pass ``--xformers`` or ``--sdpa``,
DeepSpeed and Hugging Face upload options with empty values, and so on. Every such option
is accepted here with kohya's name, type and default, so a command line or TOML file written
for sd-scripts parses. What each one does here:

* attention (``--xformers``, ``--sdpa``, ``--mem_eff_attn``): see :func:`select_attention`;
* ``--caption_extention``: kohya's old misspelling, copied to ``--caption_extension``;
* options with nothing to do here (the reason is in their help): accepted, no effect;
* options this trainer cannot honour: refused with one line when set to anything but
  their default (:func:`check_arguments`), never silently ignored; their sub-options
  (``--zero_stage``, ``--huggingface_token``, ...) are inert without them, as in kohya;
* ``--cpu_offload_checkpointing``: :func:`offloaded_activations`;
* the full fine-tuners' ``--diffusers_xformers`` (:func:`select_diffusers_xformers`) and ``train_db.py``'s
  ``--no_token_padding`` (no effect, as in kohya v0.11.1): :func:`add_full_model_arguments`;
* ``--clip_skip`` on SDXL: ignored with kohya's warning (:func:`check_arguments`).
"""
from __future__ import annotations

import argparse
import importlib.util
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Callable

import torch

from library.errors import UserError

# dest -> why it cannot be honoured here (the whole error after the flag). Refused only when set.
UNSUPPORTED: dict[str, str] = {
    "deepspeed": "DeepSpeed is not supported here; multi-GPU runs use accelerate launch or torchrun",
    "huggingface_repo_id": "uploading to the Hugging Face Hub is not supported; upload the output files yourself",
    "save_state_to_huggingface": "uploading to the Hugging Face Hub is not supported",
    "resume_from_huggingface": "resuming from the Hugging Face Hub is not supported; download the state and "
                               "pass its folder to --resume",
    "face_crop_aug_range": "face-centred crop augmentation is not supported here",
    "dataset_class": "custom dataset classes are not supported; use --dataset_config",
    "conditioning_data_dir": "ControlNet conditioning images are not supported by LoRA training",
}


def add_arguments(parser: argparse.ArgumentParser, lora: bool = True) -> None:
    """Register the kohya options described in the module docstring (kohya's names and defaults);
    ``lora=False``: a full fine-tuner's parser, whose own modules define ``--use_safetensors`` and
    ``--fused_backward_pass`` (``full_model_files``, ``fused_backward``)."""
    group = parser.add_argument_group("kohya compatibility")
    add = group.add_argument
    add("--xformers", action="store_true",
        help="xformers attention in the UNet when the xformers package and a CUDA device are present; "
             "otherwise torch's scaled_dot_product_attention (the default here, similar memory use)")
    add("--sdpa", action="store_true", help="torch's scaled_dot_product_attention: the default here")
    add("--mem_eff_attn", action="store_true",
        help="memory-efficient attention: here torch's scaled_dot_product_attention (the default)")
    add("--caption_extention", type=str, default=None,
        help="kohya's old misspelling of --caption_extension; when given it sets --caption_extension")
    add("--disable_mmap_load_safetensors", action="store_true",
        help="accepted, no effect: model files are always read without memory mapping here")
    add("--skip_cache_check", action="store_true",
        help="accepted, no effect: cache files are checked by a small metadata entry only (no content is read)")
    add("--ddp_timeout", type=int, default=None,
        help="timeout in minutes for collective operations between processes (default: torch's)")
    add("--ddp_gradient_as_bucket_view", action="store_true",
        help="accepted, no effect: gradients are summed with one flat all-reduce, without DDP buckets")
    add("--ddp_static_graph", action="store_true",
        help="accepted, no effect: gradients are summed with one flat all-reduce, without DDP")
    if lora:
        add("--use_safetensors", action="store_true",
            help="accepted, no effect: LoRA files are safetensors unless --save_model_as says otherwise")

    def refused(flag: str, **kwargs: Any) -> None:
        add(flag, **kwargs, help=f"refused: {UNSUPPORTED[flag.lstrip('-')]}")

    def inert(flag: str, needs: str, **kwargs: Any) -> None:
        add(flag, **kwargs, help=f"accepted, no effect (used only with {needs}, which is not supported)")

    add("--cpu_offload_checkpointing", action="store_true",
        help="with --gradient_checkpointing, keep the activations the UNet's backward needs (the checkpointed "
             "blocks' inputs) in pinned CPU memory instead of on the GPU: less GPU memory, some transfer time. "
             "No memory saved on CPU. Default: off")
    for flag in ("--deepspeed", "--save_state_to_huggingface", "--resume_from_huggingface"):
        refused(flag, action="store_true")
    for flag in ("--huggingface_repo_id", "--face_crop_aug_range", "--dataset_class", "--conditioning_data_dir"):
        refused(flag, type=str, default=None)
    inert("--zero_stage", "--deepspeed", type=int, default=2)
    for flag in ("--offload_optimizer_device", "--offload_optimizer_nvme_path", "--offload_param_device",
                 "--offload_param_nvme_path"):
        inert(flag, "--deepspeed", type=str, default=None)
    for flag in ("--zero3_init_flag", "--zero3_save_16bit_model", "--fp16_master_weights_and_gradients"):
        inert(flag, "--deepspeed", action="store_true")
    for flag in ("--huggingface_repo_type", "--huggingface_path_in_repo", "--huggingface_token",
                 "--huggingface_repo_visibility"):
        inert(flag, "--huggingface_repo_id", type=str, default=None)
    inert("--async_upload", "--huggingface_repo_id", action="store_true")
    if lora:
        add("--fused_backward_pass", action="store_true",
            help="accepted, no effect: a full fine-tuning option (sdxl_train.py), ignored by LoRA training as in kohya")


def add_full_model_arguments(parser: argparse.ArgumentParser, *, diffusers_xformers: bool,
                             no_token_padding: bool) -> None:
    """kohya's full fine-tuners' own attention / tokenizer options: ``--diffusers_xformers`` (``sdxl_train.py``,
    ``fine_tune.py``), ``--no_token_padding`` (``train_db.py``)."""
    group = parser.add_argument_group("kohya compatibility (full fine-tuning)")
    if diffusers_xformers:
        group.add_argument("--diffusers_xformers", action="store_true",
                           help="diffusers' xformers attention (kohya: sdxl_train.py in the VAE, fine_tune.py in the "
                                "UNet) when the xformers package and a CUDA device are present; otherwise torch's "
                                "scaled_dot_product_attention, with one line saying so")
    if no_token_padding:
        group.add_argument("--no_token_padding", action="store_true",
                           help="accepted, no effect: kohya v0.11.1 still parses it but no longer reads it (captions "
                                "are padded to the tokenizer's length either way)")


def check_arguments(args: argparse.Namespace, sdxl: bool, announce: Callable[[str], None] = print) -> None:
    """UserError naming the first option set to a value this trainer cannot honour (see ``UNSUPPORTED``;
    their defaults are all falsy, so anything truthy was asked for); one line for options that do
    nothing in this run (``sdxl``: the model the entry script trains)."""
    for dest, reason in UNSUPPORTED.items():
        value = getattr(args, dest)
        if value:
            shown = f"--{dest}" if value is True else f"--{dest} {value}"
            raise UserError(f"{shown}: {reason}")
    if sdxl and args.clip_skip not in (None, 1):  # 1, the kohya_ss GUI's default, is "no skip"
        announce(f"--clip_skip {args.clip_skip}: SDXL uses fixed text encoder layers, it has no effect (kohya "
                 f"ignores it too, with a warning)")
    if args.cpu_offload_checkpointing and not args.gradient_checkpointing:
        announce("--cpu_offload_checkpointing: no effect without --gradient_checkpointing (as in kohya)")
    elif args.cpu_offload_checkpointing and not torch.cuda.is_available():
        announce("--cpu_offload_checkpointing: training on the CPU, the activations are in CPU memory already")


def offloaded_activations(args: argparse.Namespace, device: torch.device) -> AbstractContextManager:
    """Where to run the UNet's forward: ``--cpu_offload_checkpointing`` with ``--gradient_checkpointing`` keeps
    every tensor autograd saves there (with checkpointing, the checkpointed blocks' inputs) in CPU memory,
    pinned on CUDA, until backward needs it. kohya passes ``cpu_offload=True`` to its SD/SDXL UNets, which do
    not take it, and fails; its FLUX/SD3 models offload the checkpointed blocks' inputs the same way."""
    if args.cpu_offload_checkpointing and args.gradient_checkpointing:
        return torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda")
    return nullcontext()


def apply_aliases(args: argparse.Namespace) -> None:
    """``--caption_extention`` (kohya's old spelling) sets ``--caption_extension``, as in kohya."""
    if args.caption_extention is not None:
        args.caption_extension = args.caption_extention
        args.caption_extention = None


def select_attention(args: argparse.Namespace, unet: Any, device_type: str, announce: Callable[[str], None]) -> str:
    """Set the UNet's attention implementation from ``--xformers``; returns ``"xformers"`` or ``"sdpa"``.

    diffusers already uses torch's scaled_dot_product_attention, which picks a flash or
    memory-efficient kernel by itself, so ``--sdpa`` and ``--mem_eff_attn`` change nothing.
    ``--xformers`` needs the xformers package and a CUDA device; without them the run goes
    on with SDPA after one line saying so (a GUI preset should not fail on a CPU machine).
    """
    return _xformers_or_sdpa("--xformers", args.xformers, unet, device_type, announce)


def select_diffusers_xformers(requested: bool, model: Any, device_type: str, announce: Callable[[str], None]) -> str:
    """``--diffusers_xformers`` on ``model`` (kohya: the VAE for ``sdxl_train.py``, the UNet for ``fine_tune.py``):
    ``"xformers"`` with the xformers package on a CUDA device; otherwise SDPA after one line saying so (kohya's
    diffusers call would raise there)."""
    return _xformers_or_sdpa("--diffusers_xformers", requested, model, device_type, announce)


def _xformers_or_sdpa(flag: str, requested: bool, model: Any, device_type: str,
                      announce: Callable[[str], None]) -> str:
    if not requested:
        return "sdpa"
    if device_type == "cuda" and importlib.util.find_spec("xformers") is not None:
        model.enable_xformers_memory_efficient_attention()
        return "xformers"
    missing = "the xformers package is not installed" if device_type == "cuda" else "xformers needs a CUDA device"
    announce(f"{flag}: {missing}; using torch's scaled_dot_product_attention instead")
    return "sdpa"
