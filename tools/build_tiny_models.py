"""Build tiny SDXL / SD1.x / SD2.x models that keep the real code paths, offline and deterministically.

    python tools/build_tiny_models.py --out DIR

Writes, for each of ``sdxl``, ``sd15`` and ``sd2``:
  DIR/<name>/               diffusers pipeline folder (save_pretrained)
  DIR/<name>.safetensors    the same weights as one original-layout single file
  DIR/<name>_config/        configs + tokenizers, no weights (usable as --model_config_dir)
and DIR/tokenizers/, the tiny tokenizers in kohya's --tokenizer_cache_dir layout; and the inpainting
models ``sdxl_inpaint`` and ``sd15_inpaint`` (the same architectures with a 9-channel UNet conv_in, as
sd_xl_base_1.0_inpainting / sd-v1-5-inpainting; ``build_tiny_inpainting_models``).

The tokenizers have the smallest vocab that still tokenizes any text (the 256
byte-level characters, the same with ``</w>``, then bos/eos: 514 tokens); the
architectures follow the real ones at toy widths (see docs/facts.md).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `library` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from library.checkpoint_files import save_single_file
from library.clip_tokenizers import TOKENIZER_SOURCES, set_pad_token
from library.model_loading import shipped_config_dir
from library.models import StableDiffusionModels

SEED = 1234
VOCAB_SIZE = 514
BOS_ID, EOS_ID = 512, 513

TINY_VAE = dict(in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2, norm_num_groups=32,
                down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                sample_size=64)
_SD_DOWN = ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"]
_SD_UP = ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]


def byte_level_characters() -> list[str]:
    """The 256 characters CLIP's byte-level BPE uses for the bytes 0..255, in CLIP's vocab order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters = {byte: chr(byte) for byte in printable}
    # Bytes without a printable character get the code points from 256 up, in byte order.
    extra = [byte for byte in range(256) if byte not in characters]
    for offset, byte in enumerate(extra):
        characters[byte] = chr(256 + offset)
    return [characters[byte] for byte in printable + extra]


def tiny_tokenizer(pad_token: str):
    """A 514-token CLIP tokenizer (bytes, bytes+``</w>``, bos 512, eos 513), max length 77."""
    from transformers import CLIPTokenizer

    characters = byte_level_characters()
    vocab = {character: index for index, character in enumerate(characters)}
    vocab.update({character + "</w>": 256 + index for index, character in enumerate(characters)})
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = BOS_ID, EOS_ID
    with tempfile.TemporaryDirectory() as raw:
        (Path(raw) / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        (Path(raw) / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
        tokenizer = CLIPTokenizer.from_pretrained(raw, model_max_length=77)
    return set_pad_token(tokenizer, pad_token)


def _text_config(hidden: int, projection: int, act: str):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=3, num_attention_heads=4, max_position_embeddings=77,
                          projection_dim=projection, hidden_act=act, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                          pad_token_id=EOS_ID)


def _seeded(offset: int) -> None:
    torch.manual_seed(SEED + offset)


def _shrink_vae_(vae: torch.nn.Module) -> None:
    # Default init stacks ~20 resnets whose residual sums grow the activations;
    # damping the residual branches keeps a random decode in a sane range.
    with torch.no_grad():
        for name, parameter in vae.named_parameters():
            if name.endswith("conv2.weight"):
                parameter.mul_(0.3)


def _scheduler_config(kind: str) -> dict[str, Any]:
    path = shipped_config_dir(kind) / "scheduler" / "scheduler_config.json"
    return json.loads(path.read_text(encoding="utf-8"))


def tiny_sdxl(unet_in_channels: int = 4, **unet_settings: Any) -> StableDiffusionModels:
    """Tiny SDXL: te1 CLIP hidden 32, te2 hidden 64 with projection 64, UNet (32, 64, 64), 3 levels
    (``unet_in_channels`` 9: an inpainting model). ``unet_settings`` replace the UNet's (e.g. wider
    ``block_out_channels`` and deeper ``transformer_layers_per_block``: a larger model of the same kind)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    _seeded(0)
    text_encoder = CLIPTextModel(_text_config(32, 32, "quick_gelu"))
    _seeded(1)
    text_encoder_2 = CLIPTextModelWithProjection(_text_config(64, 64, "gelu"))
    _seeded(2)
    unet = UNet2DConditionModel(**{**dict(
        sample_size=8, in_channels=unet_in_channels, out_channels=4, layers_per_block=2,
        block_out_channels=(32, 64, 64),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 1, 2), attention_head_dim=(2, 4, 4), use_linear_projection=True,
        cross_attention_dim=32 + 64, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=64 + 6 * 8), **unet_settings})
    _seeded(3)
    vae = AutoencoderKL(block_out_channels=(32, 32, 32, 32), scaling_factor=0.13025, force_upcast=False, **TINY_VAE)
    _shrink_vae_(vae)
    tokenizers = [tiny_tokenizer(pad) for _, _, pad in _pads("sdxl")]
    return StableDiffusionModels("sdxl", tokenizers, [text_encoder, text_encoder_2], vae, unet,
                                 _scheduler_config("sdxl"), "tiny_sdxl")


def tiny_sd(kind: str, unet_in_channels: int = 4) -> StableDiffusionModels:
    """Tiny SD1.x (``sd1``) or SD2.x v-prediction (``sd2``): UNet (32, 32, 64, 64), 4 levels, te hidden 32
    (``unet_in_channels`` 9: an inpainting model)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    sd2 = kind == "sd2"
    _seeded(10)
    text_encoder = CLIPTextModel(_text_config(32, 32, "gelu" if sd2 else "quick_gelu"))
    _seeded(11)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=unet_in_channels, out_channels=4, layers_per_block=2,
        block_out_channels=(32, 32, 64, 64),
        down_block_types=_SD_DOWN, up_block_types=_SD_UP, cross_attention_dim=32,
        attention_head_dim=(2, 2, 4, 4) if sd2 else 2, use_linear_projection=sd2, upcast_attention=sd2)
    _seeded(12)
    # (32, 32, 64, 64) rather than all 32: the channel change gives the VAE resnets a shortcut conv.
    vae = AutoencoderKL(block_out_channels=(32, 32, 64, 64), scaling_factor=0.18215, **TINY_VAE)
    _shrink_vae_(vae)
    tokenizers = [tiny_tokenizer(pad) for _, _, pad in _pads(kind)]
    return StableDiffusionModels(kind, tokenizers, [text_encoder], vae, unet, _scheduler_config(kind), f"tiny_{kind}")


def _pads(kind: str) -> list[tuple[str, str | None, str]]:
    return [(repo, sub, pad or "<|endoftext|>") for repo, sub, pad in TOKENIZER_SOURCES[kind]]


def _pipeline(models: StableDiffusionModels):
    from diffusers import (DDIMScheduler, EulerDiscreteScheduler, PNDMScheduler, StableDiffusionPipeline,
                           StableDiffusionXLPipeline)

    schedulers = {"EulerDiscreteScheduler": EulerDiscreteScheduler, "PNDMScheduler": PNDMScheduler,
                  "DDIMScheduler": DDIMScheduler}
    scheduler = schedulers[models.scheduler_config["_class_name"]].from_config(models.scheduler_config)
    if models.kind == "sdxl":
        return StableDiffusionXLPipeline(
            vae=models.vae, text_encoder=models.text_encoders[0], text_encoder_2=models.text_encoders[1],
            tokenizer=models.tokenizers[0], tokenizer_2=models.tokenizers[1], unet=models.unet,
            scheduler=scheduler, force_zeros_for_empty_prompt=True)
    return StableDiffusionPipeline(
        vae=models.vae, text_encoder=models.text_encoders[0], tokenizer=models.tokenizers[0], unet=models.unet,
        scheduler=scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def write_model(models: StableDiffusionModels, out_dir: Path, name: str) -> dict[str, Path]:
    """``models`` as a diffusers folder ``NAME``, a single file ``NAME.safetensors`` and a config folder
    ``NAME_config`` (tokenizers, no weights) in ``out_dir``; their paths by key as ``build_tiny_models``."""
    folder, single_file, config_dir = out_dir / name, out_dir / f"{name}.safetensors", out_dir / f"{name}_config"
    for stale in (folder, config_dir):
        shutil.rmtree(stale, ignore_errors=True)
    _pipeline(models).save_pretrained(folder)
    save_single_file(models, single_file)
    shutil.copytree(folder, config_dir, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    return {name: folder, f"{name}_file": single_file, f"{name}_config": config_dir}


def build_tiny_models(out_dir: str | Path) -> dict[str, Path]:
    """Build everything into ``out_dir``; returns paths by key.

    Keys: ``root``, ``tokenizers``, and for NAME in ``sdxl``, ``sd15``, ``sd2``:
    NAME (diffusers folder), ``NAME_file`` (single file), ``NAME_config``
    (config folder with tokenizers, no weights).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {"root": out_dir, "tokenizers": out_dir / "tokenizers"}
    written_tokenizers: set[str] = set()
    for name, models in (("sdxl", tiny_sdxl()), ("sd15", tiny_sd("sd1")), ("sd2", tiny_sd("sd2"))):
        paths.update(write_model(models, out_dir, name))
        for (repo, _, _), tokenizer in zip(TOKENIZER_SOURCES[models.kind], models.tokenizers):
            cache_name = repo.replace("/", "_")
            if cache_name not in written_tokenizers:
                tokenizer.save_pretrained(paths["tokenizers"] / cache_name)
                written_tokenizers.add(cache_name)
    return paths


def build_tiny_inpainting_models(out_dir: str | Path) -> dict[str, Path]:
    """Tiny inpainting models (9-channel UNet input) into ``out_dir``: keys ``sdxl_inpaint`` and
    ``sd15_inpaint`` with their ``_file`` and ``_config`` as in ``build_tiny_models`` (same text encoders,
    VAE and tokenizers as ``sdxl`` / ``sd15``)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}
    for name, models in (("sdxl_inpaint", tiny_sdxl(unet_in_channels=9)), ("sd15_inpaint", tiny_sd("sd1", 9))):
        paths.update(write_model(models, out_dir, name))
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder (created; existing tiny models are replaced)")
    args = parser.parse_args()
    for key, path in {**build_tiny_models(args.out), **build_tiny_inpainting_models(args.out)}.items():
        print(f"{key}: {path}")


if __name__ == "__main__":
    main()
