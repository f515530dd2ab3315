"""Load SDXL / SD1.x / SD2.x from a diffusers folder or a single file.

Everything is loaded in fp32 on the CPU (``stored_as`` can keep chosen weights in
another form from the start, see ``load_models``); callers move and cast. A single file
(``.safetensors`` or ``.ckpt``) is read tensor by tensor into models built on
the meta device, so peak memory is one model plus one tensor, never a second
copy of the state dict. The architecture comes from ``--model_config_dir`` or
from the configs shipped in ``library/model_configs``; names are translated by
``library.checkpoint_keys``.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence

import torch
from safetensors import SafetensorError

from library import checkpoint_keys as ck
from library.checkpoint_keys import KeyMap, ModelKind, TensorRule
from library.checkpoint_files import CheckpointReader
from library.clip_tokenizers import load_tokenizers
from library.errors import UserError, first_line
from library.models import StableDiffusionModels  # noqa: F401  (the trainers import it from here too)

if TYPE_CHECKING:  # heavy imports stay lazy so `--help` is fast
    from diffusers import AutoencoderKL, UNet2DConditionModel

MODEL_CONFIGS_DIR = Path(__file__).resolve().parent / "model_configs"
SHIPPED_CONFIG_NAMES: dict[str, str] = {"sdxl": "sdxl_base", "sd1": "sd15", "sd2": "sd2_v"}

SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth", ".bin")
# Weight files of a diffusers/transformers component folder (also sharded: their .index.json).
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".index.json")
_VAE_TOP_LEVEL = ("encoder.", "decoder.", "quant_conv.", "post_quant_conv.")

# (component, owning module, attribute) -> the dtype that parameter is stored in; None: float32.
# Components are ``checkpoint_keys.checkpoint_key_maps``' names (unet, vae, text_encoder, text_encoder_2).
# (component, module, attribute) -> None (fp32) or what turns the loaded value into the stored tensor.
StoredAs = Callable[[str, torch.nn.Module, str], Optional[Callable[[torch.Tensor], torch.Tensor]]]


def stored_in_dtypes(dtypes: Mapping[str, torch.dtype], first: StoredAs | None = None) -> StoredAs | None:
    """A ``stored_as`` that reads every floating parameter of the components named in ``dtypes`` straight
    into that dtype (a full fine-tune's models in their training dtype: a full-size SDXL UNet with
    ``--full_bf16`` never exists in float32, 10 GiB). ``first`` (e.g. ``fp8_base.stored_as_rule``) wins
    where it names a conversion. The values equal a float32 load cast afterwards (an fp16 or bf16
    file's values are exact in float32, so the one rounding is the same)."""
    casts = {component: dtype for component, dtype in dtypes.items() if dtype != torch.float32}
    if not casts:
        return first

    def rule(component: str, module: torch.nn.Module, attribute: str
             ) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        convert = first(component, module, attribute) if first is not None else None
        if convert is not None or component not in casts:
            return convert
        dtype = casts[component]
        # copy: the loader's value may be a transient buffer or a view of the file
        return lambda value: value.to(dtype, copy=True) if value.is_floating_point() else value.clone()

    return rule


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the model-loading options (kohya names)."""
    group = parser.add_argument_group("model")
    group.add_argument("--pretrained_model_name_or_path", type=str, default=None,
                       help="base model: a diffusers model folder or a single .safetensors/.ckpt file "
                            "(default: none, required)")
    group.add_argument("--v2", action="store_true",
                       help="the base model is Stable Diffusion 2.x (default: off, SD1.x)")
    group.add_argument("--vae", type=str, default=None,
                       help="replace the model's VAE: a diffusers VAE folder or a single-file VAE "
                            "(default: the model's own)")
    group.add_argument("--tokenizer_cache_dir", type=str, default=None,
                       help="folder of CLIP tokenizers in kohya's layout (openai_clip-vit-large-patch14, ...); "
                            "build one offline with tools/build_clip_tokenizers.py (default: none)")
    group.add_argument("--model_config_dir", type=str, default=None,
                       help="diffusers-format folder of configs (no weights) describing a single-file model's "
                            "architecture (default: the shipped config for SDXL, SD1.5 or SD2.x 768-v)")
    group.add_argument("--lowram", action="store_true",
                       help="kohya's low-RAM loading: put the weights on the training device (GPU) as they are "
                            "read instead of building the models in host RAM first, for machines with more VRAM "
                            "than RAM; single files then never hold a model in RAM. No effect on CPU "
                            "(default: off)")
    group.add_argument("--highvram", action="store_true",
                       help="kohya's high-VRAM mode: keep the CUDA allocator's cache after caching latents and "
                            "text encoder outputs instead of emptying it. No effect on CPU (default: off)")


def load_device(args: argparse.Namespace) -> torch.device:
    """Where ``load_models`` should put the weights: this process's training device with ``--lowram``, else CPU.

    Call after the ``Accelerator`` exists (its process state picks the device).
    """
    if not getattr(args, "lowram", False):
        return torch.device("cpu")
    from accelerate import PartialState

    return PartialState().device


def model_kind(*, sdxl: bool, v2: bool) -> ModelKind:
    """The model kind selected by the entry script (``sdxl``) and ``--v2``."""
    if sdxl and v2:
        raise UserError("--v2: SDXL models take no --v2 (it selects Stable Diffusion 2.x)")
    return "sdxl" if sdxl else "sd2" if v2 else "sd1"


def shipped_config_dir(kind: ModelKind) -> Path:
    """The architecture config folder shipped for ``kind``."""
    return MODEL_CONFIGS_DIR / SHIPPED_CONFIG_NAMES[kind]


def check_model_paths(args: argparse.Namespace, *, sdxl: bool) -> None:
    """Refuse, before anything is loaded, what the model options' paths alone show to be wrong:
    a missing model or ``--vae``, a folder that is not a diffusers model, a checkpoint of another
    kind (from a ``.safetensors`` header or ``model_index.json``), a bad ``--model_config_dir``.
    Reads headers and JSON only; ``.ckpt`` files are checked when loaded."""
    kind = model_kind(sdxl=sdxl, v2=args.v2)
    path = _existing_model_path(args.pretrained_model_name_or_path)
    if path.is_dir():
        _check_diffusers_folder(path, kind)
        _check_folder_weights(path, kind, with_vae=args.vae is None)
    else:
        if args.model_config_dir is not None:
            _check_config_dir(Path(args.model_config_dir), kind)
        if path.suffix == ".safetensors":
            with CheckpointReader(path, "--pretrained_model_name_or_path") as reader:
                _check_checkpoint_kind(reader.keys(), kind, path, "--pretrained_model_name_or_path")
    if args.vae is not None:
        _check_vae_path(Path(args.vae), "--vae")


def load_models_from_args(args: argparse.Namespace, *, sdxl: bool) -> StableDiffusionModels:
    """``load_models`` driven by the options of ``add_arguments``."""
    return load_models(args.pretrained_model_name_or_path, sdxl=sdxl, v2=args.v2,
                       model_config_dir=args.model_config_dir, tokenizer_cache_dir=args.tokenizer_cache_dir,
                       vae_path=args.vae, device=load_device(args))


def load_models(path: str | os.PathLike, *, sdxl: bool, v2: bool = False,
                model_config_dir: str | os.PathLike | None = None,
                tokenizer_cache_dir: str | os.PathLike | None = None,
                vae_path: str | os.PathLike | None = None,
                device: torch.device | str | None = None,
                stored_as: StoredAs | None = None) -> StableDiffusionModels:
    """Load tokenizers, text encoders, VAE, UNet and scheduler config, fp32 on CPU, in eval mode.

    ``device`` (``--lowram``, see ``load_device``): put the weights there instead; a single
    file's tensors go there one at a time, a diffusers folder's components one at a time.
    ``stored_as`` (``library.fp8_base.stored_as_rule``): parameters it names a conversion for
    are kept as it returns them instead of fp32: a single file's tensors are read straight into it
    (their fp32 copy never exists), a diffusers folder's components are converted right after
    each one is loaded.

    ``path`` is a diffusers folder (components via ``from_pretrained``, offline;
    ``model_config_dir`` is not used) or a single file (architecture and
    tokenizers from ``model_config_dir``, else the shipped configs).
    ``vae_path`` replaces the VAE (see ``load_vae``); ``tokenizer_cache_dir``
    is kohya's tokenizer cache (see ``load_tokenizers``). Raises ``UserError``
    for a missing/corrupt path, a checkpoint of another kind, missing,
    unexpected or misshapen tensors, or unavailable tokenizers.
    """
    kind = model_kind(sdxl=sdxl, v2=v2)
    path = _existing_model_path(path)
    keep_vae = vae_path is None
    if path.is_dir():
        unet, vae, text_encoders, vae_config, scheduler_config = _load_diffusers_folder(path, kind, keep_vae, device,
                                                                                        stored_as)
        tokenizer_dir: Path | None = path
    else:
        if model_config_dir is not None:
            _check_config_dir(Path(model_config_dir), kind)
        config_dir = Path(model_config_dir) if model_config_dir is not None else shipped_config_dir(kind)
        unet, vae, text_encoders, vae_config = _load_single_file(path, kind, config_dir, keep_vae, device,
                                                                 stored_as)
        scheduler_config = _read_json(config_dir / "scheduler" / "scheduler_config.json", "--model_config_dir")
        tokenizer_dir = Path(model_config_dir) if model_config_dir is not None else None
    if vae is None:
        vae = load_vae(vae_path, vae_config=vae_config)
        if device is not None:
            vae.to(device)
    tokenizers = load_tokenizers(kind, model_dir=tokenizer_dir, tokenizer_cache_dir=tokenizer_cache_dir)
    name = path.name if path.is_dir() else path.stem
    return StableDiffusionModels(kind, tokenizers, text_encoders, vae, unet, scheduler_config, name)


def _existing_model_path(path: str | os.PathLike | None) -> Path:
    flag = "--pretrained_model_name_or_path"
    if not path:
        raise UserError(f"{flag} is required: a diffusers model folder or a .safetensors/.ckpt file")
    path = Path(path)
    if not path.exists():
        raise UserError(f"{flag}: {path} does not exist; give a diffusers model folder or a "
                        ".safetensors/.ckpt file (hub ids are not downloaded)")
    return path


# ---------------------------------------------------------------------------
# Diffusers folders
# ---------------------------------------------------------------------------

def _load_diffusers_folder(folder: Path, kind: ModelKind, keep_vae: bool, device: torch.device | str | None = None,
                           stored_as: StoredAs | None = None):
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    flag = "--pretrained_model_name_or_path"
    _check_diffusers_folder(folder, kind)

    def load(cls, subfolder: str, **kwargs):
        sub = folder / subfolder
        if not sub.is_dir():
            raise UserError(f"{flag}: {folder} has no {subfolder}/ folder")
        variant = "fp16" if _only_fp16_weights(sub) else None
        try:
            model = cls.from_pretrained(folder, subfolder=subfolder, local_files_only=True, variant=variant, **kwargs)
        except (OSError, ValueError, RuntimeError, SafetensorError) as error:
            raise UserError(f"{flag}: cannot load {sub}: {first_line(error)}") from error
        _convert_stored(model, subfolder, stored_as)  # before the next component loads
        return model.to(device) if device is not None else model

    unet = load(UNet2DConditionModel, "unet", torch_dtype=torch.float32).eval()
    vae = load(AutoencoderKL, "vae", torch_dtype=torch.float32).eval() if keep_vae else None
    vae_config = dict(vae.config) if vae is not None else _read_json(folder / "vae" / "config.json", flag)
    text_encoders = [load(CLIPTextModel, "text_encoder", dtype=torch.float32).eval()]
    if kind == "sdxl":
        text_encoders.append(load(CLIPTextModelWithProjection, "text_encoder_2", dtype=torch.float32).eval())
    scheduler_file = folder / "scheduler" / "scheduler_config.json"
    if not scheduler_file.is_file():
        scheduler_file = shipped_config_dir(kind) / "scheduler" / "scheduler_config.json"
    return unet, vae, text_encoders, vae_config, _read_json(scheduler_file, flag)


def _check_diffusers_folder(folder: Path, kind: ModelKind) -> None:
    """A diffusers model folder of ``kind``, judged from its JSON files."""
    flag = "--pretrained_model_name_or_path"
    index = _read_json(folder / "model_index.json", flag,
                       missing="is a folder but not a diffusers model (no model_index.json)")
    if kind == "sdxl" and "text_encoder_2" not in index:
        raise UserError(f"{flag}: {folder} is not an SDXL model (no text_encoder_2 in model_index.json); "
                        "use train_network.py for SD1.x/2.x")
    if kind != "sdxl" and "text_encoder_2" in index:
        raise UserError(f"{flag}: {folder} is an SDXL model; train it with sdxl_train_network.py")
    if kind != "sdxl":
        # SD2.x UNets project into attention with Linear layers, SD1.x with 1x1 convs.
        unet_config = _read_json(folder / "unet" / "config.json", flag)
        if bool(unet_config.get("use_linear_projection")) != (kind == "sd2"):
            hint = "drop --v2" if kind == "sd2" else "pass --v2"
            raise UserError(f"{flag}: {folder} is an SD{'1' if kind == 'sd2' else '2'}.x model; {hint}")


def _check_folder_weights(folder: Path, kind: ModelKind, with_vae: bool) -> None:
    """Every component a diffusers model folder is loaded from holds a weights file (diffusers would
    print its search for one, then fail); a folder of configs only is meant as ``--model_config_dir``."""
    components = ["unet", "text_encoder", *(["text_encoder_2"] if kind == "sdxl" else []), *(["vae"] if with_vae else [])]
    for component in components:
        sub = folder / component
        if not sub.is_dir() or not any(name.endswith(_WEIGHT_SUFFIXES) for name in os.listdir(sub)):
            raise UserError(f"--pretrained_model_name_or_path: {folder} has no weights in {component}/ (a folder of "
                            f"configs only?); give a diffusers model folder with weights, or a single "
                            f".safetensors file with this folder as --model_config_dir")


def _only_fp16_weights(folder: Path) -> bool:
    names = [p.name for p in folder.iterdir()]
    weights = [n for n in names if n.endswith((".safetensors", ".bin"))]
    return bool(weights) and all(".fp16." in n for n in weights)


# ---------------------------------------------------------------------------
# Single files
# ---------------------------------------------------------------------------

def detect_checkpoint_kind(keys: Sequence[str]) -> ModelKind | None:
    """Which kind of model a single file holds, from its key names; ``None`` if it has no SD UNet."""
    key_set = set(keys)
    if any(k.startswith(ck.SDXL_OPEN_CLIP_PREFIX) for k in keys) or f"{ck.UNET_PREFIX}label_emb.0.0.weight" in key_set:
        return "sdxl"
    if any(k.startswith(ck.SD2_OPEN_CLIP_PREFIX) for k in keys):
        return "sd2"
    if any(k.startswith(ck.SD1_CLIP_PREFIX) for k in keys):
        return "sd1"
    return None  # no text encoder: SD1 and SD2 UNets differ only in shapes, left to the shape check


def _check_checkpoint_kind(keys: Sequence[str], kind: ModelKind, path: Path, flag: str) -> None:
    if not any(k.startswith(ck.UNET_PREFIX) for k in keys):
        raise UserError(f"{flag}: {path} is not a Stable Diffusion checkpoint (no tensors under {ck.UNET_PREFIX})")
    found = detect_checkpoint_kind(keys)
    if found is None or found == kind:
        return
    if found == "sdxl":
        raise UserError(f"{flag}: {path} is an SDXL checkpoint; train it with sdxl_train_network.py")
    if kind == "sdxl":
        raise UserError(f"{flag}: {path} is an SD{'2' if found == 'sd2' else '1'}.x checkpoint, not SDXL; "
                        "use train_network.py" + (" with --v2" if found == "sd2" else ""))
    if found == "sd2":
        raise UserError(f"{flag}: {path} is an SD2.x checkpoint; pass --v2")
    raise UserError(f"{flag}: {path} is an SD1.x checkpoint; drop --v2")


def checkpoint_unet_in_channels(reader: CheckpointReader) -> int | None:
    """The input channels of the UNet's ``conv_in`` as the file stores it (4; 9 for an inpainting model),
    None without it (the missing tensor is reported later): inpainting checkpoints share the base configs."""
    key = f"{ck.UNET_PREFIX}input_blocks.0.0.weight"
    return int(reader.shape(key)[1]) if key in set(reader.keys()) else None


def _check_config_dir(config_dir: Path, kind: ModelKind) -> None:
    needed = ["unet/config.json", "vae/config.json", "text_encoder/config.json", "scheduler/scheduler_config.json"]
    if kind == "sdxl":
        needed.append("text_encoder_2/config.json")
    if not config_dir.is_dir():
        raise UserError(f"--model_config_dir: {config_dir} is not a folder; give a diffusers-format config folder")
    for relative in needed:
        if not (config_dir / relative).is_file():
            raise UserError(f"--model_config_dir: {config_dir} has no {relative}; a {kind} config folder needs "
                            + ", ".join(needed))


def build_empty_models(kind: ModelKind, config_dir: Path, *, with_vae: bool = True,
                       unet_in_channels: int | None = None
                       ) -> tuple[UNet2DConditionModel, AutoencoderKL | None, list[torch.nn.Module], dict[str, Any]]:
    """UNet, VAE (or ``None``), text encoders of ``kind`` from ``config_dir`` on the meta device, and the VAE config.

    Parameters are meta tensors (no memory); buffers are real. ``unet_in_channels`` replaces the
    config's UNet input channels (an inpainting checkpoint's 9-channel ``conv_in``).
    """
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    flag = "--model_config_dir"
    unet_config = _read_json(config_dir / "unet" / "config.json", flag)
    if unet_in_channels is not None:
        unet_config["in_channels"] = unet_in_channels
    vae_config = _read_json(config_dir / "vae" / "config.json", flag)
    encoder_classes = [CLIPTextModel] + ([CLIPTextModelWithProjection] if kind == "sdxl" else [])
    encoder_configs = []
    for index in range(len(encoder_classes)):
        sub = "text_encoder" if index == 0 else f"text_encoder_{index + 1}"
        encoder_configs.append(CLIPTextConfig(**_read_json(config_dir / sub / "config.json", flag)))
    # Buffers stay real (include_buffers=False): CLIP's position_ids are not in any file.
    with init_empty_weights(include_buffers=False):
        unet = UNet2DConditionModel.from_config(unet_config)
        vae = AutoencoderKL.from_config(vae_config) if with_vae else None
        text_encoders = [cls(config) for cls, config in zip(encoder_classes, encoder_configs)]
    return unet, vae, text_encoders, vae_config


def _load_single_file(path: Path, kind: ModelKind, config_dir: Path, keep_vae: bool,
                      device: torch.device | str | None = None, stored_as: StoredAs | None = None):
    flag = "--pretrained_model_name_or_path"
    if not path.is_file():
        raise UserError(f"{flag}: {path} is not a file or folder")
    with CheckpointReader(path, flag) as reader:
        _check_checkpoint_kind(reader.keys(), kind, path, flag)
        unet, vae, text_encoders, vae_config = build_empty_models(
            kind, config_dir, with_vae=keep_vae, unet_in_channels=checkpoint_unet_in_channels(reader))
        try:
            maps = ck.checkpoint_key_maps(kind, unet, vae, text_encoders)
        except KeyError as error:
            raise UserError(f"--model_config_dir: the architecture in {config_dir} is not supported: "
                            f"{error}") from error
        _stream_into(reader, maps, config_hint=f"configs in {config_dir}", device=device, stored_as=stored_as)
    return unet, vae, text_encoders, vae_config


def _stream_into(reader: CheckpointReader, components: Mapping[str, tuple[torch.nn.Module, KeyMap]],
                 config_hint: str, device: torch.device | str | None = None,
                 stored_as: StoredAs | None = None) -> None:
    """Fill every tensor of each component's (model, key map) from ``reader``, one tensor at a time,
    fp32 (or as ``stored_as`` converts it, see ``load_models``) on ``device`` (CPU).

    All names and shapes are checked before any data is read, so a wrong file
    fails fast. Keys outside every component's prefix are skipped (EMA copies,
    noise-schedule buffers, other components).
    """
    flag, path = reader.flag, reader.path
    ordered = sorted(components.items(), key=lambda item: len(item[1][1].prefix), reverse=True)
    plan: list[tuple[str, str, torch.nn.Module, TensorRule]] = []
    unexpected: list[str] = []
    present: set[str] = set()
    for key in reader.keys():
        for component, (model, key_map) in ordered:
            if key.startswith(key_map.prefix):
                rule = key_map.by_original.get(key)
                if rule is not None:
                    plan.append((key, component, model, rule))
                    present.add(key)
                elif not key_map.ignore(key):
                    unexpected.append(key)
                break
    missing = [rule.original for _, key_map in components.values() for rule in key_map.rules
               if rule.original not in present]
    if missing:
        raise UserError(f"{flag}: {path} lacks {len(missing)} tensor(s) the model needs, first: {missing[0]} "
                        f"(architecture from {config_hint}; --model_config_dir sets it)")
    if unexpected:
        raise UserError(f"{flag}: {path} has {len(unexpected)} tensor(s) the architecture has no place for, "
                        f"first: {unexpected[0]} (architecture from {config_hint}; --model_config_dir sets it)")
    meta_states = {id(model): model.state_dict() for model, _ in components.values()}
    for key, _, model, rule in plan:
        expected = tuple(rule.to_original([meta_states[id(model)][n] for n in rule.diffusers]).shape)
        found = reader.shape(key)
        if found != expected and not (rule.transform == "conv1x1" and found == expected[:2]):
            raise UserError(f"{flag}: {path}: {key} has shape {list(found)} but the architecture expects "
                            f"{list(expected)} (architecture from {config_hint}; --model_config_dir sets it)")
    del meta_states
    for key, component, model, rule in plan:
        for name, value in zip(rule.diffusers, rule.to_diffusers(reader.get(key, transient=True))):
            convert = None
            if stored_as is not None:
                module_name, _, attribute = name.rpartition(".")
                convert = stored_as(component, model.get_submodule(module_name), attribute)
            if convert is not None:  # a fresh tensor already
                _assign(model, name, convert(value).to(device or "cpu"))
            else:  # a fresh tensor on the target device, copied (and cast) from the transient read
                _assign(model, name, torch.empty(value.shape, dtype=torch.float32, device=device or "cpu").copy_(value))
    for model, _ in components.values():
        leftovers = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if leftovers:  # a rule table gap, not a user mistake
            raise RuntimeError(f"{type(model).__name__}.{leftovers[0]} was not loaded from {path}")
        model.eval()


def _convert_stored(model: torch.nn.Module, component: str, stored_as: StoredAs | None) -> None:
    """Convert, in place, the parameters of a loaded ``component`` that ``stored_as`` names a conversion for."""
    if stored_as is None:
        return
    for module in model.modules():
        for attribute, parameter in list(module.named_parameters(recurse=False)):
            convert = stored_as(component, module, attribute)
            if convert is not None:
                setattr(module, attribute, torch.nn.Parameter(convert(parameter.detach()),
                                                              requires_grad=parameter.requires_grad))


def _assign(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace the (meta) parameter or buffer ``name`` of ``model`` by ``value``."""
    module_name, _, attribute = name.rpartition(".")
    module = model.get_submodule(module_name)
    if attribute in module._parameters:
        old = module._parameters[attribute]
        module._parameters[attribute] = torch.nn.Parameter(value, requires_grad=old.requires_grad)
    elif attribute in module._buffers:
        module._buffers[attribute] = value
    else:
        raise KeyError(name)


# ---------------------------------------------------------------------------
# VAE
# ---------------------------------------------------------------------------

def load_vae(path: str | os.PathLike, *, vae_config: Mapping[str, Any], flag: str = "--vae") -> AutoencoderKL:
    """An ``AutoencoderKL`` (fp32, CPU, eval) from a diffusers folder or a single file.

    Folder: a VAE folder (``config.json`` + weights) or a model folder with
    ``vae/``; its own config wins. Single file: a full checkpoint
    (``first_stage_model.*``), a VAE in original names (``encoder.down.0...``)
    or in diffusers names; the architecture is ``vae_config`` (the base model's
    VAE config, so the latent scaling factor matches the base model).
    """
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL

    path = Path(path)
    _check_vae_path(path, flag)
    if path.is_dir():
        subfolder = "vae" if (path / "vae" / "config.json").is_file() else None
        try:
            return AutoencoderKL.from_pretrained(path, subfolder=subfolder, local_files_only=True,
                                                 torch_dtype=torch.float32).eval()
        except (OSError, ValueError, RuntimeError, SafetensorError) as error:
            raise UserError(f"{flag}: cannot load a VAE from {path}: {first_line(error)}") from error
    with CheckpointReader(path, flag) as reader:
        keys = reader.keys()
        with init_empty_weights(include_buffers=False):
            vae = AutoencoderKL.from_config(dict(vae_config))
        if any(k.startswith(ck.VAE_PREFIX) for k in keys):
            key_map = ck.vae_key_map(vae)
        elif any(k.startswith("encoder.down.") for k in keys):
            original = ck.vae_key_map(vae, prefix="")
            key_map = KeyMap("", original.rules, lambda key: not key.startswith(_VAE_TOP_LEVEL))
        elif any(k.startswith("encoder.down_blocks.") for k in keys):
            rules = tuple(TensorRule(name, (name,)) for name in vae.state_dict())
            key_map = KeyMap("", rules, lambda key: not key.startswith(_VAE_TOP_LEVEL))
        else:
            raise UserError(f"{flag}: {path} holds no VAE weights (no encoder/decoder tensors)")
        _stream_into(reader, {"vae": (vae, key_map)}, config_hint="the base model's VAE config")
    return vae


# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------

def _check_vae_path(path: Path, flag: str) -> None:
    if not path.exists():
        raise UserError(f"{flag}: {path} does not exist; give a diffusers VAE folder or a .safetensors/.ckpt file")
    if path.is_dir() and not (path / "vae" / "config.json").is_file() and not (path / "config.json").is_file():
        raise UserError(f"{flag}: {path} is a folder without config.json or vae/config.json")


def _read_json(path: Path, flag: str, missing: str | None = None) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except FileNotFoundError:
        if missing is not None:
            raise UserError(f"{flag}: {path.parent} {missing}") from None
        raise UserError(f"{flag}: {path} does not exist") from None
    except (OSError, ValueError) as error:
        raise UserError(f"{flag}: {path} is not readable JSON: {first_line(error)}") from error
