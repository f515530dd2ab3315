"""``--network_module lycoris.kohya`` (lycoris-lora) on the tiny SDXL and SD1.5: every algo as the kohya_ss GUI
writes its arguments; file keys and shapes per module kind as docs/network_types.md documents them; training,
resume to the byte, continuing from a file, merging, lycoris' own reader, and one-line refusals."""
from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import (SCRIPT_ENV, TRAIN_SCRIPTS, cast_models, full_matrix, merge_rounding_bound, model_args,
                      model_outputs, run_trainer, train_expecting_user_error, trainings_run_once)

from library import checkpoint_keys, model_loading
from library.errors import UserError
from networks import lycoris_kohya, merge_lora, network_base, registry
from networks.network_base import read_lora_file, read_lora_metadata

REPO = Path(__file__).resolve().parent.parent

# The GUI's network_args for each "LyCORIS/..." LoRA type with its default settings (kohya_gui/lora_gui.py,
# quotes removed as it does). LoCon writes use_tucker twice: the later one counts, as in kohya's parser.
GUI_ARGS = {
    "locon": "preset=full conv_dim=1 conv_alpha=1 use_tucker=False rank_dropout=0 bypass_mode=False dora_wd=False "
             "module_dropout=0.0 use_tucker=False use_scalar=False rank_dropout_scale=False algo=locon "
             "train_norm=False",
    "loha": "preset=full conv_dim=1 conv_alpha=1 use_tucker=False rank_dropout=0 bypass_mode=False dora_wd=False "
            "module_dropout=0.0 use_tucker=False use_scalar=False rank_dropout_scale=False algo=loha train_norm=False",
    "lokr": "preset=full conv_dim=1 conv_alpha=1 use_tucker=False rank_dropout=0 bypass_mode=False dora_wd=False "
            "module_dropout=0.0 factor=-1 use_cp=False use_scalar=False decompose_both=False rank_dropout_scale=False "
            "algo=lokr train_norm=False",
    "ia3": "preset=full conv_dim=1 conv_alpha=1 train_on_input=True algo=ia3",
    "glora": "preset=full conv_dim=1 conv_alpha=1 use_tucker=False rank_dropout=0 module_dropout=0.0 "
             "rank_dropout_scale=False algo=glora train_norm=False",
    "dylora": "preset=full conv_dim=1 conv_alpha=1 use_tucker=False block_size=1 rank_dropout=0 module_dropout=0.0 "
              "algo=dylora train_norm=False",
    "diag-oft": "preset=full conv_dim=1 conv_alpha=1 module_dropout=0.0 use_tucker=False rank_dropout=0 "
                "rank_dropout_scale=False constraint=0.0 rescaled=False algo=diag-oft train_norm=False",
    # conv_dim=1 splits no 3x3 conv: BOFT trains the other layers (test_boft_at_the_gui_defaults_...)
    "boft": "preset=full conv_dim=1 conv_alpha=1 module_dropout=0.0 use_tucker=False rank_dropout=0 "
            "rank_dropout_scale=False algo=boft train_norm=False",
    "full": "preset=full rank_dropout=0 module_dropout=0.0 rank_dropout_scale=False algo=full train_norm=False",
}
GUI_DIM, GUI_ALPHA = 8, 1  # the GUI's Network Rank / Alpha defaults

# Layout variants: every algo and its shape-changing options, at network_dim 4 / conv_dim 2.
VARIANTS = {
    "locon": "algo=locon conv_dim=2 conv_alpha=1",
    "locon_tucker_dora": "algo=locon conv_dim=2 use_tucker=True dora_wd=True",
    "loha": "algo=loha conv_dim=2 conv_alpha=1",
    "lokr": "algo=lokr conv_dim=2 factor=-1",
    "lokr_decomposed": "algo=lokr conv_dim=1 factor=16 decompose_both=True",
    "ia3": "algo=ia3 train_on_input=False",
    "ia3_on_input": "algo=ia3 train_on_input=True",
    "glora": "algo=glora conv_dim=2",
    "dylora": "algo=dylora conv_dim=2 block_size=2",
    "diag-oft": "algo=diag-oft conv_dim=2 rescaled=True constraint=0.1",
    "boft": "algo=boft conv_dim=2",
    "full": "algo=full",
    "loha_train_norm": "algo=loha conv_dim=2 train_norm=True",
}
DIM = 4


def args_of(text: str) -> dict[str, str]:
    return network_base.parse_network_args(text.split())


def build_models(kind: str):
    from tools.build_tiny_models import tiny_sd, tiny_sdxl

    return tiny_sdxl() if kind == "sdxl" else tiny_sd("sd1")


def unet_names(models):
    return checkpoint_keys.unet_module_name_map(models.unet.config) if models.is_sdxl else None


def make_network(models, text: str, dim: int = DIM, multiplier: float = 1.0, **extra):
    return lycoris_kohya.create_network(multiplier, dim, 1.0, None, models.text_encoders, models.unet,
                                        unet_module_names=unet_names(models), **args_of(text), **extra)


@pytest.fixture(scope="module", params=["sdxl", "sd15"])
def models(request):
    return build_models(request.param)


# --------------------------------------------------------------------------- the documented file layout
def expected_tensors(variant: str, module: torch.nn.Module) -> dict[str, tuple]:
    """The tensors docs/network_types.md lists for one module of ``variant`` wrapping ``module``."""
    from lycoris.functional import factorization, power2factorization

    options = args_of(VARIANTS[variant])
    weight_shape = tuple(module.weight.shape)
    if isinstance(module, (torch.nn.GroupNorm, torch.nn.LayerNorm)):
        return {"w_norm": weight_shape, "b_norm": weight_shape}
    out_dim, in_dim, kernel = weight_shape[0], weight_shape[1], weight_shape[2:]
    ones = (1,) * len(kernel)
    is_3x3 = bool(kernel) and kernel != (1, 1)
    rank = int(options.get("conv_dim", DIM)) if is_3x3 else DIM
    algo = options["algo"]
    if algo == "locon":
        tensors = {"lora_up.weight": (out_dim, rank, *ones), "alpha": ()}
        if is_3x3 and options.get("use_tucker") == "True":
            tensors.update({"lora_down.weight": (rank, in_dim, 1, 1), "lora_mid.weight": (rank, rank, *kernel)})
        else:
            tensors["lora_down.weight"] = (rank, in_dim, *kernel)
        if options.get("dora_wd") == "True":
            tensors["dora_scale"] = (out_dim, *(1,) * (len(weight_shape) - 1))
        return tensors
    if algo == "loha":
        pair = {"a": (out_dim, rank), "b": (rank, in_dim * math.prod(kernel))}
        return {**{f"hada_w{i}_{part}": shape for i in (1, 2) for part, shape in pair.items()}, "alpha": ()}
    if algo == "lokr":
        factor = int(options["factor"])
        (a, b), (c, d) = factorization(out_dim, factor), factorization(in_dim, factor)
        tensors = {"alpha": ()}
        if options.get("decompose_both") == "True" and rank < max(a, c) / 2:
            tensors.update(lokr_w1_a=(a, rank), lokr_w1_b=(rank, c))
        else:
            tensors["lokr_w1"] = (a, c)
        if rank >= max(b, d) / 2:
            tensors["lokr_w2"] = (b, d, *kernel)
        else:
            tensors.update(lokr_w2_a=(b, rank), lokr_w2_b=(rank, d * math.prod(kernel)))
        return tensors
    if algo == "ia3":
        trained = in_dim if options["train_on_input"] == "True" else out_dim
        return {"weight": (1, trained, *ones) if kernel else (trained,), "on_input": ()}
    if algo == "glora":
        return {"a1.weight": (in_dim, rank, *ones), "a2.weight": (rank, in_dim, *ones),
                "b1.weight": (out_dim, rank, *ones), "b2.weight": (rank, in_dim, *kernel), "alpha": ()}
    if algo == "dylora":  # lycoris joins the blocks; lora_up stays 2-D for convs too
        return {"lora_up.weight": (out_dim, rank), "lora_down.weight": (rank, in_dim, *kernel), "alpha": ()}
    if algo == "diag-oft":
        block, count = factorization(out_dim, rank)
        return {"oft_blocks": (count, block, block), "alpha": (), "rescale": (out_dim, *(1,) * (len(weight_shape) - 1))}
    if algo == "boft":
        block, count = power2factorization(out_dim, rank)
        return {"oft_blocks": (bin(count - 1).count("1") + 1, count, block, block), "alpha": ()}
    assert algo == "full"
    return {"diff": weight_shape, **({"diff_b": (out_dim,)} if module.bias is not None else {})}


def module_kind(lora_name: str, module: torch.nn.Module) -> str:
    if lora_name.startswith("lora_te"):
        return "text encoder"
    if isinstance(module, torch.nn.Linear):
        return "linear"
    if isinstance(module, torch.nn.Conv2d):
        return "conv1x1" if tuple(module.kernel_size) == (1, 1) else "conv3x3"
    return "norm"


@pytest.mark.parametrize("variant", VARIANTS)
def test_file_layout_matches_the_documented_convention(variant, models):
    network = make_network(models, VARIANTS[variant])
    state = network.lora_state_dict()
    kinds = set()
    for lora in network.all_loras():
        module = network.wrapped_module(lora)
        kinds.add(module_kind(lora.lora_name, module))
        own = {key.partition(".")[2]: tuple(value.shape) for key, value in state.items()
               if key.partition(".")[0] == lora.lora_name}
        assert own == expected_tensors(variant, module), lora.lora_name
    assert {"linear", "conv1x1", "conv3x3", "text encoder"} <= kinds
    assert ("norm" in kinds) == (variant == "loha_train_norm")
    assert all(value.dtype == (torch.int64 if key.endswith("on_input") else torch.float32)
               for key, value in state.items())
    assert network.lora_state_dict(torch.float16)[next(iter(state))].dtype == torch.float16  # cast as lycoris saves


def test_modules_are_named_as_kohya_and_lycoris_name_them(models):
    network = make_network(models, "algo=locon conv_dim=2")
    names = {lora.lora_name for lora in network.all_loras()}
    prefixes = {name.split("_")[1] for name in names}
    if models.is_sdxl:
        assert prefixes == {"unet", "te1", "te2"}
        assert {"lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q", "lora_unet_input_blocks_3_0_op",
                "lora_unet_output_blocks_2_2_conv", "lora_unet_input_blocks_4_0_skip_connection",
                "lora_unet_middle_block_0_emb_layers_1",
                "lora_te2_text_model_encoder_layers_0_mlp_fc1"} <= names
        # kohya's SGM-layout UNet has no conv_in/conv_out/time_embedding names for the full preset to match
        assert not any(name.startswith(("lora_unet_input_blocks_0_", "lora_unet_out_", "lora_unet_time_embed",
                                        "lora_unet_label_emb")) for name in names)
    else:
        assert prefixes == {"unet", "te"}
        # the full preset's names, once each (lycoris 4 also targets their TimestepEmbedding class)
        assert {"lora_unet_conv_in", "lora_unet_conv_out", "lora_unet_time_embedding_linear_1",
                "lora_unet_down_blocks_1_attentions_0_proj_in", "lora_te_text_model_encoder_layers_0_self_attn_q_proj",
                } <= names
    # preset=attn-only targets kohya's CrossAttention class (diffusers calls it Attention)
    attention = make_network(models, "algo=locon preset=attn-only")
    attention_names = {lora.lora_name for lora in attention.unet_loras}
    assert attention_names and all(("_attn1_" in name or "_attn2_" in name) and
                                   name.endswith(("to_q", "to_k", "to_v", "to_out_0")) for name in attention_names)


def test_gui_strings_mean_what_the_user_set(models):
    def modules(text: str, dim: int = DIM, **extra):
        return make_network(models, text, dim, **extra).all_loras()

    def tensor_names(text: str, dim: int = DIM) -> set[str]:
        network = make_network(models, text, dim)
        return {key.partition(".")[2] for key in network.lora_state_dict()}

    # decompose_both=False: the Kronecker factor w1 stays whole (lycoris reads the string "False" as true)
    assert "lokr_w1_a" not in tensor_names("algo=lokr factor=4 decompose_both=False", dim=1)
    assert "lokr_w1_a" in tensor_names("algo=lokr factor=4 decompose_both=True", dim=1)
    for text in ("false", "0"):
        assert "lokr_w1_a" not in tensor_names(f"algo=lokr factor=4 decompose_both={text}", dim=1)
    # use_tucker and its alias use_cp are one switch (lycoris lets use_cp=False overwrite use_tucker=True)
    assert "lora_mid.weight" in tensor_names("algo=locon conv_dim=2 use_tucker=True use_cp=False")
    assert "lora_mid.weight" not in tensor_names("algo=locon conv_dim=2 use_tucker=False use_cp=False")
    # arguments lycoris' create_network drops reach the modules
    assert all(int(lora.on_input) == 1 for lora in modules("algo=ia3 train_on_input=True"))
    assert all(lora.rank_dropout_scale for lora in modules("algo=loha rank_dropout=0.1 rank_dropout_scale=True"))
    assert all(lora.dropout.p == 0.25 for lora in modules("algo=locon", neuron_dropout=0.25))  # --network_dropout


def test_lora_plus_and_max_norm_follow_the_algo(models):
    network = make_network(models, "algo=locon conv_dim=2")
    groups = network.prepare_optimizer_params(None, 1e-3, 1e-3, (2.0, 4.0))
    plus = [group for group in groups if group["lr"] == pytest.approx(4e-3)]
    assert len(plus) == 1
    assert {id(p) for p in plus[0]["params"]} == {id(lora.lora_up.weight) for lora in network.unet_loras}
    with pytest.raises(UserError, match="lycoris.kohya algo=loha has no up/down parts"):
        make_network(models, "algo=loha").prepare_optimizer_params(None, 1e-3, 1e-3, (None, 4.0))
    supported = {algo: make_network(models, f"algo={algo} conv_dim=2 block_size=2").supports_max_norm()
                 for algo in ("locon", "loha", "lokr", "diag-oft", "boft", "ia3", "glora", "dylora", "full")}
    # lycoris skips modules without max-norm (kohya + lycoris trains an iA3 preset with --scale_weight_norms)
    assert all(supported.values())
    scaled_modules = {algo: len(make_network(models, f"algo={algo} conv_dim=2 block_size=2")._max_norm_modules())
                      for algo in ("ia3", "glora", "dylora", "full", "lokr")}
    assert scaled_modules["ia3"] == scaled_modules["glora"] == scaled_modules["dylora"] == scaled_modules["full"] == 0
    assert scaled_modules["lokr"] > 0
    # lycoris' apply_max_norm scales the modules whose change is larger than the limit
    with torch.no_grad():
        for lora in network.all_loras():
            lora.lora_up.weight.normal_()
    stats = network.apply_max_norm_regularization(0.01)
    assert int(stats.keys_scaled) == len(network.all_loras()) and float(stats.max_norm) == pytest.approx(0.01)


# --------------------------------------------------------------------------- merging and reading files
def largest_difference(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    return max(float((a - b).abs().max()) for a, b in zip(first, second))


def random_network_file(models, variant: str, path: Path, multiplier: float = 1.0):
    """A network of ``variant`` with random weights (so that it changes the model), saved to ``path``."""
    network = make_network(models, VARIANTS[variant], multiplier=multiplier)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in network.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    network.eval()
    network_base.save_lora_file(network.lora_state_dict(), str(path), {
        "ss_network_module": "lycoris.kohya", "ss_network_args": json.dumps(args_of(VARIANTS[variant]))})
    return network


# lycoris computes OFT rotations in float32 only (diag_oft.py: `.float().inverse()`): these are compared in
# float32 (measured: 3e-6 of the effect, sqrt(eps32) = 3.5e-4).
FLOAT32_ONLY = ("diag-oft", "boft")
# The (variant, kind) round trips CI checks: every variant on SDXL; on SD 1.5 (diffusers module names, checked for
# every variant by the layout test) the variants whose modules differ there: LoCon (the full preset's conv_in,
# conv_out and time embedding, SD 1.5 only), Full (those layers' weights replaced, biases included) and the norm
# layers (train_norm). ``pytest --full_matrix`` checks every variant on both kinds.
SD15_ROUND_TRIPS = ("locon", "full", "loha_train_norm")
ROUND_TRIP_CASES = [(variant, kind) for kind in ("sdxl", "sd15") for variant in VARIANTS
                    if full_matrix() or kind == "sdxl" or variant in SD15_ROUND_TRIPS]


@pytest.mark.parametrize(("variant", "kind"), ROUND_TRIP_CASES)
def test_file_reproduces_the_network_and_merging_reproduces_the_file(variant, kind, tmp_path):
    models = build_models(kind)
    path = tmp_path / "net.safetensors"
    network = random_network_file(models, variant, path, multiplier=0.7)
    dtype = torch.float32 if variant in FLOAT32_ONLY else torch.float64
    cast_models(models, dtype)
    network.to(dtype)  # the file's float32 values, exactly
    with torch.no_grad():
        base = model_outputs(models)
        network.apply_to()
        applied = model_outputs(models)
        network.restore()
        from_file = registry.network_from_file(str(path), models.text_encoders, models.unet, unet_names(models),
                                               "--models", multiplier=0.7)
        from_file.to(dtype).eval()
        from_file.apply_to()
        read_back = model_outputs(models)
        from_file.restore()
        merged_count = merge_lora.merge_into_models(models, [str(path)], [0.7])
        merged = model_outputs(models)
    assert largest_difference(applied, base) > 1e-2  # the network matters
    if variant != "dylora":  # lycoris' DyLoRA draws a rank at every forward, even in eval
        assert largest_difference(read_back, applied) < 1e-6
    assert merged_count == len(network.all_loras())
    effect = largest_difference(read_back, base)
    assert largest_difference(merged, read_back) <= merge_rounding_bound(dtype) * effect


class TransformersFourCLIP(torch.nn.Module):
    """A transformers 5 CLIPTextModel under a ``text_model`` attribute: the module paths kohya's
    transformers 4 encoder has, for lycoris' reader (it names modules from the model it is given)."""

    def __init__(self, text_encoder: torch.nn.Module) -> None:
        super().__init__()
        self.text_model = text_encoder


# lycoris' reader fails on its own IA3 files, on LoKr convs with a split w2 and on DyLoRA convs (see the docs).
READABLE_BY_LYCORIS = ["locon", "locon_tucker_dora", "loha", "glora", "diag-oft", "boft", "full", "loha_train_norm"]


@pytest.mark.parametrize("variant", READABLE_BY_LYCORIS)
def test_lycoris_own_reader_loads_our_sd15_file_and_reproduces_it(variant, tmp_path):
    """kohya's SD1.x naming is diffusers-path based, so lycoris' create_network_from_weights walks the
    diffusers models themselves: every module of our file must be found and give the same outputs."""
    from lycoris.config import PRESET
    from lycoris.kohya import LycorisNetworkKohya, create_network_from_weights

    models = build_models("sd15")
    path = tmp_path / "net.safetensors"
    ours = random_network_file(models, variant, path)
    # The reader first builds a throwaway network with the class-wide preset; lycoris 4's "full"
    # stops on SD1.x (duplicated time_embedding modules), so give it one that builds.
    LycorisNetworkKohya.apply_preset(PRESET["attn-mlp"])
    theirs, _ = create_network_from_weights(1.0, None, None, TransformersFourCLIP(models.text_encoders[0]),
                                            models.unet, weights_sd=read_lora_file(str(path)))
    assert {lora.lora_name for lora in theirs.text_encoder_loras + theirs.unet_loras} == \
        {lora.lora_name for lora in ours.all_loras()}
    theirs.eval()
    with torch.no_grad():
        ours.apply_to()
        expected = model_outputs(models)
        ours.restore()
        theirs.apply_to(models.text_encoders[0], models.unet, True, True)
        assert largest_difference(model_outputs(models), expected) < 1e-5


def test_reading_back_what_lycoris_cannot(models, tmp_path):
    """IA3 (with on_input), LoKr with split factors on convs, DyLoRA convs: read back to the same tensors."""
    for variant in ("ia3_on_input", "lokr_decomposed", "dylora"):
        path = tmp_path / f"{variant}.safetensors"
        random_network_file(models, variant, path)
        weights = read_lora_file(str(path))
        network = lycoris_kohya.create_network_from_weights(1.0, weights, models.text_encoders, models.unet,
                                                            unet_names(models))
        network.load_state_dict(weights)
        reread = network.lora_state_dict()
        for key, value in weights.items():
            assert torch.equal(reread[key].reshape(value.shape), value), key


def test_boft_dims_that_cannot_split_a_linear_layer_are_named_in_one_line(models):
    """BOFT needs an even block size up to the dim that leaves a power of two: a 768-wide CLIP layer
    (SD1.x) needs dim 6 or more. lycoris stops with a traceback; we name the dims that work."""
    from transformers import CLIPTextConfig, CLIPTextModel

    clip_768 = CLIPTextModel(CLIPTextConfig(vocab_size=514, hidden_size=768, intermediate_size=768,
                                            num_hidden_layers=1, num_attention_heads=12, max_position_embeddings=77))
    with pytest.raises(UserError) as refused:
        lycoris_kohya.create_network(1.0, 4, 1.0, None, [clip_768], models.unet,
                                     unet_module_names=unet_names(models), algo="boft", conv_dim="2")
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    assert "768-wide layer with dim 4" in message and "--network_dim >= 6" in message
    assert make_network(models, "algo=boft conv_dim=2", dim=6).all_loras()  # what it says works, works


def is_3x3_conv(layer: torch.nn.Module) -> bool:
    return isinstance(layer, torch.nn.Conv2d) and tuple(layer.kernel_size) != (1, 1)


def test_boft_at_the_gui_defaults_skips_the_convs_it_cannot_split(models, capsys):
    """The GUI's BOFT defaults: conv_dim=1 splits no 3x3 conv (lycoris stops on the first one). Every
    other layer gets its BOFT module, exactly those of conv_dim=2 but the 3x3 convs, and one line says
    how many convs were skipped and which conv_dim would take them."""
    capsys.readouterr()
    network = make_network(models, GUI_ARGS["boft"], GUI_DIM)
    notices = [line for line in capsys.readouterr().out.splitlines() if "skipped" in line]
    with_convs = make_network(models, GUI_ARGS["boft"].replace("conv_dim=1", "conv_dim=2"), GUI_DIM)
    names = {lora.lora_name: network.wrapped_module(lora) for lora in network.all_loras()}
    all_names = {lora.lora_name: with_convs.wrapped_module(lora) for lora in with_convs.all_loras()}
    skipped = set(all_names) - set(names)
    assert set(names) < set(all_names) and skipped and all(is_3x3_conv(all_names[name]) for name in skipped)
    assert not any(is_3x3_conv(layer) for layer in names.values())
    assert any(isinstance(layer, torch.nn.Linear) for layer in names.values())
    widths = "/".join(str(width) for width in sorted({all_names[name].out_channels for name in skipped}))
    assert notices == [f"lycoris.kohya algo=boft: {len(skipped)} conv layers skipped: BOFT cannot split their {widths} "
                       "channels into butterfly blocks with dim 1 (an even block size up to the dim, the width "
                       "divided by it a power of two); --network_args conv_dim >= 2 splits them"]


def test_boft_with_no_layer_it_can_split_is_one_line_naming_the_conv_dim(models, tmp_path):
    """A preset that targets only 3x3 convs (the UNet's downsamplers): at conv_dim=1 nothing is left to
    train, a one-line error naming the conv_dim that works; that conv_dim builds them."""
    preset = tmp_path / "downsamplers.toml"
    preset.write_text('enable_conv = true\nunet_target_module = ["Downsample2D"]\nunet_target_name = []\n'
                      'text_encoder_target_module = []\ntext_encoder_target_name = []\n')
    with pytest.raises(UserError) as refused:
        make_network(models, f"algo=boft conv_dim=1 preset={preset}", GUI_DIM)
    message = str(refused.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("lycoris.kohya algo=boft: no layer to train: ")
    assert "--network_args conv_dim >= 2 splits them" in message
    built = make_network(models, f"algo=boft conv_dim=2 preset={preset}", GUI_DIM).all_loras()
    assert built and all(is_3x3_conv(lora.org_module[0]) for lora in built)


# --------------------------------------------------------------------------- training
TRAINED = {  # variant -> (network_dim, network_args, extra trainer flags)
    **{algo: (GUI_DIM, text, ()) for algo, text in GUI_ARGS.items()},
    # resume must restore what lycoris keeps outside its files: a trainable scalar, max-norm's scaling
    # (and the gradient guard's state, with its stable preset)
    "locon_scalar_max_norm": (4, "algo=locon conv_dim=2 use_scalar=True rank_dropout=0.2 module_dropout=0.2",
                              ("--scale_weight_norms", "0.05", "--network_dropout", "0.1",
                               "--grad_guard_preset", "stable")),
    "loha_dropout": (4, "algo=loha conv_dim=2 rank_dropout=0.2 module_dropout=0.2", ()),
}
# Tensors that start at zero in each algo: training must move them.
ZERO_INIT = {"locon": "lora_up.weight", "loha": "hada_w2_a", "lokr": ("lokr_w2", "lokr_w2_b"), "ia3": ".weight",
             "glora": ("a2.weight", "b2.weight"), "dylora": "lora_up.weight", "diag-oft": "oft_blocks",
             "boft": "oft_blocks", "full": ("diff", "diff_b")}


def train_args(tiny_models, dataset: Path, kind: str, variant: str, output_dir: Path, *extra: str) -> list[str]:
    dim, text, flags = TRAINED[variant]
    precision = ["--mixed_precision", "fp16"] if kind == "sdxl" else []  # fp16: the loss scaler at work
    return model_args(tiny_models, kind) + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", "net", "--seed", "3", "--max_data_loader_n_workers", "0",
        "--network_module", "lycoris.kohya", "--network_dim", str(dim), "--network_alpha", str(GUI_ALPHA),
        "--network_args", *text.split(), "--learning_rate", "1e-2", "--max_train_steps", "3", "--save_state",
        "--save_every_n_steps", "2", "--log_jsonl", str(output_dir / "log.jsonl"), *precision, *flags, *extra,
    ]


@pytest.fixture(scope="module")
def trained(tiny_models, one_image_dataset, tmp_path_factory):
    """variant, kind -> output folder of a 3-step run (state at step 2, final file net.safetensors), dated by
    SOURCE_DATE_EPOCH as the subprocesses are (a killed run's file is byte-comparable with these)."""
    get = trainings_run_once(tmp_path_factory, lambda variant, kind, output_dir: train_args(
        tiny_models, one_image_dataset, kind, variant, output_dir))

    def get_dated(variant: str, kind: str) -> Path:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("SOURCE_DATE_EPOCH", SCRIPT_ENV["SOURCE_DATE_EPOCH"])
            return get(variant, kind)
    return get_dated


# The (algo, kind) trainings CI checks: every algo once, on the kind whose training the other tests use too
# (DyLoRA on both); ``pytest --full_matrix`` trains every algo on both kinds.
SD15_GUI_ALGOS = ("locon", "loha", "glora", "dylora")
GUI_CASES = [(algo, kind) for kind in ("sdxl", "sd15") for algo in GUI_ARGS
             if full_matrix() or (kind == "sd15") == (algo in SD15_GUI_ALGOS) or algo == "dylora"]


@pytest.mark.parametrize(("algo", "kind"), GUI_CASES)
def test_each_gui_lycoris_type_trains_and_writes_kohyas_file(algo, kind, trained):
    output_dir = trained(algo, kind)
    losses = [json.loads(line)["loss/current"] for line in (output_dir / "log.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    path = str(output_dir / "net.safetensors")
    weights = read_lora_file(path)
    metadata = read_lora_metadata(path)
    assert metadata["ss_network_module"] == "lycoris.kohya"
    assert json.loads(metadata["ss_network_args"]) == args_of(GUI_ARGS[algo])
    assert metadata["ss_network_dim"] == str(GUI_DIM)
    assert all(bool(torch.isfinite(value).all()) for value in weights.values())
    moved = [value for key, value in weights.items() if key.endswith(ZERO_INIT[algo])]
    assert moved and sum(bool(value.abs().max() > 0) for value in moved) > len(moved) // 2
    # exactly the network lycoris builds for these arguments on that model (keys and shapes)
    expected = make_network(build_models(kind), GUI_ARGS[algo], GUI_DIM).lora_state_dict()
    assert {key: tuple(value.shape) for key, value in weights.items()} == \
        {key: tuple(value.shape) for key, value in expected.items()}


# locon_scalar_max_norm's state (scalar, max-norm, guard) is resumed by the kill test below too (from its step-1
# state, to the same run's bytes): CI resumes it there, ``pytest --full_matrix`` here too.
RESUMED = ["loha_dropout", "dylora", "full", "boft"] + (["locon_scalar_max_norm"] if full_matrix() else [])


@pytest.mark.parametrize("variant", RESUMED)
def test_resume_gives_identical_bytes(variant, trained, tiny_models, one_image_dataset, tmp_path):
    reference = trained(variant, "sdxl")
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    for old in resumed.glob("net*.safetensors"):
        old.unlink()
    run_trainer("sdxl_train_network", train_args(tiny_models, one_image_dataset, "sdxl", variant, resumed,
                                                 "--resume", str(resumed / "net-step00000002-state")))
    assert (resumed / "net.safetensors").read_bytes() == (reference / "net.safetensors").read_bytes()


def test_sigkill_in_a_state_write_then_resume_auto_gives_identical_bytes(trained, tiny_models, one_image_dataset,
                                                                         tmp_path):
    """Killed (SIGKILL) while writing the step-2 state (a state every step): --resume auto continues from step 1
    to the file of the uninterrupted run (the module's run, a state every 2 steps: when states are written
    changes nothing)."""
    reference = trained("locon_scalar_max_norm", "sdxl") / "net.safetensors"

    def argv(*extra: str) -> list[str]:
        return train_args(tiny_models, one_image_dataset, "sdxl", "locon_scalar_max_norm", tmp_path / "run",
                          "--save_every_n_steps", "1", *extra)

    killed = subprocess.run([sys.executable, str(REPO / "sdxl_train_network.py"),
                             *argv("--debug_kill_in_state_write", "2")],
                            cwd=REPO, env=SCRIPT_ENV, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -9, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert sorted(path.name for path in (tmp_path / "run").glob("net-step*-state")) == ["net-step00000001-state"]
    run_trainer("sdxl_train_network", argv("--resume", "auto"))  # the start time comes from the state
    assert (tmp_path / "run" / "net.safetensors").read_bytes() == reference.read_bytes()


@pytest.mark.parametrize("variant, kind, from_weights", [
    ("locon", "sd15", False), ("dylora", "sd15", False), ("full", "sdxl", False),
    ("lokr", "sdxl", True), ("ia3", "sdxl", True),
])
def test_continues_from_a_file(variant, kind, from_weights, trained, tiny_models, one_image_dataset, tmp_path):
    source = trained(variant, kind) / "net.safetensors"
    extra = ["--network_weights", str(source), "--max_train_steps", "1", "--learning_rate", "1e-4"]
    if from_weights:
        extra.append("--dim_from_weights")
    run_trainer(TRAIN_SCRIPTS[kind], train_args(tiny_models, one_image_dataset, kind, variant, tmp_path, *extra))
    before, after = read_lora_file(str(source)), read_lora_file(str(tmp_path / "net.safetensors"))
    assert {key: value.shape for key, value in before.items()} == {key: value.shape for key, value in after.items()}
    changed = [key for key in before if not torch.equal(before[key], after[key])]
    assert changed  # it trained on from the file's values ...
    assert all(float((after[key] - before[key]).abs().max()) < 0.05 for key in before)  # ... not from scratch


def test_sample_images_have_the_network_applied(tiny_models, one_image_dataset, tmp_path):
    """Full fine-tuning takes the layer's weight away from the model: samples must still see it."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --w 64 --h 64 --s 2 --d 7\n")
    run_trainer("train_network", train_args(
        tiny_models, one_image_dataset, "sd15", "full", tmp_path / "out", "--max_train_steps", "2",
        "--sample_prompts", str(prompts), "--sample_at_first", "--sample_every_n_steps", "2"))
    import numpy as np
    from PIL import Image

    images = sorted((tmp_path / "out" / "sample").glob("*.png"))
    assert len(images) == 2
    first, last = (np.asarray(Image.open(path), dtype=np.int16) for path in images)
    assert np.abs(first - last).max() > 0


def test_merge_lora_and_the_tools_read_lycoris_files(trained, tiny_models, tmp_path, capsys):
    from networks import check_lora_weights
    from tools import show_metadata

    source = trained("loha", "sd15") / "net.safetensors"
    merged_file = tmp_path / "merged.safetensors"
    merge_lora.main(["--sd_model", str(tiny_models["sd15_file"]), "--model_config_dir",
                     str(tiny_models["sd15_config"]), "--save_to", str(merged_file), "--models", str(source)])
    load = dict(sdxl=False, model_config_dir=tiny_models["sd15_config"])
    base = model_loading.load_models(tiny_models["sd15_file"], **load)
    network = registry.network_from_file(str(source), base.text_encoders, base.unet, None, "--models")
    network.eval()
    network.apply_to()
    with torch.no_grad():
        expected = model_outputs(base)
        merged = model_outputs(model_loading.load_models(merged_file, **load))
    for a, b in zip(merged, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=5e-5)
    for algo in ("ia3", "full", "boft"):
        path = trained(algo, "sdxl") / "net.safetensors"
        assert check_lora_weights.main([str(path)]) == 0
        assert show_metadata.describe(path)["metadata"]["ss_network_module"] == "lycoris.kohya"
    capsys.readouterr()


# --------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("extra, message", [
    (["--network_args", "algo=lokr", "dora=True"], "unknown key dora for lycoris.kohya (valid: algo, preset, conv_dim"),
    (["--network_args", "algo=lorax"], "algo=lorax: not a LyCORIS algo of lycoris.kohya (valid: lora, locon, loha"),
    (["--network_args", "algo=lokr", "decompose_both=maybe"], "decompose_both=maybe is not a boolean"),
    (["--network_args", "algo=lokr", "factor=x"], "--network_args factor=x is not a int"),
    (["--network_args", "algo=loha", "preset=everything"], "preset=everything: not a LyCORIS preset (full, full-lin"),
    (["--network_args", "algo=full", "bypass_mode=True"], "algo=full has no bypass mode"),
    (["--network_args", "algo=dylora", "block_size=3"],
     "--network_dim 4: algo=dylora needs a multiple of block_size=3"),
    (["--network_args", "algo=boft", "conv_dim=2", "--network_dim", "1"],
     "with dim 1 into butterfly blocks (an even block size up to the dim, the width divided by it a power of two); "
     "for this model use --network_dim >= 2"),
    (["--network_args", "algo=loha", "loraplus_lr_ratio=4"], "lycoris.kohya algo=loha has no up/down parts"),
])
def test_bad_lycoris_settings_are_one_line_errors(extra, message, tiny_models, one_image_dataset, tmp_path, capsys):
    argv = train_args(tiny_models, one_image_dataset, "sdxl", "locon", tmp_path, "--max_train_steps", "1",
                      "--network_dim", "4")
    start = argv.index("--network_args")  # replace the variant's arguments
    end = next(i for i in range(start + 1, len(argv)) if argv[i].startswith("--"))
    error = train_expecting_user_error(argv[:start] + argv[end:] + extra, capsys)
    assert message in error
    assert not (tmp_path / "net.safetensors").exists()


def test_max_norm_with_an_algo_without_it_trains_and_says_so(tiny_models, one_image_dataset, tmp_path, capsys):
    """The GUI's iA3-Prodigy preset sets --scale_weight_norms: kohya + lycoris trains it, scaling nothing."""
    argv = model_args(tiny_models, "sd15") + [
        "--train_data_dir", str(one_image_dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(tmp_path), "--output_name", "net", "--max_data_loader_n_workers", "0",
        "--network_module", "lycoris.kohya", "--network_args", "algo=ia3", "--learning_rate", "1e-2",
        "--max_train_steps", "2", "--scale_weight_norms", "1"]
    run_trainer("train_network", argv)
    output = capsys.readouterr().out
    assert output.count("have no max-norm in lycoris and are left as they are") == 1
    assert (tmp_path / "net.safetensors").exists()
