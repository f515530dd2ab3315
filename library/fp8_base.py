"""kohya's ``--fp8_base`` / ``--fp8_base_unet``: frozen base weights stored in float8, computed in the autocast dtype.

What is stored as ``torch.float8_e4m3fn``: the weight of every Linear and Conv2d layer of the
UNet and, with ``--fp8_base`` (not ``--fp8_base_unet``, which wins when both are given, as in
kohya), of the text encoders: over 99% of their parameters, in a quarter of their float32 size.
Biases, norm layers and embeddings stay in the compute dtype: each of their values reaches the
output as stored instead of being summed over in a matmul, so float8's 3-bit mantissa would
shift outputs directly (diffusers' layerwise casting skips norms by default, kohya keeps the text
encoders' embeddings). The VAE is never stored in float8 (kohya). The LoRA is not touched: its
weights stay float32 (or fp16/bf16 with ``--full_fp16``/``--full_bf16``).

Each stored weight has a per-tensor float32 scale (``amax / 448``, float8's largest value; 1
for an all-zero weight): float8 holds ``weight / scale``, so the largest value lands at the top
of float8's range and every value keeps float8's 3-bit mantissa unless it is over 2^-9 times
smaller than the largest (kohya casts plainly; then weights below 2^-6, common in SD layers,
fall into float8's subnormal range and keep 1-2 bits). The scale is a Python float on the layer
(``float8_scale``), so nothing casts or moves it. Code that reads a frozen weight's value (OFT's
rotation, merging) reads it through :func:`frozen_weight`.

The text encoders stay in the compute dtype when their outputs are cached
(``--cache_text_encoder_outputs``): they then run before training only, and the cache is the
same as without fp8 (kohya moves them to the CPU after caching and never casts them).

Each stored layer's ``forward`` is replaced, before the network wraps the layer, by an autograd
function that upcasts the weight to the compute dtype for that call only. It saves the float8
weight for backward, not the upcast copy, and upcasts again there: no upcast copy outlives a
layer call, with or without gradient checkpointing. (kohya leaves the upcast to autocast, whose
copies are kept for backward; without checkpointing that holds a compute-dtype copy of every
weight until the backward pass.) On the CPU the upcast rearranges
the float8 bits with integer operations (see ``_dequantize``): torch's float8 conversion there
is scalar code that made a full-size SDXL step 6x slower than without fp8.

diffusers' ``apply_layerwise_casting`` is not used: its hook casts the layer's parameters in
place (``module.to(compute)`` before forward, back to storage after). Autograd may have saved the
parameter itself (a convolution saves its weight), so the backward then finds float8 data:
fp16 training through a Conv2d fails with "expected scalar type Half but found Float8_e4m3fn".
"""
from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F

from library.errors import UserError

if TYPE_CHECKING:
    from library.model_loading import StoredAs
    from library.models import StableDiffusionModels

FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = torch.finfo(FLOAT8).max  # 448
_QUANTIZE_CHUNK = 2**20  # elements converted at a time (a 4 MiB float32 temporary)
TEXT_ENCODER_COMPONENTS = ("text_encoder", "text_encoder_2")  # model_loading's component names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register kohya's ``--fp8_base`` and ``--fp8_base_unet``."""
    group = parser.add_argument_group("fp8 base weights")
    group.add_argument("--fp8_base", action="store_true",
                       help="store the frozen UNet's and text encoders' Linear/Conv2d weights as float8 (e4m3fn), "
                            "upcast layer by layer to the --mixed_precision dtype (needs fp16 or bf16): half the "
                            "memory of fp16 weights, slightly less precise outputs. Biases, norms, embeddings, the "
                            "VAE and the LoRA keep their dtype, and so do text encoders whose outputs are cached "
                            "(--cache_text_encoder_outputs). Default: off")
    group.add_argument("--fp8_base_unet", action="store_true",
                       help="like --fp8_base but for the UNet only (the text encoders stay fp16/bf16). Default: off")


def validate_arguments(args: argparse.Namespace) -> None:
    """float8 weights are computed in the autocast dtype, so there must be one. (Whether the network
    type can compute with float8 weights is its own check: ``networks.registry.validate``.)"""
    flag = float8_flag(args)
    if flag is not None and args.mixed_precision not in ("fp16", "bf16"):
        raise UserError(f"{flag} needs --mixed_precision fp16 or bf16 (got {args.mixed_precision}): "
                        f"the float8 weights are computed in that dtype")


def float8_flag(args: argparse.Namespace) -> Optional[str]:
    """``--fp8_base`` or ``--fp8_base_unet`` when one is given (the first), else None."""
    return next((f"--{flag}" for flag in ("fp8_base", "fp8_base_unet") if getattr(args, flag)), None)


def float8_components(args: argparse.Namespace) -> frozenset[str]:
    """The model components (``unet``, ``text_encoder``, ``text_encoder_2``) whose layers are stored in float8."""
    if not (args.fp8_base or args.fp8_base_unet):
        return frozenset()
    if args.fp8_base_unet or getattr(args, "cache_text_encoder_outputs", False):
        return frozenset({"unet"})
    return frozenset({"unet", *TEXT_ENCODER_COMPONENTS})


def is_stored_in_float8(module: torch.nn.Module, attribute: str) -> bool:
    """Whether ``module.<attribute>`` is a weight stored in float8 when its model is (see
    :func:`float8_components`). Only plain Linear and Conv2d layers: a subclass may use its weight
    outside ``forward`` (``nn.MultiheadAttention`` reads its ``out_proj`` weight directly), and
    convolutions with a padding mode or a string padding (none in SD models) keep their dtype."""
    if attribute != "weight":
        return False
    if type(module) is torch.nn.Linear:
        return True
    return type(module) is torch.nn.Conv2d and module.padding_mode == "zeros" and not isinstance(module.padding, str)


def stored_as_rule(args: argparse.Namespace) -> Optional[StoredAs]:
    """``model_loading.load_models``' ``stored_as``: scaled float8 weights straight from the file, so
    their float32 copy never exists. ``None`` without fp8, and with ``--base_weights``: those LoRAs
    are merged into float32 weights first (kohya's order), then :func:`store_frozen_weights` casts."""
    components = float8_components(args)
    if not components or args.base_weights:
        return None

    def rule(component: str, module: torch.nn.Module, attribute: str
             ) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
        if component in components and is_stored_in_float8(module, attribute):
            return lambda value: _quantize(module, value)
        return None

    return rule


def store_frozen_weights(args: argparse.Namespace, models: StableDiffusionModels, compute_dtype: torch.dtype) -> None:
    """Apply ``--fp8_base``/``--fp8_base_unet`` to ``models`` (in place; nothing without them): see
    :func:`store_in_float8`. Call after ``--base_weights`` are merged and before the network is
    applied. Prints one line."""
    components = float8_components(args)
    if not components:
        return
    parts = {"unet": models.unet, **dict(zip(TEXT_ENCODER_COMPONENTS, models.text_encoders))}
    layers = {name: store_in_float8(model, compute_dtype) for name, model in parts.items() if name in components}
    stored_gib = sum(p.numel() for name in layers for p in parts[name].parameters() if p.dtype == FLOAT8) / 2**30
    text_layers = sum(count for name, count in layers.items() if name != "unet")
    text = f" and {text_layers} text encoder layers" if text_layers else ""
    flag = "--fp8_base_unet" if args.fp8_base_unet else "--fp8_base"
    print(f"{flag}: {layers['unet']} UNet layers{text} keep their weights in float8_e4m3fn ({stored_gib:.2f} GiB), "
          f"computed in {str(compute_dtype).removeprefix('torch.')}")


def store_in_float8(model: torch.nn.Module, compute_dtype: torch.dtype) -> int:
    """Store the weight of every Linear/Conv2d of ``model`` (see :func:`is_stored_in_float8`) as scaled
    float8, freeze the layer, and route its forward through an upcast to ``compute_dtype``; returns the
    number of layers. Weights already in float8 (loaded so) are not cast again. Must run before a
    network wraps the layers (the network's forward calls the layer's forward it found)."""
    count = 0
    for name, layer in model.named_modules():
        if not is_stored_in_float8(layer, "weight"):
            continue
        if "forward" in vars(layer):
            raise RuntimeError(f"{name}: forward already replaced (a network applied before float8 storage?)")
        layer.requires_grad_(False)
        if layer.weight.dtype != FLOAT8:
            layer.weight = torch.nn.Parameter(_quantize(layer, layer.weight.detach()), requires_grad=False)
        layer.forward = _upcasting_forward(layer, compute_dtype)
        count += 1
    return count


def frozen_weight(layer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The value of ``layer.weight`` in ``dtype``: a float8 weight times its scale, any other weight cast."""
    weight = layer.weight
    return _dequantize(weight, layer.float8_scale, dtype) if weight.dtype == FLOAT8 else weight.to(dtype)


def _quantize(layer: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (on its device) as float8 of ``weight / scale``; records the scale on ``layer``."""
    weight = weight.detach()
    # The infinity norm, not abs().amax(): no temporary copy (the loader's peak memory).
    amax = torch.linalg.vector_norm(weight, ord=math.inf, dtype=torch.float32)
    scale = float(amax / FLOAT8_MAX)  # a float32 value
    if not (0 < scale < math.inf):  # all zero (or non-finite: float8 cannot hold it either way)
        scale = 1.0
    layer.float8_scale = scale
    # The result first, then float32 temporaries of a fixed size: whole-tensor temporaries between
    # the kept float8 tensors fragment the heap (SDXL's load peak: +1.5 GiB, measured). Clamped:
    # float32 rounding may put the largest value a hair above 448, which float8 makes NaN.
    stored = torch.empty(weight.shape, dtype=FLOAT8, device=weight.device)
    source, target = weight.reshape(-1), stored.view(-1)
    for start in range(0, source.numel(), _QUANTIZE_CHUNK):
        part = slice(start, start + _QUANTIZE_CHUNK)
        target[part] = source[part].float().div_(scale).clamp_(-FLOAT8_MAX, FLOAT8_MAX)
    return stored


# dtype -> (left shift, mask, exponent offset) that turn float8_e4m3fn bits, sign-extended to int16,
# into the bits of the same value times 2**-offset in dtype: the 4 exponent and 3 mantissa bits
# move to the top of dtype's exponent and mantissa fields, the sign to bit 15 (the mask clears the
# sign extension's copies in between). Exponent bias 7 becomes 127 (bf16) or 15 (fp16), hence the
# offset; float8 subnormals land on dtype subnormals of the same offset. Every finite float8 value
# is exact (e4m3fn's NaN codes are never stored: _quantize clamps).
_FLOAT8_BITS = {torch.bfloat16: (4, -30721, 120), torch.float16: (7, -16512, 8)}  # masks 0x87FF, 0xBF80


def _dequantize(weight: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (float8) times ``scale`` in ``dtype``: one copy, scaled in place (float8 values are
    exact in fp16/bf16; the product is rounded once, in float32, as ``dtype``'s multiply does).

    On the CPU torch's float8 conversion is scalar code (~50x slower than a copy), so the bits are
    rearranged with three vectorised integer passes instead and the offset is folded into the
    scale: the same values, bit for bit."""
    bits = _FLOAT8_BITS.get(dtype) if weight.device.type == "cpu" else None
    if bits is None or not scale * 2.0 ** bits[2] < 2.0 ** 127:  # the folded factor must stay a float32
        return weight.to(dtype).mul_(scale)
    shift, mask, offset = bits
    upcast = weight.view(torch.int8).to(torch.int16)
    upcast <<= shift
    upcast &= mask
    return upcast.view(dtype).mul_(scale * 2.0 ** offset)


def move(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """``Module.to(device, dtype)`` except that float8 tensors keep their dtype (they are only moved).
    Also avoids diffusers' ``to`` override, which warns on every cast."""
    def convert(tensor: torch.Tensor) -> torch.Tensor:
        keep_dtype = tensor.dtype == FLOAT8 or not tensor.is_floating_point()
        return tensor.to(device) if keep_dtype else tensor.to(device, dtype)

    model._apply(convert)


def _upcasting_forward(layer: torch.nn.Module, compute_dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    # The parameters are looked up at each call: moving the model to a device may replace them.
    if isinstance(layer, torch.nn.Linear):
        return lambda x: _Float8Linear.apply(x, layer.weight, layer.float8_scale, layer.bias, compute_dtype)
    return lambda x: _Float8Conv2d.apply(x, layer.weight, layer.float8_scale, layer.bias, layer.stride, layer.padding,
                                         layer.dilation, layer.groups, compute_dtype)


def _cast(tensor: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return None if tensor is None else tensor.to(dtype)


class _Float8Linear(torch.autograd.Function):
    """``linear(x, weight * scale, bias)`` in ``compute_dtype`` with a frozen float8 weight; gradient for ``x`` only."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias, compute_dtype):
        ctx.save_for_backward(weight)
        ctx.scale, ctx.compute_dtype, ctx.input_dtype = scale, compute_dtype, x.dtype
        return F.linear(x.to(compute_dtype), _dequantize(weight, scale, compute_dtype), _cast(bias, compute_dtype))

    @staticmethod
    def backward(ctx, grad_output):
        if not ctx.needs_input_grad[0]:
            return (None,) * 5
        (weight,) = ctx.saved_tensors
        grad_input = grad_output.to(ctx.compute_dtype) @ _dequantize(weight, ctx.scale, ctx.compute_dtype)
        return (grad_input.to(ctx.input_dtype),) + (None,) * 4


class _Float8Conv2d(torch.autograd.Function):
    """``conv2d(x, weight * scale, bias, ...)`` in ``compute_dtype`` with a frozen float8 weight; gradient for
    ``x`` only."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias, stride, padding, dilation, groups, compute_dtype):
        ctx.save_for_backward(weight)
        ctx.scale, ctx.compute_dtype, ctx.input_dtype, ctx.input_shape = scale, compute_dtype, x.dtype, x.shape
        ctx.geometry = (stride, padding, dilation, groups)
        return F.conv2d(x.to(compute_dtype), _dequantize(weight, scale, compute_dtype), _cast(bias, compute_dtype),
                        stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad_output):
        if not ctx.needs_input_grad[0]:
            return (None,) * 9
        (weight,) = ctx.saved_tensors
        grad_input = torch.nn.grad.conv2d_input(ctx.input_shape, _dequantize(weight, ctx.scale, ctx.compute_dtype),
                                                grad_output.to(ctx.compute_dtype), *ctx.geometry)
        return (grad_input.to(ctx.input_dtype),) + (None,) * 8
