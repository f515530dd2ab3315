"""Files of kohya's native network types (networks.dylora, lora_fa, loha, lokr, oft) as kohya-ss sd-scripts' OWN
modules build and read them.

The tables below were produced by a harness outside the project that ran kohya's code (sd-scripts networks/*.py,
Feb 2026; loha.py, lokr.py, network_base.py of commit aff4a2e) on kohya's own SD1 UNet (library/original_unet.py at
the tiny SD1.5 widths, with its weights) and transformers 4.54.1 (kohya's pin), and on kohya's full-size
SdxlUNet2DConditionModel on the meta device. There, kohya's create_network_from_weights + load_state_dict(strict=True)
loaded every file trained here and reproduced our outputs (max abs difference <= 2.2e-5 for UNet outputs changed by
0.04-0.5; text encoder outputs identical). This test keeps what that taught without kohya's code: the exact tensor
names and shapes kohya's modules have for each module kind, the tensor counts, and the forward conventions
(scale, alpha, Tucker einsums, LoKr full-matrix scale, DyLoRA's training rank draw, OFT's constraint) that the output
comparison pinned down, written out here from kohya's formulas."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import model_args, run_trainer

from networks import lokr, network_base, registry
from networks.network_base import read_lora_file, read_lora_metadata

# variant -> (--network_module, --network_dim, --network_alpha, --network_args)
VARIANTS = {
    "dylora": ("networks.dylora", 4, "1", ["conv_dim=4", "unit=2"]),  # kohya asserts conv_dim == network_dim
    "lora_fa": ("networks.lora_fa", 4, "1", ["conv_dim=2", "conv_alpha=1"]),
    "loha": ("networks.loha", 4, "1", ["conv_dim=2", "conv_alpha=1"]),
    "loha_tucker": ("networks.loha", 4, "1", ["conv_dim=2", "use_tucker=True"]),
    "lokr": ("networks.lokr", 4, "1", ["conv_dim=2"]),  # several modules take the full w2 at rank 4
    "lokr_tucker": ("networks.lokr", 2, "1", ["conv_dim=2", "use_tucker=True", "factor=4"]),
    "oft": ("networks.oft", 4, "0.01", ["enable_conv=True"]),
}

# Tiny SD1.5 modules of each kind (diffusers paths with dots as underscores), in -> out features / channels.
MODULES = {
    "linear": "down_blocks_0_attentions_0_transformer_blocks_0_ff_net_2",  # 128 -> 32
    "attention": "down_blocks_0_attentions_0_transformer_blocks_0_attn2_to_k",  # 32 -> 32
    "resnet_linear": "down_blocks_0_resnets_0_time_emb_proj",  # 128 -> 32
    "conv1x1": "down_blocks_2_resnets_0_conv_shortcut",  # 32 -> 64
    "conv3x3": "down_blocks_2_resnets_0_conv1",  # 32 -> 64, 3x3
    "text_encoder": "text_model_encoder_layers_0_mlp_fc1",  # 32 -> 64
}
_LORA = {"linear": {"lora_down.weight": (4, 128), "lora_up.weight": (32, 4)},
         "attention": {"lora_down.weight": (4, 32), "lora_up.weight": (32, 4)},
         "resnet_linear": {"lora_down.weight": (4, 128), "lora_up.weight": (32, 4)},
         "conv1x1": {"lora_down.weight": (4, 32, 1, 1), "lora_up.weight": (64, 4, 1, 1)},
         "text_encoder": {"lora_down.weight": (4, 32), "lora_up.weight": (64, 4)}}
_LOHA_LINEAR = {"linear": ((32, 4), (4, 128)), "attention": ((32, 4), (4, 32)), "resnet_linear": ((32, 4), (4, 128)),
                "conv1x1": ((64, 4), (4, 32)), "text_encoder": ((64, 4), (4, 32))}
_LOHA = {kind: {"hada_w1_a": a, "hada_w2_a": a, "hada_w1_b": b, "hada_w2_b": b} for kind, (a, b) in _LOHA_LINEAR.items()}
# What kohya's modules hold (every module also has "alpha" ()), and (tensors, modules) in the whole file.
KOHYA_TABLE = {
    "dylora": ((885, 295), {**_LORA, "conv3x3": {"lora_down.weight": (4, 32, 3, 3), "lora_up.weight": (64, 4, 1, 1)}}),
    "lora_fa": ((885, 295), {**_LORA, "conv3x3": {"lora_down.weight": (2, 32, 3, 3), "lora_up.weight": (64, 2, 1, 1)}}),
    "loha": ((1475, 295), {**_LOHA, "conv3x3": {"hada_w1_a": (64, 2), "hada_w1_b": (2, 288), "hada_w2_a": (64, 2),
                                                 "hada_w2_b": (2, 288)}}),
    "loha_tucker": ((1575, 295), {**_LOHA, "conv3x3": {
        "hada_t1": (2, 2, 3, 3), "hada_t2": (2, 2, 3, 3), "hada_w1_a": (2, 64), "hada_w1_b": (2, 32),
        "hada_w2_a": (2, 64), "hada_w2_b": (2, 32)}}),
    "lokr": ((996, 295), {
        "linear": {"lokr_w1": (4, 8), "lokr_w2_a": (8, 4), "lokr_w2_b": (4, 16)},
        "attention": {"lokr_w1": (4, 4), "lokr_w2": (8, 8)},
        "resnet_linear": {"lokr_w1": (4, 8), "lokr_w2_a": (8, 4), "lokr_w2_b": (4, 16)},
        "conv1x1": {"lokr_w1": (8, 4), "lokr_w2": (8, 8)},
        "conv3x3": {"lokr_w1": (8, 4), "lokr_w2_a": (8, 2), "lokr_w2_b": (2, 72)},
        "text_encoder": {"lokr_w1": (8, 4), "lokr_w2": (8, 8)}}),
    "lokr_tucker": ((1230, 295), {
        "linear": {"lokr_w1": (4, 4), "lokr_w2_a": (8, 2), "lokr_w2_b": (2, 32)},
        "attention": {"lokr_w1": (4, 4), "lokr_w2_a": (8, 2), "lokr_w2_b": (2, 8)},
        "resnet_linear": {"lokr_w1": (4, 4), "lokr_w2_a": (8, 2), "lokr_w2_b": (2, 32)},
        "conv1x1": {"lokr_w1": (4, 4), "lokr_w2_a": (16, 2), "lokr_w2_b": (2, 8)},
        "conv3x3": {"lokr_t2": (2, 2, 3, 3), "lokr_w1": (4, 4), "lokr_w2_a": (2, 16), "lokr_w2_b": (2, 8)},
        "text_encoder": {"lokr_w1": (4, 4), "lokr_w2_a": (16, 2), "lokr_w2_b": (2, 8)}}),
    # kohya's OFT: no text encoder, no transformer Linear but attention without enable_all_linear
    "oft": ((426, 213), {"linear": None, "text_encoder": None, "attention": {"oft_blocks": (4, 8, 8)},
                         "resnet_linear": {"oft_blocks": (4, 8, 8)}, "conv1x1": {"oft_blocks": (4, 16, 16)},
                         "conv3x3": {"oft_blocks": (4, 16, 16)}}),
}


def lora_name(variant: str, kind: str) -> str:
    prefix = "lora_te" if kind == "text_encoder" else ("oft_unet" if variant.startswith("oft") else "lora_unet")
    return f"{prefix}_{MODULES[kind]}"


@pytest.fixture(scope="module")
def trained(tiny_models, one_image_dataset, tmp_path_factory):
    """variant -> the file of a 2-step SD1.5 run with our train_network.py (trained once per variant)."""
    files = {}

    def get(variant: str):
        if variant not in files:
            module, dim, alpha, args = VARIANTS[variant]
            output_dir = tmp_path_factory.mktemp(f"kohya_{variant}")
            run_trainer("train_network", model_args(tiny_models, "sd15") + [
                "--train_data_dir", str(one_image_dataset), "--resolution", "64", "--output_dir", str(output_dir),
                "--output_name", "net", "--seed", "3", "--max_data_loader_n_workers", "0", "--network_module", module,
                "--network_dim", str(dim), "--network_alpha", alpha, "--network_args", *args,
                "--learning_rate", "1e-2", "--max_train_steps", "2"])
            files[variant] = output_dir / "net.safetensors"
        return files[variant]
    return get


@pytest.fixture(scope="module")
def sd15():
    from tools.build_tiny_models import tiny_sd

    return tiny_sd("sd1")


@pytest.mark.parametrize("variant", VARIANTS)
def test_file_holds_the_tensors_kohyas_modules_have(variant, trained):
    path = trained(variant)
    weights = read_lora_file(str(path))
    (tensor_count, module_count), table = KOHYA_TABLE[variant]
    assert (len(weights), len(network_base.group_by_module(weights))) == (tensor_count, module_count)
    assert all(value.dtype == torch.float32 for value in weights.values())  # kohya: int64 alpha of full-w2 LoKr
    modules = network_base.group_by_module(weights)
    for kind, expected in table.items():
        own = {name: tuple(value.shape) for name, value in modules.get(lora_name(variant, kind), {}).items()}
        assert own == ({**expected, "alpha": ()} if expected else {}), kind
    assert read_lora_metadata(str(path))["ss_network_module"] == VARIANTS[variant][0]


def test_oft_targets_are_kohyas(sd15):
    """kohya's OFT targets its UNet's "CrossAttention" class (diffusers' Attention) or, with enable_all_linear,
    every Linear/1x1 conv of the Transformer2DModel blocks: 128 and 192 modules on the tiny SD1.5."""
    oft = registry.network_type("networks.oft")
    counts = [len(oft.create_network(1.0, 4, 0.01, None, sd15.text_encoders, sd15.unet, **args).unet_loras)
              for args in ({}, {"enable_all_linear": "True"})]
    assert counts == [128, 192]


# --------------------------------------------------------------------------- kohya's forward conventions
def kohya_delta(module: str, parts: dict[str, torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    """The weight change kohya's module computes from its tensors (multiplier 1), in ``weight``'s shape."""
    alpha = float(parts["alpha"])
    if "lora_down.weight" in parts:
        down, up = parts["lora_down.weight"], parts["lora_up.weight"]
        return (up.flatten(1) @ down.flatten(1)).reshape(weight.shape) * alpha / down.shape[0]
    if "hada_w1_a" in parts:
        rank = parts["hada_w1_b"].shape[0]
        if "hada_t1" in parts:  # kohya: einsum("i j ..., j r, i p -> p r ...", t, w_b, w_a)
            first, second = (torch.einsum("ij...,jr,ip->pr...", parts[f"hada_t{i}"], parts[f"hada_w{i}_b"],
                                          parts[f"hada_w{i}_a"]) for i in (1, 2))
        else:
            first, second = (parts[f"hada_w{i}_a"] @ parts[f"hada_w{i}_b"] for i in (1, 2))
        return (first * second * alpha / rank).reshape(weight.shape)
    if "lokr_w2" in parts:  # both factors whole: kohya sets alpha = rank, scale 1
        w2, scale = parts["lokr_w2"], 1.0
    elif "lokr_t2" in parts:  # kohya: einsum("i j ..., i p, j r -> p r ...", t2, w2_a, w2_b)
        w2 = torch.einsum("ij...,ip,jr->pr...", parts["lokr_t2"], parts["lokr_w2_a"], parts["lokr_w2_b"])
        scale = alpha / parts["lokr_w2_a"].shape[0]
    else:
        w2, scale = parts["lokr_w2_a"] @ parts["lokr_w2_b"], alpha / parts["lokr_w2_b"].shape[0]
    w1 = parts["lokr_w1"].reshape(*parts["lokr_w1"].shape, *([1] * (w2.dim() - 2)))
    return (torch.kron(w1, w2.contiguous()) * scale).reshape(weight.shape)


def kohya_oft_weight(parts: dict[str, torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    """kohya's OFT: Q = B - B^T with ||Q|| clamped to alpha * out, R = (I + Q)(I - Q)^-1, block k of W -> R_k^T W_k."""
    blocks = parts["oft_blocks"]
    count, size = blocks.shape[:2]
    skew = blocks - blocks.transpose(1, 2)
    norm = skew.flatten().norm()
    skew = skew * ((norm.clamp(max=float(parts["alpha"]) * weight.shape[0]) + 1e-8) / (norm + 1e-8))
    identity = torch.eye(size).expand(count, size, size)
    rotation = (identity + skew) @ (identity - skew).inverse()
    return torch.einsum("knm,kn...->km...", rotation, weight.reshape(count, size, *weight.shape[1:])).reshape(
        weight.shape)


def layer(module: torch.nn.Module, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if isinstance(module, torch.nn.Conv2d):
        return torch.nn.functional.conv2d(x, weight, module.bias, module.stride, module.padding)
    return torch.nn.functional.linear(x, weight, module.bias)


def module_input(module: torch.nn.Module, generator: torch.Generator) -> torch.Tensor:
    if isinstance(module, torch.nn.Conv2d):
        return torch.randn(2, module.in_channels, 4, 4, generator=generator)
    return torch.randn(2, 3, module.in_features, generator=generator)


@pytest.mark.parametrize("variant", VARIANTS)
def test_modules_compute_what_kohyas_modules_compute(variant, trained, sd15):
    path = trained(variant)
    weights = read_lora_file(str(path))
    module = VARIANTS[variant][0]
    network = registry.network_from_file(str(path), sd15.text_encoders, sd15.unet, None, "--network_weights")
    network.apply_to()
    network.eval()
    by_name = {lora.lora_name: lora for lora in network.all_loras()}
    modules = network_base.group_by_module(weights)
    generator = torch.Generator().manual_seed(0)
    try:
        for kind, expected in KOHYA_TABLE[variant][1].items():
            if expected is None:
                continue
            name = lora_name(variant, kind)
            wrapped = network.wrapped_module(by_name[name])
            weight, x = wrapped.weight.detach(), module_input(wrapped, generator)
            with torch.no_grad():
                if module == "networks.oft":
                    reference = layer(wrapped, kohya_oft_weight(modules[name], weight), x)
                else:
                    reference = layer(wrapped, weight + kohya_delta(module, modules[name], weight), x)
                output, base = wrapped(x), layer(wrapped, weight, x)
            effect = float((reference - base).abs().max())
            assert effect > 1e-6, kind  # the trained module changes the layer
            # a wrong scale, alpha or layout would be off by a fraction of the effect; float32 rounding is far below
            assert float((output - reference).abs().max()) <= 1e-3 * effect + 1e-6, kind
    finally:
        network.restore()


def test_dylora_training_forward_draws_kohyas_rank(trained, sd15):
    """kohya's DyLoRA forward draws b uniformly in [0, r - 1] rounded down to a multiple of ``unit`` (the harness
    matched kohya's training-mode UNet output under the same draw) and scales the whole LoRA by sqrt(r / (b + unit));
    kohya has no eval mode, ours is its b = r - unit case (factor 1). kohya draws from Python's random, ours from
    torch's CPU generator, which gradient checkpointing restores for the recomputation."""
    path = trained("dylora")
    network = registry.network_from_file(str(path), sd15.text_encoders, sd15.unet, None, "--network_weights")
    network.apply_to()
    lora = next(lora for lora in network.unet_loras if lora.lora_name == lora_name("dylora", "linear"))
    wrapped = network.wrapped_module(lora)
    parts = network_base.group_by_module(read_lora_file(str(path)))[lora.lora_name]
    x = module_input(wrapped, torch.Generator().manual_seed(1))
    rank, unit = parts["lora_down.weight"].shape[0], 2
    low_rank = torch.nn.functional.linear(torch.nn.functional.linear(x, parts["lora_down.weight"]),
                                          parts["lora_up.weight"]) * float(parts["alpha"]) / rank
    try:
        network.train()
        for seed in range(4):
            torch.manual_seed(seed)
            drawn = int(torch.randint(rank, ()))
            drawn -= drawn % unit
            torch.manual_seed(seed)
            with torch.no_grad():
                output = wrapped(x)
            expected = layer(wrapped, wrapped.weight, x) + low_rank * math.sqrt(rank / (drawn + unit))
            torch.testing.assert_close(output, expected, rtol=1e-5, atol=1e-6)
        network.eval()
        with torch.no_grad():
            torch.testing.assert_close(wrapped(x), layer(wrapped, wrapped.weight, x) + low_rank, rtol=1e-5, atol=1e-6)
    finally:
        network.restore()


def test_lokr_factorization_matches_kohyas():
    # kohya's factorization() on every dimension 1..3072 with factor -1, 2, 3, 4, 8, 16 agreed with ours
    # (18,432 cases); these are the cases where "the most balanced pair" and "factor" are least obvious.
    cases = {(7, -1): (1, 7), (12, -1): (3, 4), (320, -1): (16, 20), (1280, -1): (32, 40), (2560, -1): (40, 64),
             (2816, -1): (44, 64), (289, -1): (17, 17), (768, 4): (4, 192), (640, 3): (2, 320), (96, 8): (8, 12),
             (1000, 16): (10, 100), (2048, 3): (2, 1024), (9, 2): (1, 9), (3072, 16): (16, 192)}
    assert {case: lokr.factorization(*case) for case in cases} == cases


def test_full_size_sdxl_names_are_kohyas():
    """kohya's networks.lokr on its full-size SdxlUNet2DConditionModel + CLIP-L/bigG (meta device), rank 2,
    conv_dim=2, use_tucker, factor=4: 1052 modules (288 te1 + 768 te2 tensors), 4246 tensors; sampled modules."""
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from library import checkpoint_keys
    from library.model_loading import shipped_config_dir

    config = shipped_config_dir("sdxl")
    with init_empty_weights():
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(config / "unet"))
        text_encoders = [CLIPTextModel(CLIPTextConfig.from_pretrained(config / "text_encoder")),
                         CLIPTextModelWithProjection(CLIPTextConfig.from_pretrained(config / "text_encoder_2"))]
    network = lokr.create_network(1.0, 2, 1.0, None, text_encoders, unet,
                                  unet_module_names=checkpoint_keys.unet_module_name_map(unet.config),
                                  conv_dim="2", use_tucker="True", factor="4")
    state = network.lora_state_dict()
    assert len(state) == 4246 and len(network.all_loras()) == 1052
    assert (sum(key.startswith("lora_te1_") for key in state), sum(key.startswith("lora_te2_") for key in state)) == \
        (288, 768)
    tucker_conv = {"lokr_w1": (4, 4), "lokr_t2": (2, 2, 3, 3), "alpha": ()}
    samples = {
        "lora_unet_input_blocks_4_0_in_layers_2": {**tucker_conv, "lokr_w2_a": (2, 160), "lokr_w2_b": (2, 80)},
        "lora_unet_input_blocks_3_0_op": {**tucker_conv, "lokr_w2_a": (2, 80), "lokr_w2_b": (2, 80)},
        "lora_unet_output_blocks_2_2_conv": {**tucker_conv, "lokr_w2_a": (2, 320), "lokr_w2_b": (2, 320)},
        "lora_unet_input_blocks_4_0_skip_connection": {"lokr_w1": (4, 4), "lokr_w2_a": (160, 2), "lokr_w2_b": (2, 80),
                                                       "alpha": ()},
        "lora_unet_input_blocks_1_0_emb_layers_1": {"lokr_w1": (4, 4), "lokr_w2_a": (80, 2), "lokr_w2_b": (2, 320),
                                                    "alpha": ()},
        "lora_unet_middle_block_1_transformer_blocks_9_ff_net_2": {"lokr_w1": (4, 4), "lokr_w2_a": (320, 2),
                                                                   "lokr_w2_b": (2, 1280), "alpha": ()},
        "lora_te1_text_model_encoder_layers_11_self_attn_out_proj": {"lokr_w1": (4, 4), "lokr_w2_a": (192, 2),
                                                                     "lokr_w2_b": (2, 192), "alpha": ()},
        "lora_te2_text_model_encoder_layers_31_mlp_fc2": {"lokr_w1": (4, 4), "lokr_w2_a": (320, 2),
                                                          "lokr_w2_b": (2, 1280), "alpha": ()},
    }
    modules = network_base.group_by_module(state)
    assert {name: {key: tuple(value.shape) for key, value in modules[name].items()} for name in samples} == samples
