"""What a full fine-tune trains, in which optimizer groups and at which learning rates, and in which dtypes
the models are kept: kohya's rules of ``sdxl_train.py``, ``fine_tune.py`` and ``train_db.py`` as pure functions.

* :class:`TrainedParts` (resolved once from the options by :meth:`TrainedParts.resolve`): the UNet's learning
  rate (or frozen), SDXL's 23 ``--block_lr`` values, each text encoder's learning rate (or frozen).
* :func:`param_groups`: the optimizer groups (:class:`ParamGroup`, with the name kohya logs the group's
  learning rate under), groups of learning rate 0 dropped as kohya drops them.
* :func:`model_dtypes`: ``--full_fp16`` / ``--full_bf16`` / ``--no_half_vae`` -> the dtype of each model.

kohya's rules, per script:

=====================  ==============================================  ==========================================
                       UNet                                            text encoder(s)
=====================  ==============================================  ==========================================
``sdxl_train``         trained when ``--learning_rate`` != 0;          with ``--train_text_encoder``: TE1 at
                       ``--block_lr``: 23 groups (time/label           ``--learning_rate_te1``, TE2 at
                       embeddings, input_blocks 0-8, middle_block      ``--learning_rate_te2`` (each default
                       0-2, output_blocks 0-8, out), lr 0 groups       ``--learning_rate``; 0: frozen). TE1's last
                       dropped                                         layer and final norm stay frozen (SDXL uses
                                                                       its penultimate layer)
``fine_tune``          always, ``--learning_rate``                     with ``--train_text_encoder``; own group at
                                                                       ``--learning_rate_te`` when given, else one
                                                                       group with the UNet
``train_db``           always, ``--learning_rate``                     unless ``--stop_text_encoder_training`` < 0
                                                                       (N >= 0: frozen after N steps, the
                                                                       trainable's step hook);
                                                                       groups as ``fine_tune``
=====================  ==============================================  ==========================================

Dtypes (all scripts): a trained model is float32, or the ``--mixed_precision`` dtype with ``--full_fp16``
(needs fp16) / ``--full_bf16`` (needs bf16); a frozen UNet or text encoder is in the mixed-precision dtype
(SDXL's text encoders in float32 again once their outputs are cached, as kohya keeps them for sampling); the
VAE in the mixed-precision dtype unless ``--no_half_vae``. kohya's ``train_db.py`` / ``fine_tune.py`` silently
ignore ``--full_bf16``; here it applies to them as to SDXL.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

import torch

from library import checkpoint_keys as ck
from library.errors import UserError
from library.models import StableDiffusionModels

Script = Literal["sdxl_train", "fine_tune", "train_db"]
SDXL_BLOCK_LR_COUNT = 23
MIXED_PRECISION_DTYPES = {"no": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def add_arguments(parser: argparse.ArgumentParser, script: Script) -> None:
    """The options of ``script`` that say what trains at which learning rate (kohya's names and defaults)."""
    if script in ("sdxl_train", "fine_tune"):
        parser.add_argument("--train_text_encoder", action="store_true",
                            help="train the text encoder(s) too (default: only the UNet)")
    if script == "sdxl_train":
        for index in (1, 2):
            parser.add_argument(f"--learning_rate_te{index}", type=float, default=None,
                                help=f"learning rate of text encoder {index} with --train_text_encoder; 0 keeps it "
                                     f"frozen (default: --learning_rate)")
        parser.add_argument("--block_lr", type=str, default=None,
                            help=f"{SDXL_BLOCK_LR_COUNT} comma-separated UNet learning rates: time/label embeddings, "
                                 f"input blocks 0-8, middle block 0-2, output blocks 0-8, out; a block at 0 is not "
                                 f"trained (default: --learning_rate for the whole UNet)")
    else:
        parser.add_argument("--learning_rate_te", type=float, default=None,
                            help="learning rate of the text encoder (default: --learning_rate, in one optimizer "
                                 "group with the UNet)")
    if script == "train_db":
        parser.add_argument("--stop_text_encoder_training", type=int, default=None,
                            help="the text encoder trains for the first N optimizer steps, then stays frozen; "
                                 "-1 (any negative): never trained (default: trained to the end)")


def parse_block_lr(text: Optional[str]) -> Optional[tuple[float, ...]]:
    """``--block_lr`` as 23 floats (None when not given); UserError naming the flag otherwise."""
    if not text:
        return None
    try:
        values = tuple(float(value) for value in text.split(","))
    except ValueError:
        raise UserError(f"--block_lr {text}: give {SDXL_BLOCK_LR_COUNT} comma-separated numbers, e.g. "
                        f"{','.join(['1e-5'] * 3)},... (one per UNet block)") from None
    if len(values) != SDXL_BLOCK_LR_COUNT:
        raise UserError(f"--block_lr: {len(values)} value(s) given, SDXL has {SDXL_BLOCK_LR_COUNT} UNet blocks "
                        f"(time/label embeddings, input blocks 0-8, middle block 0-2, output blocks 0-8, out)")
    return values


@dataclass(frozen=True)
class TrainedParts:
    """What trains at which learning rate. ``None``: frozen."""

    unet_lr: Optional[float]
    text_encoder_lrs: tuple[Optional[float], ...]
    block_lrs: Optional[tuple[float, ...]] = None
    """SDXL ``--block_lr``: the UNet's 23 block learning rates (then ``unet_lr`` only says it trains)."""
    one_group: bool = False
    """``fine_tune`` / ``train_db`` without ``--learning_rate_te``: UNet and text encoder in one group."""
    freeze_te1_last_layer: bool = False
    """``sdxl_train``: TE1's last layer and final norm stay frozen when TE1 trains."""

    @classmethod
    def resolve(cls, script: Script, learning_rate: float, *, train_text_encoder: bool = False,
                learning_rate_te: Optional[float] = None, learning_rate_te1: Optional[float] = None,
                learning_rate_te2: Optional[float] = None, block_lr: Optional[str] = None,
                stop_text_encoder_training: Optional[int] = None) -> "TrainedParts":
        """kohya's rules for ``script`` (see the module's table)."""
        if script == "sdxl_train":
            unet_lr = learning_rate if learning_rate != 0 else None
            te_lrs: list[Optional[float]] = [None, None]
            if train_text_encoder:
                te_lrs = [lr if lr != 0 else None
                          for lr in (learning_rate_te1 if learning_rate_te1 is not None else learning_rate,
                                     learning_rate_te2 if learning_rate_te2 is not None else learning_rate)]
            return cls(unet_lr, tuple(te_lrs), parse_block_lr(block_lr) if unet_lr is not None else None,
                       freeze_te1_last_layer=True)
        if script == "fine_tune":
            trains_te = train_text_encoder
        elif script == "train_db":
            trains_te = stop_text_encoder_training is None or stop_text_encoder_training >= 0
        else:
            raise ValueError(f"unknown script {script!r}")
        te_lr = (learning_rate_te if learning_rate_te is not None else learning_rate) if trains_te else None
        return cls(learning_rate, (te_lr,), one_group=trains_te and learning_rate_te is None)

    @classmethod
    def from_args(cls, args: argparse.Namespace, script: Script) -> "TrainedParts":
        """:meth:`resolve` from the options of :func:`add_arguments` and ``--learning_rate``."""
        return cls.resolve(script, args.learning_rate, train_text_encoder=getattr(args, "train_text_encoder", False),
                           learning_rate_te=getattr(args, "learning_rate_te", None),
                           learning_rate_te1=getattr(args, "learning_rate_te1", None),
                           learning_rate_te2=getattr(args, "learning_rate_te2", None),
                           block_lr=getattr(args, "block_lr", None),
                           stop_text_encoder_training=getattr(args, "stop_text_encoder_training", None))

    @property
    def trains_unet(self) -> bool:
        return self.unet_lr is not None

    def trains_text_encoder(self, index: int) -> bool:
        return self.text_encoder_lrs[index] is not None


@dataclass
class ParamGroup:
    """One optimizer group: its parameters (name -> tensor), learning rate and the name kohya logs it under
    (``lr/<log_name>``)."""

    log_name: str
    params: dict[str, torch.nn.Parameter]
    lr: float

    def for_optimizer(self) -> dict:
        return {"params": list(self.params.values()), "lr": self.lr}


def sdxl_block_index(original_name: str) -> int:
    """kohya's ``--block_lr`` block of an SDXL UNet parameter named in the original layout
    (``sdxl_train.get_block_params_to_optimize``)."""
    head, _, rest = original_name.partition(".")
    if head in ("time_embed", "label_emb"):
        return 0
    if head == "input_blocks":
        return 1 + int(rest.split(".")[0])
    if head == "middle_block":
        return 10 + int(rest.split(".")[0])
    if head == "output_blocks":
        return 13 + int(rest.split(".")[0])
    if head == "out":
        return 22
    raise ValueError(f"unexpected SDXL UNet parameter name: {original_name}")


def unet_block_groups(unet: torch.nn.Module, block_lrs: Sequence[float]) -> list[ParamGroup]:
    """The UNet's ``--block_lr`` groups, logged as ``block<i>``; blocks at lr 0 are left out (not trained)."""
    table = ck.unet_block_table(unet.config)
    blocks: list[dict[str, torch.nn.Parameter]] = [{} for _ in range(SDXL_BLOCK_LR_COUNT)]
    for name, parameter in unet.named_parameters():
        blocks[sdxl_block_index(ck.translate(name, table))][name] = parameter
    return [ParamGroup(f"block{index}", params, lr) for index, (params, lr) in enumerate(zip(blocks, block_lrs))
            if lr != 0]


def frozen_parameter_names(models: StableDiffusionModels, parts: TrainedParts) -> dict[str, set[str]]:
    """Component (``unet``, ``text_encoder``, ``text_encoder_2``) -> names of its parameters that do not train:
    frozen components whole, ``--block_lr`` blocks at 0, and TE1's last layer and final norm (SDXL)."""
    frozen: dict[str, set[str]] = {}
    trained = {name for group in param_groups(models, parts) for name in group.params}
    for component, model in _components(models).items():
        frozen[component] = {name for name, _ in model.named_parameters() if f"{component}.{name}" not in trained}
    return frozen


def param_groups(models: StableDiffusionModels, parts: TrainedParts) -> list[ParamGroup]:
    """The optimizer groups of ``parts`` over ``models`` in kohya's order (UNet or its blocks, then TE1, TE2).
    Parameter names are ``<component>.<name>``. Log names as kohya writes them: ``unet``, then
    ``text_encoder1``, ``text_encoder2`` by position (kohya names the groups in that order whichever
    trains), ``block<i>`` with ``--block_lr``."""
    components = _components(models)
    groups: list[ParamGroup] = []
    if parts.trains_unet:
        if parts.block_lrs is not None:
            for group in unet_block_groups(models.unet, parts.block_lrs):
                groups.append(ParamGroup(group.log_name, _prefixed("unet", group.params), group.lr))
        else:
            groups.append(ParamGroup("unet", _prefixed("unet", dict(models.unet.named_parameters())), parts.unet_lr))
    encoders = [name for name in components if name.startswith("text_encoder")]
    for index, component in enumerate(encoders):
        lr = parts.text_encoder_lrs[index]
        if lr is None:
            continue
        params = dict(components[component].named_parameters())
        if index == 0 and parts.freeze_te1_last_layer:
            params = {name: p for name, p in params.items() if not _is_clip_last_layer(name, components[component])}
        groups.append(ParamGroup("", _prefixed(component, params), lr))
    if parts.one_group:  # kohya hands the optimizer one flat list: the optimizer's default lr, --learning_rate
        merged = {name: p for group in groups for name, p in group.params.items()}
        groups = [ParamGroup("unet", merged, parts.unet_lr)]
    unet_groups = sum(1 for group in groups if group.log_name == "unet" or group.log_name.startswith("block"))
    for position, group in enumerate(groups[unet_groups:]):
        group.log_name = f"text_encoder{position + 1}"
    return groups


def _components(models: StableDiffusionModels) -> dict[str, torch.nn.Module]:
    named: dict[str, torch.nn.Module] = {"unet": models.unet}
    for index, encoder in enumerate(models.text_encoders):
        named["text_encoder" if index == 0 else f"text_encoder_{index + 1}"] = encoder
    return named


def _prefixed(component: str, params: dict[str, torch.nn.Parameter]) -> dict[str, torch.nn.Parameter]:
    return {f"{component}.{name}": parameter for name, parameter in params.items()}


def _is_clip_last_layer(name: str, text_encoder: torch.nn.Module) -> bool:
    """Whether ``name`` is in the last encoder layer or the final layer norm of a CLIP text model (HF names;
    transformers >= 5.6 drops the ``text_model.`` level of ``CLIPTextModel``)."""
    inner = "text_model." if hasattr(text_encoder, "text_model") else ""
    last = text_encoder.config.num_hidden_layers - 1
    return name.startswith((f"{inner}encoder.layers.{last}.", f"{inner}final_layer_norm."))


def apply_requires_grad(models: StableDiffusionModels, parts: TrainedParts) -> None:
    """Set ``requires_grad`` of every UNet and text-encoder parameter to whether it trains; the VAE never does."""
    frozen = frozen_parameter_names(models, parts)
    for component, model in _components(models).items():
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name not in frozen[component])
    models.vae.requires_grad_(False)


@dataclass(frozen=True)
class ModelDtypes:
    """The dtype each model is kept in during training."""

    unet: torch.dtype
    text_encoders: tuple[torch.dtype, ...]
    vae: torch.dtype


def check_full_precision(mixed_precision: str, full_fp16: bool, full_bf16: bool) -> None:
    """``--full_fp16`` needs ``--mixed_precision fp16``, ``--full_bf16`` bf16 (kohya asserts the same); not both."""
    if full_fp16 and full_bf16:
        raise UserError("--full_fp16 and --full_bf16: give one of them (the models are kept in one dtype)")
    for flag, given, needed in (("--full_fp16", full_fp16, "fp16"), ("--full_bf16", full_bf16, "bf16")):
        if given and mixed_precision != needed:
            raise UserError(f"{flag} needs --mixed_precision {needed} (given: {mixed_precision})")


def model_dtypes(parts: TrainedParts, *, mixed_precision: str = "no", full_fp16: bool = False,
                 full_bf16: bool = False, no_half_vae: bool = False,
                 cache_text_encoder_outputs: bool = False) -> ModelDtypes:
    """kohya's dtypes (see the module's docstring); UserError for a ``--full_*`` flag without its precision."""
    check_full_precision(mixed_precision, full_fp16, full_bf16)
    weight = MIXED_PRECISION_DTYPES[mixed_precision]
    full = full_fp16 or full_bf16

    def of(trains: bool) -> torch.dtype:
        return weight if full or not trains else torch.float32

    encoders = tuple(torch.float32 if cache_text_encoder_outputs and not parts.trains_text_encoder(index)
                     else of(parts.trains_text_encoder(index)) for index in range(len(parts.text_encoder_lrs)))
    return ModelDtypes(of(parts.trains_unet), encoders, torch.float32 if no_half_vae else weight)
