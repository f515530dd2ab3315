"""``--network_module lycoris.kohya``: the LyCORIS network types of the lycoris-lora package, in kohya's files.

The maths, the module classes (LoCon, LoHa, LoKr, IA3, GLoRA, DyLoRA, Diag-OFT, BOFT, Full,
and Norm for ``train_norm``) and the presets (``preset=full``, ``attn-only``, ..., or a preset
``.toml`` file) are lycoris' own: lycoris' ``LycorisNetworkKohya`` chooses the modules and builds
them. What this module adds is the model lycoris walks and how its arguments are read:

* **Naming as kohya's trainer + lycoris.** lycoris selects modules by class name and module path
  and names them ``<prefix>_<path>``. kohya hands it kohya's own UNets: for SDXL one in the
  original (SGM) layout (``input_blocks.4.1...``, ``time_embed``, ``out``), for SD1.x/2.x one
  with diffusers paths; both call their attention class ``CrossAttention``; and transformers 4's
  CLIPTextModel with its ``text_model.`` level. We train diffusers and transformers 5 models, so
  lycoris is given a *kohya view* of them (:func:`kohya_view`): stand-in containers that carry
  kohya's paths and class names, holding our real Linear/Conv2d/norm layers as leaves. lycoris
  wraps those leaves and names every module exactly as it does under kohya, so presets, custom
  preset files (``exclude_name``, ``name_algo_map`` patterns are written against kohya's paths)
  and file keys all match. One consequence, as under kohya: on SDXL the ``full`` preset's
  ``conv_in``/``conv_out``/``time_embedding`` names do not exist, so those layers are not trained.
* **Arguments as the kohya_ss GUI writes them** (``"False"``, ``"-1"``), validated before any model
  loads; unknown keys are refused in one line naming the valid ones.

Where lycoris' own entry points go wrong we do what the user means (see docs/network_types.md):
every boolean argument reads ``False``/``True``/``0``/``1`` (lycoris takes the GUI's string
``decompose_both=False`` as true); ``use_tucker``/``use_cp``/``use_conv_cp`` are one switch (any
true turns it on: lycoris lets ``use_cp`` overwrite ``use_tucker``); ``rank_dropout_scale`` and
``train_on_input``, which the GUI writes and lycoris' ``create_network`` drops, reach the modules;
``--network_dropout`` is lycoris' ``dropout``; BOFT skips the conv layers it cannot split at their
dim (the GUI's default ``conv_dim=1`` splits none; lycoris stops) and says so in one line, and a
linear layer it cannot split is a one-line error naming the dims that work; a DyLoRA file can be
loaded again (lycoris cannot) and an IA3 file read back (lycoris' reader crashes on its ``on_input``).

File keys: ``<lora_name>.<tensor>`` with lycoris' tensor names (``lora_up.weight``, ``hada_w1_a``,
``lokr_w1``, ``weight``/``on_input``, ``a1.weight``, ``oft_blocks``, ``diff``, ``w_norm``, ... plus
``alpha`` and ``dora_scale`` where used); see docs/network_types.md for each algo's keys and shapes.
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, Iterator, Mapping, Optional

import torch
from lycoris.config import PRESET
from lycoris.functional import factorization
from lycoris.kohya import LycorisNetworkKohya
from lycoris.logging import logger as lycoris_logger
from lycoris.modules import get_module, make_module
from lycoris.modules.base import LycorisBaseModule
from lycoris.modules.dylora import DyLoraModule
from lycoris.modules.full import FullModule
from lycoris.modules.ia3 import IA3Module
from lycoris.modules.loha import LohaModule
from lycoris.modules.lokr import LokrModule
from lycoris.modules.norms import NormModule
from lycoris.utils.preset import read_preset
from lycoris.wrapper import network_module_dict

from library import checkpoint_keys
from library.errors import UserError, first_line
from networks import network_base
from networks.lokr import check_factor as check_lokr_factor
from networks.network_base import AdapterNetwork, MaxNormStats

NETWORK_MODULE = "lycoris.kohya"

# lycoris' algo names (its create_network's `algo`); "lora" is lycoris' default and the same module as "locon".
ALGOS = ("lora", "locon", "loha", "lokr", "ia3", "glora", "dylora", "diag-oft", "boft", "full")
NUMBER_ARGS: dict[str, type] = {
    "conv_dim": int, "conv_alpha": float, "dropout": float, "rank_dropout": float, "module_dropout": float,
    "block_size": int, "constraint": float, "constrain": float, "factor": int,
}
# lycoris' boolean switches, plus the two the GUI writes that lycoris' create_network drops.
BOOL_ARGS = (
    "use_tucker", "use_cp", "use_conv_cp", "disable_conv_cp", "use_scalar", "train_norm", "rescaled", "dora_wd",
    "wd_on_output", "full_matrix", "bypass_mode", "rs_lora", "unbalanced_factorization", "decompose_both",
    "rank_dropout_scale", "train_on_input",
)
KNOWN_NETWORK_ARGS = ("algo", "preset", *NUMBER_ARGS, *BOOL_ARGS, *network_base.LORAPLUS_NETWORK_ARGS)


# --------------------------------------------------------------------------- arguments
@dataclass(frozen=True)
class LycorisOptions:
    """``--network_args`` of lycoris.kohya, read and checked (the GUI's strings, lycoris' defaults)."""

    algo: str
    preset: str
    network_args: Mapping[str, str]

    def number(self, key: str, default=None):
        kind = NUMBER_ARGS[key]
        # factor=-1 is lycoris' "as balanced as possible"; the other numbers are >= 0.
        return network_base.read_number(self.network_args, key, kind, default, minimum=None if key == "factor" else 0)

    def flag(self, key: str, default: bool = False) -> bool:
        return network_base.read_bool(self.network_args, key, default)

    @property
    def use_tucker(self) -> bool:
        """lycoris' four spellings of Tucker/CP decomposition of conv kernels, read as one switch."""
        return (self.flag("use_tucker") or self.flag("use_cp") or self.flag("use_conv_cp")
                or not self.flag("disable_conv_cp", True))

    @property
    def constraint(self) -> float:
        value = self.number("constraint")
        return value if value is not None else (self.number("constrain") or 0.0)

    def network_kwargs(self, network_dim: Optional[int], network_alpha: Optional[float],
                       neuron_dropout: Optional[float]) -> dict:
        """Keyword arguments of lycoris' ``LycorisNetworkKohya``, with the defaults of lycoris'
        ``create_network`` (conv_dim/conv_alpha fall back to the linear ones, also when 0)."""
        dim = network_dim or 4
        alpha = network_alpha if network_alpha is not None else 1.0
        dropout = self.number("dropout")
        return dict(
            lora_dim=dim,
            conv_lora_dim=self.number("conv_dim") or dim,
            alpha=alpha,
            conv_alpha=self.number("conv_alpha") or alpha,
            dropout=dropout if dropout is not None else (neuron_dropout or 0.0),
            rank_dropout=self.number("rank_dropout", 0.0),
            module_dropout=self.number("module_dropout", 0.0),
            use_tucker=self.use_tucker,
            use_scalar=self.flag("use_scalar"),
            network_module=self.algo,
            train_norm=self.flag("train_norm"),
            decompose_both=self.flag("decompose_both"),
            factor=self.number("factor", -1),
            block_size=self.number("block_size") or 4,
            constraint=self.constraint,
            rescaled=self.flag("rescaled"),
            weight_decompose=self.flag("dora_wd"),
            wd_on_out=self.flag("wd_on_output", True),
            full_matrix=self.flag("full_matrix"),
            bypass_mode=self.flag("bypass_mode"),
            rs_lora=self.flag("rs_lora"),
            unbalanced_factorization=self.flag("unbalanced_factorization"),
            rank_dropout_scale=self.flag("rank_dropout_scale"),
            train_on_input=self.flag("train_on_input"),
        )


def read_options(network_args: Mapping[str, str]) -> LycorisOptions:
    """Check every ``--network_args`` key and value (UserError, one line); no model needed."""
    network_base.check_known_args(network_args, KNOWN_NETWORK_ARGS, NETWORK_MODULE)
    algo = (network_args.get("algo") or "lora").strip("\"'").lower()
    if algo not in ALGOS:
        raise UserError(f"--network_args algo={network_args['algo']}: not a LyCORIS algo of {NETWORK_MODULE} "
                        f"(valid: {', '.join(ALGOS)})")
    options = LycorisOptions(algo, network_args.get("preset") or "full", network_args)
    for key in NUMBER_ARGS:
        options.number(key)
    for key in BOOL_ARGS:
        options.flag(key)
    if algo == "lokr":
        check_lokr_factor(network_args)
    network_base.loraplus_ratios(network_args)
    preset_config(options.preset)
    if algo == "full" and options.flag("bypass_mode"):
        raise UserError("--network_args bypass_mode=True: algo=full has no bypass mode (lycoris); use "
                        "bypass_mode=False")
    return options


def validate_network_args(network_args: Mapping[str, str]) -> None:
    """Refuse unknown or malformed ``--network_args`` before any model is loaded."""
    read_options(network_args)


def check_float8_base(network_args: Mapping[str, str], flag: str) -> None:
    """Outside bypass mode LyCORIS reads the layer's raw weight (glora builds its change from it, the
    others add their change to it): it would find the scaled float8 values (``library.fp8_base``)."""
    options = read_options(network_args)
    if not options.flag("bypass_mode"):
        hint = "train without it (algo=full has no bypass mode)" if options.algo == "full" else \
            "add --network_args bypass_mode=True"
        raise UserError(f"{flag} with --network_module {NETWORK_MODULE} algo={options.algo}: LyCORIS would "
                        f"compute with the raw scaled float8 weights; {hint}")


def preset_config(preset: str) -> dict:
    """lycoris' preset: a built-in name or a preset ``.toml`` file; UserError naming both kinds."""
    if preset in PRESET:
        return PRESET[preset]
    if not os.path.isfile(preset):
        raise UserError(f"--network_args preset={preset}: not a LyCORIS preset ({', '.join(PRESET)}) "
                        f"nor a preset .toml file")
    with _quiet_stdout():  # read_preset prints its error and returns None
        config = read_preset(preset)
    if config is None:
        raise UserError(f"--network_args preset={preset}: not a valid LyCORIS preset file (see lycoris' "
                        f"docs/Preset.md)")
    return config


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        yield


# --------------------------------------------------------------------------- the kohya view
_VIEW_CLASSES: dict[str, type] = {}


def _view_class(name: str) -> type:
    """An empty ``torch.nn.Module`` subclass called ``name``: lycoris matches presets by class name."""
    if name not in _VIEW_CLASSES:
        _VIEW_CLASSES[name] = type(name, (torch.nn.Module,), {"__module__": __name__})
    return _VIEW_CLASSES[name]


# A path of the kohya view and the class name kohya's model has there (None: a plain container).
KohyaPlace = Optional[tuple[str, Optional[str]]]


def kohya_view(root: torch.nn.Module, place: Callable[[str, torch.nn.Module], KohyaPlace]) -> torch.nn.Module:
    """A module tree with kohya's paths and class names whose leaves are ``root``'s own layers.

    ``place(path, module)`` gives, for a module of ``root``, its path in kohya's model and, for a
    container, kohya's class name there; None leaves it out (a diffusers container kohya does not
    have; its layers still appear under their own paths). Containers kohya has that ``root`` does
    not (``input_blocks.4``) are plain. Nothing of ``root`` is changed; the view only holds references.
    """
    view = _view_class("Module")()
    nodes: dict[str, torch.nn.Module] = {"": view}

    def node(path: str, class_name: Optional[str] = None) -> torch.nn.Module:
        if path not in nodes:
            parent, _, name = path.rpartition(".")
            nodes[path] = _view_class(class_name or "Module")()
            node(parent).add_module(name, nodes[path])
        return nodes[path]

    for path, module in root.named_modules():
        placed = place(path, module) if path else None
        if placed is None:
            continue
        kohya_path, class_name = placed
        if next(module.children(), None) is None:  # a layer: the real module goes into the view
            parent, _, name = kohya_path.rpartition(".")
            node(parent).add_module(name, module)
            nodes[kohya_path] = module
        else:
            node(kohya_path, class_name)
    return view


def _kohya_class(module: torch.nn.Module) -> Optional[str]:
    """kohya's class name for a UNet container (None: shown as a plain container)."""
    name = module.__class__.__name__
    if name == "Attention":  # kohya's UNets (library/original_unet.py, sdxl_original_unet.py) call it CrossAttention
        return "CrossAttention"
    if name == "TimestepEmbedding":
        # lycoris 4's presets target this class (for another model) *and* its layers by name
        # (time_embedding.linear_1): on kohya's SD1.x UNet that builds each module twice and
        # lycoris stops ("duplicated lora name"). Shown plain, the names select the same layers
        # once, as lycoris 3 (the GUI's version) does; SDXL's time_embed is a plain Sequential anyway.
        return None
    return name


def unet_view(unet: torch.nn.Module, original_layout: bool) -> torch.nn.Module:
    """The UNet as kohya's trainer hands it to lycoris: SDXL (``original_layout``) in the SGM layout
    of kohya's ``SdxlUNet2DConditionModel``, SD1.x/2.x with the diffusers paths of its ``UNet2DConditionModel``."""
    if not original_layout:
        return kohya_view(unet, lambda path, module: (path, _kohya_class(module)))
    table = checkpoint_keys.unet_block_table(unet.config)

    def place(path: str, module: torch.nn.Module) -> KohyaPlace:
        try:
            return checkpoint_keys.translate(path, table), _kohya_class(module)
        except KeyError:
            pass
        if module.__class__.__name__ in ("Downsample2D", "Upsample2D"):
            # kohya's sampler classes hold only the conv (Downsample2D's is called `op`).
            conv_path = checkpoint_keys.translate(f"{path}.conv", table)
            return conv_path.rpartition(".")[0], module.__class__.__name__
        return None  # down_blocks.N, time_embedding, ...: no such container in the SGM layout

    return kohya_view(unet, place)


def text_encoder_view(text_encoder: torch.nn.Module) -> torch.nn.Module:
    """A CLIP text encoder with the ``text_model.`` level transformers 5 dropped from CLIPTextModel."""
    if hasattr(text_encoder, "text_model"):
        return text_encoder
    return kohya_view(text_encoder, lambda path, module: (f"text_model.{path}", module.__class__.__name__))


def _text_encoder_argument(text_encoders: list[torch.nn.Module]):
    """What kohya passes lycoris: one model for SD1.x/2.x (named ``lora_te_``), a list for SDXL
    (``lora_te1_``/``lora_te2_``)."""
    views = [text_encoder_view(encoder) for encoder in text_encoders]
    return views[0] if len(views) == 1 else views


# --------------------------------------------------------------------------- the network
class LycorisNetwork(AdapterNetwork):
    """lycoris modules in the shared network container; the hooks go to lycoris' own methods.

    Files hold lycoris' state dict (``custom_state_dict``: the scalar folded into the up weight,
    DyLoRA's blocks joined, Full's difference to the base weight). Training states hold the
    modules' own tensors (``training_state_dict``), so a resumed run continues bit for bit.
    """

    _max_norm_notice_given = False  # the notice of modules without max-norm is printed once

    # -- hooks of networks.network_base ------------------------------------------------
    def wrapped_module(self, lora: torch.nn.Module) -> torch.nn.Module:
        return lora.org_module[0]

    def loraplus_parameters(self, lora: torch.nn.Module) -> list[torch.nn.Parameter]:
        # lycoris' rule (LycorisNetworkKohya.prepare_optimizer_params): parameters named lora_up.
        return [param for name, param in lora.named_parameters() if "lora_up" in name]

    def frozen_weight(self, lora: torch.nn.Module, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Full's ``apply_to`` takes the weight off the layer and keeps the only copy (on the CPU)."""
        if isinstance(lora, FullModule):
            weight = lora.org_weight
            return weight.to(lora.weight.device, dtype or network_base.merge_dtype(weight.dtype))
        return super().frozen_weight(lora, dtype)

    def merged_parameters(self, lora: torch.nn.Module, multiplier: float) -> dict[str, torch.Tensor]:
        """The wrapped layer's weight (and Full's bias) with the module merged in, rank dropout off:
        what the module's forward computes, in ``merge_dtype``. lycoris' ``get_merged_weight`` gives
        that, except for LoHa and LoKr (it applies alpha/dim twice; their forward once) and DyLoRA (a
        random rank). lycoris reads the base weight from the layer as stored (fp16 while training in
        fp16: GLoRA's matmul with its float32 factors fails), so it computes on a stand-in layer
        holding the base weight in ``merge_dtype`` (float8 dequantized)."""
        weight = self.frozen_weight(lora)
        training = lora.training
        lora.eval()
        try:
            with torch.no_grad(), _base_weight_as(lora, weight):
                merged_weight, bias = _merged_weight(lora, multiplier, weight)
        finally:
            lora.train(training)
        merged = {"weight": merged_weight.to(weight.dtype)}
        if bias is not None:
            merged["bias"] = bias.to(weight.dtype)
        return merged

    # -- max-norm: lycoris' apply_max_norm ----------------------------------------------
    def _max_norm_modules(self) -> list[torch.nn.Module]:
        """The modules whose class has its own ``apply_max_norm`` (LoCon, LoHa, LoKr, Diag-OFT, BOFT).
        lycoris' network skips the others (and its norm modules, train_norm), and so do we: kohya +
        lycoris trains a GUI preset such as iA3 with --scale_weight_norms, scaling nothing."""
        return [lora for lora in self.all_loras() if not isinstance(lora, NormModule)
                and type(lora).apply_max_norm is not LycorisBaseModule.apply_max_norm]

    def supports_max_norm(self) -> bool:
        """Always: as in lycoris, modules without max-norm are skipped (see ``_max_norm_modules``)."""
        return True

    @torch.no_grad()
    def apply_max_norm_regularization(self, max_norm: float) -> MaxNormStats:
        """lycoris' per-module ``apply_max_norm`` (the scalar or the OFT blocks scaled down to ``max_norm``)."""
        device = next(self.parameters()).device
        scaled, norms = [], []
        if not self._max_norm_notice_given and len(self._max_norm_modules()) < len(self.all_loras()):
            self._max_norm_notice_given = True
            print(f"--scale_weight_norms: {len(self.all_loras()) - len(self._max_norm_modules())} modules of "
                  f"{self.network_module} have no max-norm in lycoris and are left as they are")
        for lora in self._max_norm_modules():
            was_scaled, norm = lora.apply_max_norm(max_norm, device)
            scaled.append(torch.as_tensor(was_scaled, device=device))
            norms.append(torch.as_tensor(norm, device=device, dtype=torch.float32).reshape(()))
        if not norms:
            zero = torch.zeros((), device=device)
            return MaxNormStats(zero.long(), zero, zero)
        norms_tensor = torch.stack(norms)
        return MaxNormStats(torch.stack(scaled).sum(), norms_tensor.mean(), norms_tensor.max())

    # -- files and states -----------------------------------------------------------------
    def lora_state_dict(self, dtype: Optional[torch.dtype] = None) -> dict[str, torch.Tensor]:
        """lycoris' file state dict; with ``dtype`` every tensor is cast, as lycoris' ``save_weights``
        casts them (IA3's ``on_input`` too). A Full module not applied yet holds the difference
        itself (lycoris would subtract the base weight from it once more)."""
        state = self.state_dict()
        for lora in self.all_loras():
            if isinstance(lora, FullModule) and lora.is_diff:
                state[f"{lora.lora_name}.diff"] = lora.weight
                if lora.bias is not None:
                    state[f"{lora.lora_name}.diff_b"] = lora.bias
        for key, value in list(state.items()):
            value = value.detach().to("cpu")
            state[key] = (value.to(dtype) if dtype is not None else value).contiguous()
        return state

    def _fit_layouts(self, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``weights`` with tensors that differ from this network's only by trailing size-1 dims
        reshaped to its shape (a DyLoRA file's 2-D conv ``lora_up`` read into a LoCon module)."""
        own = self.state_dict()
        fitted = dict(weights)
        for key, value in weights.items():
            if key in own and own[key].dim() > value.dim() and \
                    tuple(own[key].shape) == (*value.shape, *(1,) * (own[key].dim() - value.dim())):
                fitted[key] = value.reshape(own[key].shape)
        return fitted

    def load_weights_from(self, weights: Mapping[str, torch.Tensor], source: str) -> None:
        super().load_weights_from(self._fit_layouts(weights), source)

    def load_state_dict(self, state_dict: Mapping[str, torch.Tensor], strict: bool = True,
                        assign: bool = False) -> None:
        """Load a file's state dict (``lora_state_dict`` keys; with ``strict`` exactly those, else a
        RuntimeError). DyLoRA's joined ``lora_up``/``lora_down`` are split into its blocks (lycoris'
        own loader ignores them) and Full's ``diff`` is added to the base weight whether or not the
        module is applied yet (lycoris' adds it to whatever the weight holds). ``assign`` is ignored."""
        state_dict = self._fit_layouts(state_dict)
        own = set(self.state_dict())
        if strict and set(state_dict) != own:
            missing, unexpected = sorted(own - set(state_dict)), sorted(set(state_dict) - own)
            raise RuntimeError(f"state dict does not fit the network: missing {missing[:3]}, "
                               f"unexpected {unexpected[:3]}")
        by_module = network_base.group_by_module(state_dict)
        with torch.no_grad():
            for lora in self.all_loras():
                tensors = by_module.get(lora.lora_name, {})
                if isinstance(lora, DyLoraModule):
                    _load_dylora(lora, tensors)
                elif isinstance(lora, FullModule):
                    _load_full(lora, tensors)
                else:
                    lora.load_state_dict(tensors, strict=strict)

    def training_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer as the modules hold them (lycoris' non-persistent ``scalar`` too,
        which its max-norm scales): what a training state needs to continue exactly."""
        tensors = dict(self.named_parameters())
        tensors.update(self.named_buffers())
        return {key: value.detach().to("cpu").clone().contiguous() for key, value in tensors.items()}

    def load_training_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        own = dict(self.named_parameters())
        own.update(self.named_buffers())
        if set(state) != set(own):
            differing = sorted(set(own) ^ set(state))
            raise RuntimeError(f"the state does not fit this network ({differing[0]} is in one of them only)")
        with torch.no_grad():
            for key, value in state.items():
                own[key].copy_(value)


@contextlib.contextmanager
def _base_weight_as(lora: torch.nn.Module, weight: torch.Tensor) -> Iterator[None]:
    """lycoris' ``lora.org_weight`` (the layer's weight) reads ``weight`` within: the module points at
    a stand-in layer meanwhile (the model is not touched). Full keeps its own copy and needs none."""
    if isinstance(lora, FullModule):
        yield
        return
    layer = lora.org_module[0]
    bias = getattr(layer, "bias", None)
    stand_in = SimpleNamespace(weight=weight, bias=None if bias is None else bias.detach().to(weight.dtype))
    lora.org_module = [stand_in]
    try:
        yield
    finally:
        lora.org_module = [layer]


def _merged_weight(lora: torch.nn.Module, multiplier: float, weight: torch.Tensor
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight, bias or None) of the layer with ``lora`` merged at ``multiplier``."""
    if isinstance(lora, (LohaModule, LokrModule)):
        # Their forward (_rebuild_forward): W + get_weight * scalar * multiplier, or DoRA's decomposition.
        diff = lora.get_weight(lora.shape).to(weight.dtype) * lora.scalar
        if lora.wd:
            return lora.apply_weight_decompose(weight + diff, multiplier), None
        return weight + diff * multiplier, None
    if isinstance(lora, DyLoraModule):
        # As every reader applies a DyLoRA file: all blocks, as a LoRA with scale alpha / rank.
        up = torch.cat(list(lora.up_list), dim=1)
        down = torch.cat(list(lora.down_list))
        diff = (up @ down).reshape(weight.shape) * (float(lora.alpha) / lora.lora_dim)
        return weight + diff.to(weight.dtype) * multiplier, None
    return lora.get_merged_weight(multiplier=multiplier, shape=weight.shape, device=weight.device)


def _load_dylora(lora: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """DyLoRA's file holds its blocks joined: ``lora_up`` (out, rank), ``lora_down`` (rank, in, ...)."""
    block = lora.block_size
    up = tensors["lora_up.weight"].reshape(tensors["lora_up.weight"].shape[0], -1)
    down = tensors["lora_down.weight"].reshape(tensors["lora_down.weight"].shape[0], -1)
    for index, (up_block, down_block) in enumerate(zip(lora.up_list, lora.down_list)):
        up_block.copy_(up[:, index * block:(index + 1) * block])
        down_block.copy_(down[index * block:(index + 1) * block])
    lora.alpha.copy_(tensors["alpha"])


def _load_full(lora: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Full's file holds ``diff`` (and ``diff_b``); before ``apply_to`` its weight is the difference,
    after it the whole weight (lycoris' own loader adds to whatever the weight holds)."""
    base_weight = 0 if lora.is_diff else lora._org_weight[0].to(lora.weight.device)
    lora.weight.copy_(tensors["diff"].to(lora.weight) + base_weight)
    if "diff_b" in tensors:
        base_bias = 0 if lora.is_diff else lora.org_bias[0].to(lora.bias.device)
        lora.bias.copy_(tensors["diff_b"].to(lora.bias) + base_bias)


# --------------------------------------------------------------------------- building
@contextlib.contextmanager
def _lycoris_log_level(level: int) -> Iterator[None]:
    previous = lycoris_logger.level
    lycoris_logger.setLevel(level)
    try:
        yield
    finally:
        lycoris_logger.setLevel(previous)


def _network_name(algo: str) -> str:
    return f"{NETWORK_MODULE} algo={algo}"


def create_network(
    multiplier: float,
    network_dim: Optional[int],
    network_alpha: Optional[float],
    vae: Optional[torch.nn.Module],
    text_encoders: list[torch.nn.Module],
    unet: torch.nn.Module,
    neuron_dropout: Optional[float] = None,
    unet_module_names: Optional[Mapping[str, str]] = None,
    **network_args: str,
) -> LycorisNetwork:
    """kohya's ``create_network``: lycoris builds its modules on the kohya view of the models.

    ``unet_module_names`` given (SDXL) means the UNet is named in the original layout.
    """
    options = read_options(network_args)
    kwargs = options.network_kwargs(network_dim, network_alpha, neuron_dropout)
    if options.algo == "dylora":
        for setting, dim in ((f"--network_dim {kwargs['lora_dim']}", kwargs["lora_dim"]),
                             (f"--network_args conv_dim={kwargs['conv_lora_dim']}", kwargs["conv_lora_dim"])):
            if dim % kwargs["block_size"]:
                raise UserError(f"{setting}: algo=dylora needs a multiple of block_size={kwargs['block_size']}")
    text_encoder = _text_encoder_argument(text_encoders)
    unet_kohya = unet_view(unet, original_layout=unet_module_names is not None)
    # The preset is class state in lycoris (its create_network sets it the same way).
    LycorisNetworkKohya.apply_preset(preset_config(options.preset))
    try:
        with _boft_skipping_unsplittable_convs() as skipped_convs:
            lycoris_network = LycorisNetworkKohya(text_encoder, unet_kohya, multiplier=multiplier,
                                                  warn_on_unmatched=False, **kwargs)
    except (ValueError, AssertionError) as error:  # lycoris refusing a layer for these arguments
        raise UserError(_construction_error(options, error, text_encoders, unet)) from None
    loras = lycoris_network.text_encoder_loras + lycoris_network.unet_loras
    if skipped_convs:
        notice = _skipped_convs_notice(skipped_convs)
        if not loras:
            raise UserError(f"{_network_name('boft')}: no layer to train: {notice}")
        print(f"{_network_name('boft')}: {notice}")
    if not loras:
        raise UserError(f"--network_args preset={options.preset}: LyCORIS found no module to train in this model")
    return LycorisNetwork(lycoris_network.text_encoder_loras, lycoris_network.unet_loras, multiplier,
                          _network_name(options.algo))


_BOFT_CANNOT_SPLIT = "It is impossible to decompose"  # the start of lycoris' refusal (modules/boft.py)
_CONV_LAYERS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d)


@contextlib.contextmanager
def _boft_skipping_unsplittable_convs() -> Iterator[list[tuple[torch.nn.Module, int]]]:
    """While active, a conv layer BOFT cannot split at the dim lycoris gives it gets no module:
    lycoris' builder looks its algos up in ``network_module_dict`` and leaves a layer out when that
    gives None, as it does for the layers an algo cannot take. Yields the list of (layer, dim)
    skipped. lycoris itself stops the whole network on the first such conv: with the GUI's default
    ``conv_dim=1`` no BOFT network could be built at all. Linear layers still raise."""
    boft = network_module_dict["boft"]
    skipped: list[tuple[torch.nn.Module, int]] = []

    def build(lora_name: str, org_module: torch.nn.Module, multiplier: float, lora_dim: int, *args, **kwargs):
        try:
            return boft(lora_name, org_module, multiplier, lora_dim, *args, **kwargs)
        except ValueError as error:
            if not isinstance(org_module, _CONV_LAYERS) or not first_line(error).startswith(_BOFT_CANNOT_SPLIT):
                raise
            skipped.append((org_module, int(lora_dim)))
            return None

    network_module_dict["boft"] = build
    try:
        yield skipped
    finally:
        network_module_dict["boft"] = boft


def _skipped_convs_notice(skipped: list[tuple[torch.nn.Module, int]]) -> str:
    """What was skipped and why, in one line, with the conv_dim that would split them all."""
    widths = sorted({layer.out_channels for layer, _ in skipped})
    dims = ", ".join(str(dim) for dim in sorted({dim for _, dim in skipped}))
    notice = (f"{len(skipped)} conv layers skipped: BOFT cannot split their {'/'.join(map(str, widths))} channels "
              f"into butterfly blocks with dim {dims} (an even block size up to the dim, the width divided by it a "
              f"power of two)")
    if any(width % 2 for width in widths):
        return notice + "; an odd width splits with no dim"
    return notice + f"; --network_args conv_dim >= {max(map(smallest_boft_dim, widths))} splits them"


def _construction_error(options: LycorisOptions, error: Exception, text_encoders: list[torch.nn.Module],
                        unet: torch.nn.Module) -> str:
    """The one line for a lycoris refusal; BOFT's names the network_dim that splits every linear
    layer (conv layers it cannot split are skipped, see ``_boft_skipping_unsplittable_convs``)."""
    message = first_line(error)
    if options.algo != "boft" or not message.startswith(_BOFT_CANNOT_SPLIT):
        return f"{_network_name(options.algo)}: {message}"
    match = re.search(r"decompose (\d+) with factor (-?\d+)", message)
    layer = f"a {match.group(1)}-wide layer with dim {match.group(2)}" if match else "a layer"
    widths = {layer.out_features for model in [*text_encoders, unet] for layer in model.modules()
              if isinstance(layer, torch.nn.Linear)} | ({int(match.group(1))} if match else set())
    if match and int(match.group(1)) % 2:
        return f"{_network_name('boft')}: BOFT cannot split {layer} into butterfly blocks at any dim; use another algo"
    valid = max(smallest_boft_dim(width) for width in widths if width % 2 == 0)
    return (f"{_network_name('boft')}: BOFT cannot split {layer} into butterfly blocks (an even block size up to "
            f"the dim, the width divided by it a power of two); for this model use --network_dim >= {valid}")


def smallest_boft_dim(width: int) -> int:
    """The smallest dim with which BOFT splits an even ``width``: lycoris' ``power2factorization``
    takes the even block sizes b <= dim with width / b a power of two; the smallest such b is twice
    the odd part of the width (768 = 3 * 256: 6), and every larger dim finds it too."""
    odd_part = width >> ((width & -width).bit_length() - 1)
    return 2 * odd_part


def create_network_from_weights(
    multiplier: float,
    weights: Mapping[str, torch.Tensor],
    text_encoders: list[torch.nn.Module],
    unet: torch.nn.Module,
    unet_module_names: Optional[Mapping[str, str]] = None,
    **network_args: str,
) -> LycorisNetwork:
    """A network shaped like a lycoris file (``--dim_from_weights``, merging): each module's algo and
    shapes come from its tensors (:func:`module_from_tensors`), on the kohya view. ``network_args``
    do not apply (as in lycoris). The caller loads ``weights`` into it.

    Keys naming no layer of the models are a UserError.
    """
    views = {network_base.PREFIX_UNET: unet_view(unet, original_layout=unet_module_names is not None)}
    for prefix, encoder in zip(network_base.text_encoder_prefixes(len(text_encoders)), text_encoders):
        views[prefix] = text_encoder_view(encoder)
    layers = {f"{prefix}_{path}".replace(".", "_"): module
              for prefix, view in views.items() for path, module in view.named_modules() if path}
    text_encoder_loras, unet_loras = [], []
    with _lycoris_log_level(logging.WARNING):
        for lora_name, tensors in network_base.group_by_module(weights).items():
            if lora_name not in layers:
                raise UserError(f"LoRA file: {lora_name} names no layer of this model; the file is for another "
                                f"model (or not a {NETWORK_MODULE} file)")
            module = module_from_tensors(lora_name, layers[lora_name], tensors)
            module.multiplier = multiplier
            (unet_loras if lora_name.startswith(network_base.PREFIX_UNET) else text_encoder_loras).append(module)
    algos = sorted({type(module).__name__ for module in text_encoder_loras + unet_loras})
    return LycorisNetwork(text_encoder_loras, unet_loras, multiplier, f"{NETWORK_MODULE} ({', '.join(algos)})")


def module_from_tensors(lora_name: str, layer: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """The lycoris module a file's tensors of one layer describe, shaped like them (the caller loads them).

    lycoris' reader (``get_module``/``make_module``) picks the class and its arguments, except where
    it fails: IA3 (it passes ``on_input`` along and stops), LoKr (it guesses the factorization from
    flattened conv shapes and builds the wrong ones) and DyLoRA's conv files (``lora_up`` written
    2-D, read back as a LoCon whose conv ``lora_up`` is 4-D).
    """
    source = f"LoRA file: {lora_name}"
    tensors = dict(tensors)
    up, down = tensors.get("lora_up.weight"), tensors.get("lora_down.weight")
    if up is not None and down is not None and up.dim() == 2 and down.dim() > 2:
        tensors["lora_up.weight"] = up.reshape(*up.shape, *(1,) * (down.dim() - 2))
    module_class, params = get_module({f"{lora_name}.{name}": value for name, value in tensors.items()}, lora_name)
    if module_class is None:
        raise UserError(f"{source} holds {', '.join(sorted(tensors))}: no LyCORIS module type has these tensors")
    if module_class is IA3Module:
        module = IA3Module(lora_name, layer, train_on_input=bool(tensors["on_input"].item()))
    elif module_class is LokrModule:
        module = _lokr_from_tensors(lora_name, layer, tensors)
    else:
        module = make_module(module_class, params, lora_name, layer)
        if module is None:
            raise UserError(f"{source} is a {module_class.__name__}, which lycoris cannot read back")
    shapes = {name: tuple(value.shape) for name, value in module.state_dict().items()}
    wanted = {name: tuple(value.shape) for name, value in tensors.items()}
    if shapes != wanted:
        raise UserError(f"{source}: its tensors {wanted} do not fit the model's layer (a {module_class.__name__} "
                        f"there has {shapes}); the file is for another model")
    if "alpha" in tensors and isinstance(getattr(module, "alpha", None), torch.Tensor):
        # The file's alpha is what is saved back; the scale was set from it (LoKr with both factors
        # full stores alpha = dim and uses scale 1, which lycoris' reader rebuilds as alpha 1).
        with torch.no_grad():
            module.alpha.copy_(tensors["alpha"])
    return module


def _lokr_from_tensors(lora_name: str, layer: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A LoKr module whose Kronecker factors have the file's shapes: the factor (and its unbalanced
    swap) that splits the layer's out/in sizes into them, among -1 and the factor sizes themselves."""
    weight_shape = layer.weight.shape
    out_dim, in_dim = weight_shape[0], weight_shape[1]
    w1_a, w2_a, t2 = tensors.get("lokr_w1_a"), tensors.get("lokr_w2_a"), tensors.get("lokr_t2")
    w1_rows, w1_cols = ((w1_a.shape[0], tensors["lokr_w1_b"].shape[1]) if w1_a is not None
                        else tuple(tensors["lokr_w1"].shape))
    out_parts, in_parts = (w1_rows, out_dim // w1_rows), (w1_cols, in_dim // w1_cols)
    if w1_a is not None:
        rank = w1_a.shape[1]
    elif w2_a is not None:
        rank = w2_a.shape[0] if t2 is not None else w2_a.shape[1]
    else:
        rank = 1  # both factors full: lycoris' full-matrix mode (scale 1)
    for factor in dict.fromkeys((-1, *out_parts, *in_parts)):
        balanced = factorization(out_dim, factor)
        for unbalanced in (False, True):
            if (balanced[::-1] if unbalanced else balanced) == out_parts and factorization(in_dim, factor) == in_parts:
                alpha = tensors.get("alpha")
                return LokrModule(lora_name, layer, 1.0, rank, float(alpha) if alpha is not None else None,
                                  use_tucker=t2 is not None, decompose_both=w1_a is not None, factor=factor,
                                  weight_decompose="dora_scale" in tensors, full_matrix=w1_a is None and w2_a is None,
                                  unbalanced_factorization=unbalanced)
    raise UserError(f"LoRA file: {lora_name}: no LoKr factorization of the {out_dim}x{in_dim} layer gives its "
                    f"factors {out_parts} x {in_parts}")
