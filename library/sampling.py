"""Sample images during training with the LoRA being trained (kohya's ``--sample_*`` options).

Prompt files (``--sample_prompts``), as in kohya-ss sd-scripts:

* ``.txt``: one prompt per line (empty lines and lines starting with ``#`` ignored), options
  after `` --``: ``--n`` negative prompt, ``--w``/``--h`` size (64..8192 px, rounded down to a
  multiple of 8; default 512), ``--d`` seed (default: random), ``--s`` steps (1..1000,
  default 30), ``--l`` CFG scale (finite; default 7.5), ``--ss`` sampler for this prompt; for an
  inpainting model (``--train_inpainting``) ``--img`` the image to inpaint and ``--mask`` its mask
  (white: regenerate; default a random blob, see ``library.inpainting``); paths cannot contain `` --``.
* ``.toml``: a ``[prompt]`` table of defaults with ``[[prompt.subset]]`` entries; keys
  ``prompt``, ``negative_prompt``, ``width``, ``height``, ``seed``, ``sample_steps``,
  ``scale``, ``sample_sampler``, ``image``, ``mask``.
* ``.json``: a list of such dicts, or of prompt lines.

Prompts are encoded as training encodes captions (``library.text_encoding``: the same layers,
``--clip_skip`` on SD 1.x/2.x), with A1111 weights ``(word:1.2)`` always read and as many 75-token
chunks as the longer of prompt and negative prompt needs, up to 225 tokens (kohya's SD 1.x sampler
does the same through its long-prompt pipeline, which also rescales weighted embeddings to keep
their mean; its SDXL sampler cuts prompts at ``--max_token_length``; here both keep the whole
prompt, weighted as in training). An empty negative prompt is encoded as "" (not zeros), as in kohya.

``--sample_every_n_steps`` / ``--sample_every_n_epochs`` 0 (or below) mean "off", with one line
saying so (kohya's rule).

Prompt files are read only when a sample point is scheduled (``--sample_every_n_steps``,
``--sample_every_n_epochs``, ``--sample_at_first``). An empty or missing file means no sampling,
not an error: the kohya_ss GUI always passes ``<output_dir>/sample/prompt.txt`` and leaves it empty
when its Samples box is. The VAE and text encoders are kept for sampling only when a sample point
is scheduled and the file has prompts at the start; the file is re-read at every sample point, so
it can be edited during a run (a file broken by an edit skips that point with one line).

Images go to ``<output_dir>/sample/`` as
``<output_name>_<step:06d>_<prompt index:02d>_<YYYYmmddHHMMSS>[_<seed>].png`` (epoch sampling:
``<output_name>_e<epoch:06d>_...``), kohya's names.

Sampling is invisible to training: the pipeline is built from the in-memory components (the
LoRA is applied to them in place), every module's train/eval mode and the torch (CPU and
CUDA), numpy and Python RNG states are restored afterwards, and per-prompt noise comes from a
private generator. Only the main process samples.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import random
import re
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from library import atomic_files, inpainting, text_encoding, tracking
from library.datasets.config import MAX_SIDE_PX
from library.errors import UserError

SAMPLERS = ("ddim", "pndm", "lms", "euler", "euler_a", "heun", "dpm_2", "dpm_2_a", "dpmsolver", "dpmsolver++",
            "dpmsingle", "k_lms", "k_euler", "k_euler_a", "k_dpm_2", "k_dpm_2_a")
SAMPLE_FOLDER = "sample"
MAX_PROMPT_CHUNKS = 3  # 225 tokens, as kohya's long-prompt pipeline
EVERY_N_FLAGS = ("sample_every_n_steps", "sample_every_n_epochs")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register kohya's sample-image options (one argument group)."""
    group = parser.add_argument_group("sample images", "Generate images with the LoRA being trained.")
    group.add_argument("--sample_prompts", type=str, default=None, metavar="FILE",
                       help="prompt file (.txt with --n --w --h --d --s --l options per line, .toml or .json), "
                            "read when a sample point is scheduled; then it keeps the VAE and text encoders "
                            "loaded. An empty or missing file samples nothing. Default: no sampling")
    group.add_argument("--sample_every_n_steps", type=int, default=None, metavar="N",
                       help="sample every N optimizer steps (ignored with --sample_every_n_epochs; 0: never, as "
                            "kohya). Default: never")
    group.add_argument("--sample_every_n_epochs", type=int, default=None, metavar="N",
                       help="sample every N epochs (replaces --sample_every_n_steps; 0: never, as kohya). "
                            "Default: never")
    group.add_argument("--sample_at_first", action="store_true",
                       help="also sample before the first step. Default: off")
    group.add_argument("--sample_sampler", type=str, default="ddim", choices=SAMPLERS,
                       help="scheduler for sampling (a line's --ss overrides it). Default: ddim")


@dataclass(frozen=True)
class SamplePrompt:
    """One image to generate; ``index`` is the prompt's position in the file (for the file name)."""

    index: int
    prompt: str
    negative_prompt: Optional[str] = None
    width: int = 512
    height: int = 512
    seed: Optional[int] = None
    sample_steps: int = 30
    scale: float = 7.5
    sampler: Optional[str] = None
    image: Optional[str] = None  # --img: the image an inpainting model fills in
    mask: Optional[str] = None  # --mask: its mask (white = regenerate); default a random blob


_LINE_OPTIONS = {  # option letter -> (field, parser)
    "n": ("negative_prompt", str),
    "w": ("width", int),
    "h": ("height", int),
    "d": ("seed", int),
    "s": ("sample_steps", int),
    "l": ("scale", float),
    "ss": ("sampler", str),
    "img": ("image", str),
    "mask": ("mask", str),
}
_DICT_KEYS = {"prompt": "prompt", "negative_prompt": "negative_prompt", "width": "width", "height": "height",
              "seed": "seed", "sample_steps": "sample_steps", "scale": "scale", "sample_sampler": "sampler",
             "image": "image", "mask": "mask"}


def parse_prompt_line(line: str, index: int, source: str = "prompt") -> SamplePrompt:
    """A kohya prompt line: ``text --n negative --w 1024 --h 1024 --d 42 --s 28 --l 7``."""
    text, *options = line.split(" --")
    values: dict[str, Any] = {"prompt": text.strip()}
    for option in options:
        match = re.match(r"(ss|img|mask|[nwhdsl])\s+(.*)$", option.strip(), re.IGNORECASE | re.DOTALL)
        if not match:
            continue  # kohya ignores options it does not know (--g, --cn, ...)
        field, kind = _LINE_OPTIONS[match.group(1).lower()]
        try:
            values[field] = kind(match.group(2).strip())
        except ValueError:
            raise UserError(f"--sample_prompts {source}: --{match.group(1)} {match.group(2).strip()!r} is not "
                            f"a{'n integer' if kind is int else ' number'}") from None
    return _checked(SamplePrompt(index=index, **values), source)


def _from_dict(entry: dict[str, Any], index: int, source: str) -> SamplePrompt:
    values = {}
    for key, value in entry.items():
        if key in _DICT_KEYS:
            values[_DICT_KEYS[key]] = value
    if "prompt" not in values:
        raise UserError(f"--sample_prompts {source}: entry {index} has no 'prompt'")
    try:
        prompt = SamplePrompt(index=index, **values)
        prompt = replace(prompt, width=int(prompt.width), height=int(prompt.height),
                         sample_steps=int(prompt.sample_steps), scale=float(prompt.scale),
                         seed=None if prompt.seed is None else int(prompt.seed))
    except (TypeError, ValueError) as error:
        raise UserError(f"--sample_prompts {source}: entry {index}: {error}") from None
    return _checked(prompt, source)


def _checked(prompt: SamplePrompt, source: str) -> SamplePrompt:
    """``prompt`` with kohya's rounding of the size down to a multiple of 8; UserError for values kohya
    would silently clamp (a negative size, 0 steps) or pass on (a NaN scale)."""
    where = f"--sample_prompts {source}: prompt {prompt.index}"
    if prompt.sampler is not None and prompt.sampler.lower() not in SAMPLERS:
        raise UserError(f"{where}: sampler {prompt.sampler!r} is unknown; valid: {', '.join(SAMPLERS)}")
    for name, letter, value in (("width", "w", prompt.width), ("height", "h", prompt.height)):
        if not 64 <= value <= MAX_SIDE_PX:
            raise UserError(f"{where}: {name} (--{letter}) {value} must be 64 to {MAX_SIDE_PX} pixels")
    if not 1 <= prompt.sample_steps <= 1000:
        raise UserError(f"{where}: sample_steps (--s) {prompt.sample_steps} must be 1 to 1000")
    if not math.isfinite(prompt.scale):
        raise UserError(f"{where}: scale (--l) {prompt.scale} must be a finite number (CFG scale, e.g. 7.5)")
    return replace(prompt, width=prompt.width - prompt.width % 8, height=prompt.height - prompt.height % 8,
                   sampler=prompt.sampler.lower() if prompt.sampler else None)


def load_prompts(path: str | os.PathLike) -> list[SamplePrompt]:
    """The prompts of a ``.txt``, ``.toml`` or ``.json`` prompt file: ``[]`` when the file is missing,
    empty or only comments; ``UserError`` when it cannot be read or parsed."""
    path = Path(path)
    source = str(path)
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".toml", ".json"):
        raise UserError(f"--sample_prompts {path}: use a .txt, .toml or .json prompt file")
    try:
        text = path.read_text(encoding="utf-8-sig")  # with or without Notepad's byte-order mark
    except FileNotFoundError:
        return []
    except OSError as error:
        raise UserError(f"--sample_prompts {path}: cannot read ({error.strerror or error})") from None
    except UnicodeDecodeError:
        raise UserError(f"--sample_prompts {path}: not UTF-8 text") from None
    if not text.strip():
        return []  # also for .toml/.json: an empty file is the GUI's "no prompts", not a syntax error
    if suffix == ".txt":
        lines = [line.strip() for line in text.splitlines()]
        prompts = [parse_prompt_line(line, index, source)
                   for index, line in enumerate(line for line in lines if line and not line.startswith("#"))]
    elif suffix == ".toml":
        import toml

        try:
            data = toml.loads(text)
            table = dict(data["prompt"])
            subsets = table.pop("subset")
        except (toml.TomlDecodeError, KeyError, TypeError) as error:
            raise UserError(f"--sample_prompts {path}: expected a [prompt] table with [[prompt.subset]] entries "
                            f"({error})") from None
        prompts = [_from_dict({**table, **subset}, index, source) for index, subset in enumerate(subsets)]
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise UserError(f"--sample_prompts {path}: invalid JSON ({error})") from None
        if not isinstance(data, list):
            raise UserError(f"--sample_prompts {path}: expected a JSON list of prompts")
        prompts = [parse_prompt_line(entry, index, source) if isinstance(entry, str)
                   else _from_dict(entry, index, source) for index, entry in enumerate(data)]
    return prompts


def every(args: argparse.Namespace, flag: str) -> Optional[int]:
    """``--sample_every_n_steps``/``--sample_every_n_epochs`` as a period; None when absent, 0 or below
    (kohya: off)."""
    value = getattr(args, flag, None)
    return value if value is not None and value > 0 else None


def is_scheduled(args: argparse.Namespace) -> bool:
    """Whether the run has a sample point: a prompt file and ``--sample_at_first`` or an every-N option."""
    return bool(getattr(args, "sample_prompts", None)) and bool(
        args.sample_at_first or any(every(args, flag) for flag in EVERY_N_FLAGS))


def check_samplers(args: argparse.Namespace, prompts: list[SamplePrompt]) -> None:
    """``UserError`` when ``--sample_sampler`` or a prompt's sampler cannot be built (lms without scipy)."""
    for sampler in {args.sample_sampler, *(prompt.sampler for prompt in prompts if prompt.sampler)}:
        make_scheduler(sampler, {})


def validate_arguments(args: argparse.Namespace) -> None:
    """When a sample point is scheduled, refuse a prompt file that cannot be parsed or names an
    unusable sampler (now, not at the first sample point)."""
    if is_scheduled(args):
        check_samplers(args, load_prompts(args.sample_prompts))


def drop_unused_prompt_file(args: argparse.Namespace, announce: Callable[[str], None] = print) -> None:
    """Clear ``args.sample_prompts`` when the run will sample nothing, so that no sample point fires
    and the VAE and text encoders are not kept for sampling (see :func:`is_scheduled`).

    An every-N option of 0 or below is off, with kohya's line saying so. Nothing scheduled: cleared
    without reading the file, with one line only when the file has content (the GUI's empty file
    says nothing). Scheduled, but the file is empty or missing: cleared with one line. Call after
    :func:`validate_arguments`.
    """
    for flag in EVERY_N_FLAGS:
        if getattr(args, flag, None) is not None and every(args, flag) is None:
            announce(f"--{flag} {getattr(args, flag)}: 0 or less, so sampling by it is off (as in kohya)")
    path = getattr(args, "sample_prompts", None)
    if not path:
        return
    if not is_scheduled(args):
        if os.path.isfile(path) and os.path.getsize(path) > 0:
            announce(f"--sample_prompts {path}: no sample point scheduled (--sample_every_n_steps, "
                     f"--sample_every_n_epochs or --sample_at_first); no sample images this run")
        args.sample_prompts = None
    elif not load_prompts(path):
        announce(f"--sample_prompts {path}: the file is empty or missing; no sample images this run")
        args.sample_prompts = None


def is_sample_point(args: argparse.Namespace, when: str, step: int, epoch: Optional[int] = None) -> bool:
    """kohya's schedule. ``when``: "first" (before the first step), "step" (after optimizer step
    ``step``) or "epoch" (after epoch ``epoch``, 1-based)."""
    if not getattr(args, "sample_prompts", None):
        return False
    if when == "first":
        return bool(args.sample_at_first)
    epochs, steps = every(args, "sample_every_n_epochs"), every(args, "sample_every_n_steps")
    if when == "epoch":
        return epochs is not None and epoch is not None and epoch % epochs == 0
    return epochs is None and steps is not None and step % steps == 0


def make_scheduler(sampler: str, scheduler_config: dict[str, Any], v_parameterization: bool = False):
    """The diffusers scheduler for one of kohya's sampler names, on the model's own noise schedule."""
    import diffusers

    classes = {
        "ddim": "DDIMScheduler", "pndm": "PNDMScheduler", "lms": "LMSDiscreteScheduler",
        "euler": "EulerDiscreteScheduler", "euler_a": "EulerAncestralDiscreteScheduler",
        "heun": "HeunDiscreteScheduler", "dpm_2": "KDPM2DiscreteScheduler",
        "dpm_2_a": "KDPM2AncestralDiscreteScheduler", "dpmsolver": "DPMSolverMultistepScheduler",
        "dpmsolver++": "DPMSolverMultistepScheduler", "dpmsingle": "DPMSolverSinglestepScheduler",
    }
    name = sampler[2:] if sampler.startswith("k_") else sampler
    if name not in classes:
        raise UserError(f"--sample_sampler {sampler!r} is unknown; valid: {', '.join(SAMPLERS)}")
    extra: dict[str, Any] = {}
    if name in ("dpmsolver", "dpmsolver++"):
        extra["algorithm_type"] = name
        if name == "dpmsolver":
            extra["final_sigmas_type"] = "sigma_min"  # diffusers refuses "zero" for the non-++ solver
    if v_parameterization:
        extra["prediction_type"] = "v_prediction"
    config = {key: value for key, value in scheduler_config.items() if not key.startswith("_")}
    try:
        return getattr(diffusers, classes[name]).from_config({**config, **extra})
    except ImportError as error:  # lms / k_lms need scipy, which is not a requirement
        missing = "scipy" if "scipy" in str(error) else str(error).strip().splitlines()[0]
        raise UserError(f"sampler {sampler!r} needs {missing}: pip install {missing}, or choose another "
                        f"--sample_sampler / --ss") from None


def image_file_name(output_name: Optional[str], prompt: SamplePrompt, step: int, epoch: Optional[int],
                    timestamp: Optional[float] = None) -> str:
    """kohya's sample file name."""
    counter = f"e{epoch:06d}" if epoch is not None else f"{step:06d}"
    stamp = time.strftime("%Y%m%d%H%M%S", time.localtime(timestamp))
    seed = "" if prompt.seed is None else f"_{prompt.seed}"
    prefix = f"{output_name}_" if output_name else ""
    return f"{prefix}{counter}_{prompt.index:02d}_{stamp}{seed}.png"


@contextmanager
def preserved_training_state(modules: list[torch.nn.Module]) -> Iterator[None]:
    """Put ``modules`` in eval mode inside the block; restore every submodule's mode and all RNG states after."""
    from library.train_state import rng_state, set_rng_state

    saved_rng = rng_state()
    modes = [(module, module.training) for root in modules for module in root.modules()]
    try:
        for root in modules:
            root.eval()
        yield
    finally:
        for module, training in modes:
            module.training = training
        set_rng_state(saved_rng)


def prompt_embeddings(models, prompt: SamplePrompt, clip_skip: Optional[int] = None) -> dict[str, torch.Tensor]:
    """The pipeline's conditioning arguments for one prompt and its negative prompt ("" when none),
    encoded as training encodes captions, with A1111 weights, in as many 75-token chunks as the longer
    of the two needs (up to :data:`MAX_PROMPT_CHUNKS`; one line when a prompt is cut)."""
    texts = [prompt.prompt, prompt.negative_prompt or ""]
    lengths = [len(text_encoding.weighted_tokens(models.tokenizers[0], text)[0]) for text in texts]
    chunks = min(MAX_PROMPT_CHUNKS, max(1, math.ceil(max(lengths) / text_encoding.CLIP_TOKENS_PER_CHUNK)))
    limit = chunks * text_encoding.CLIP_TOKENS_PER_CHUNK
    if max(lengths) > limit:
        print(f"\nsample prompt {prompt.index}: {max(lengths)} tokens, the first {limit} are used", flush=True)
    max_token_length = None if chunks == 1 else limit
    if models.kind == "sdxl":
        hidden, pooled = text_encoding.encode_sdxl(models.tokenizers, models.text_encoders, texts, max_token_length,
                                                   weighted=True)
        return {"prompt_embeds": hidden[:1], "negative_prompt_embeds": hidden[1:],
                "pooled_prompt_embeds": pooled[:1], "negative_pooled_prompt_embeds": pooled[1:]}
    hidden = text_encoding.encode_sd(models.tokenizers[0], models.text_encoders[0], texts, max_token_length,
                                     clip_skip, weighted=True)
    return {"prompt_embeds": hidden[:1], "negative_prompt_embeds": hidden[1:]}


def build_pipeline(models, scheduler):
    """A diffusers pipeline over the in-memory components of ``models`` (kind from ``models.kind``; an
    inpainting pipeline for a 9-channel UNet)."""
    from diffusers import (StableDiffusionInpaintPipeline, StableDiffusionPipeline, StableDiffusionXLInpaintPipeline,
                           StableDiffusionXLPipeline)

    if models.vae is None or not models.text_encoders:
        raise UserError("sampling needs the VAE and text encoders, which were freed after caching")
    inpaint = models.unet.config.in_channels == inpainting.INPAINTING_IN_CHANNELS
    if models.kind == "sdxl":
        pipeline = (StableDiffusionXLInpaintPipeline if inpaint else StableDiffusionXLPipeline)(
            vae=models.vae, text_encoder=models.text_encoders[0], text_encoder_2=models.text_encoders[1],
            tokenizer=models.tokenizers[0], tokenizer_2=models.tokenizers[1], unet=models.unet, scheduler=scheduler,
            add_watermarker=False)
    else:
        pipeline = (StableDiffusionInpaintPipeline if inpaint else StableDiffusionPipeline)(
            vae=models.vae, text_encoder=models.text_encoders[0], tokenizer=models.tokenizers[0], unet=models.unet,
            scheduler=scheduler, safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def replaced_in_prompt(prompt: SamplePrompt, replacement: Optional[tuple[str, str]]) -> SamplePrompt:
    """``prompt`` with every occurrence of ``replacement[0]`` in its text and negative text replaced by
    ``replacement[1]`` (kohya's ``prompt_replacement``); unchanged for None."""
    if replacement is None:
        return prompt
    old, new = replacement
    negative = prompt.negative_prompt.replace(old, new) if prompt.negative_prompt else prompt.negative_prompt
    return replace(prompt, prompt=prompt.prompt.replace(old, new), negative_prompt=negative)


def sample_images(args: argparse.Namespace, accelerator, models, network: torch.nn.Module, device: torch.device,
                  *, when: str, step: int, epoch: Optional[int] = None,
                  prompt_replacement: Optional[tuple[str, str]] = None) -> list[Path]:
    """Generate the ``--sample_prompts`` images if ``(when, step, epoch)`` is a sample point (see
    :func:`is_sample_point`); returns the written files. ``network`` is already applied to
    ``models``; ``prompt_replacement`` (old, new) rewrites each prompt's text before it is encoded
    (textual inversion: the token string -> all its tokens). Training state (weights, modes, RNG) is
    unchanged afterwards."""
    if not is_sample_point(args, when, step, epoch) or not accelerator.is_main_process:
        return []
    try:  # the file may have been edited since the start: a broken edit must not end the training
        prompts = load_prompts(args.sample_prompts)
        check_samplers(args, prompts)
    except UserError as error:
        print(f"\n{error}; no sample images at step {step}", flush=True)
        return []
    if not prompts:
        print(f"\n--sample_prompts {args.sample_prompts}: no prompts now; no sample images at step {step}", flush=True)
        return []
    folder = Path(args.output_dir) / SAMPLE_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    components = [models.unet, models.vae, *models.text_encoders, network]
    mixed = getattr(args, "mixed_precision", "no")
    autocast_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(mixed)
    written, for_trackers = [], []
    with preserved_training_state(components), torch.no_grad():
        pipeline = build_pipeline(models, make_scheduler(args.sample_sampler, models.scheduler_config,
                                                         getattr(args, "v_parameterization", False)))
        autocast = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else nullcontext()
        for prompt in (replaced_in_prompt(prompt, prompt_replacement) for prompt in prompts):
            pipeline.scheduler = make_scheduler(prompt.sampler or args.sample_sampler, models.scheduler_config,
                                                getattr(args, "v_parameterization", False))
            seed = prompt.seed if prompt.seed is not None else random.SystemRandom().randrange(2**63)
            generator = torch.Generator(device=device).manual_seed(seed)
            if models.unet.config.in_channels == inpainting.INPAINTING_IN_CHANNELS:
                try:
                    inpaint = inpainting.sample_inputs(prompt.image, prompt.mask, prompt.width, prompt.height, seed)
                except OSError as error:  # kohya: a missing image skips the sample, not the training
                    print(f"\nsample prompt {prompt.index}: {error}; skipped", flush=True)
                    continue
            else:
                inpaint = {}
            with autocast:
                conditioning = prompt_embeddings(models, prompt, getattr(args, "clip_skip", None))
                image = pipeline(**conditioning, **inpaint, width=prompt.width, height=prompt.height,
                                 num_inference_steps=prompt.sample_steps, guidance_scale=prompt.scale,
                                 generator=generator).images[0]
            path = folder / image_file_name(args.output_name, prompt, step, epoch if when == "epoch" else None)
            png = io.BytesIO()
            image.save(png, format="PNG")
            atomic_files.write_file(path, png.getvalue())
            written.append(path)
            for_trackers.append((image, prompt.prompt))
    tracking.log_sample_images(accelerator, for_trackers, step)
    print(f"\nsampled {len(written)} image(s) into {folder} at step {step}", flush=True)
    return written
