"""kohya's native network types (networks.dylora, lora_fa, loha, lokr, oft, block-wise networks.lora) on
the tiny SDXL and SD1.5: file keys and shapes per module kind as docs/network_types.md documents them,
training, resume to the byte, continuing from a file, merging into a model, and one-line refusals."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import (TRAIN_SCRIPTS, cast_models, full_matrix, merge_rounding_bound, model_args, model_outputs,
                      run_trainer, train_expecting_user_error, trainings_run_once)

from library import checkpoint_keys, model_loading
from library.errors import UserError
from networks import lokr, merge_lora, network_base, registry
from networks.network_base import read_lora_file, read_lora_metadata


# variant -> (--network_module, --network_dim, --network_args): every module kind (Linear, 1x1 conv,
# 3x3 conv, text encoder) and each type's conv modes.
VARIANTS = {
    "lora_blocks": ("networks.lora", 4, ["conv_dim=2", "conv_alpha=1", "down_lr_weight=sine", "mid_lr_weight=0.5",
                                         "up_lr_weight=1,1,0"]),
    "dylora": ("networks.dylora", 4, ["conv_dim=2", "unit=2"]),
    "lora_fa": ("networks.lora_fa", 4, ["conv_dim=2", "conv_alpha=1"]),
    "loha": ("networks.loha", 4, ["conv_dim=2", "conv_alpha=1"]),
    "loha_tucker": ("networks.loha", 4, ["conv_dim=2", "use_tucker=True"]),
    "lokr": ("networks.lokr", 4, ["conv_dim=2"]),  # rank 4: most tiny modules take the full w2
    "lokr_tucker": ("networks.lokr", 2, ["conv_dim=2", "use_tucker=True", "factor=4"]),
    "oft": ("networks.oft", 4, ["enable_conv=True"]),
}
TRAINED = ["lora_blocks", "dylora", "lora_fa", "loha", "lokr", "oft"]
# The trainings CI checks (trained, resumed to the byte, continued from the file): every type on SDXL, where the
# continued run builds the network from the file (--dim_from_weights: each type's own builder), and on SD 1.5 the
# block-wise LoRA, whose blocks (and so its learning-rate groups) are the kind's own; SD 1.5's continued run loads
# the file into the network built from the flags (one loader for every type: ``AdapterNetwork.load_weights``).
# The other types' SD 1.5 files are the SDXL ones' code with the kind's module names, which the layout and merge
# tests check for every type on both kinds. ``pytest --full_matrix`` trains every type on both kinds.
SD15_TRAINED = ("lora_blocks",)
TRAINED_CASES = [(variant, kind) for kind in ("sdxl", "sd15") for variant in TRAINED
                 if full_matrix() or kind == "sdxl" or variant in SD15_TRAINED]


def build_models(kind: str):
    from tools.build_tiny_models import tiny_sd, tiny_sdxl

    return tiny_sdxl() if kind == "sdxl" else tiny_sd("sd1")


def unet_names(models):
    return checkpoint_keys.unet_module_name_map(models.unet.config) if models.is_sdxl else None


def make_network(variant: str, models, multiplier: float = 1.0) -> network_base.AdapterNetwork:
    module, dim, args = VARIANTS[variant]
    network_args = network_base.parse_network_args(args)
    return registry.network_type(module).create_network(multiplier, dim, 1.0, None, models.text_encoders, models.unet,
                                                        unet_module_names=unet_names(models), **network_args)


@pytest.fixture(scope="module", params=["sdxl", "sd15"])
def models(request):
    return build_models(request.param)


# --------------------------------------------------------------------------- the documented file layout
def expected_tensors(variant: str, lora_name: str, weight_shape: tuple[int, ...], dim: int) -> dict[str, tuple]:
    """The tensors docs/network_types.md lists for one module wrapping a weight of ``weight_shape``."""
    module, _, args = VARIANTS[variant]
    out_dim, in_dim, kernel = weight_shape[0], weight_shape[1], weight_shape[2:]
    is_conv = len(weight_shape) == 4
    is_3x3 = is_conv and kernel != (1, 1)
    tucker = "use_tucker=True" in args and is_3x3
    if module in ("networks.lora", "networks.dylora", "networks.lora_fa"):
        return {"lora_down.weight": (dim, in_dim, *kernel), "lora_up.weight": (out_dim, dim, *((1, 1) if is_conv else ())),
                "alpha": ()}
    if module == "networks.loha":
        if tucker:
            pair = {"t": (dim, dim, *kernel), "w_a": (dim, out_dim), "w_b": (dim, in_dim)}
        else:
            pair = {"w_a": (out_dim, dim), "w_b": (dim, in_dim * math.prod(kernel))}
        tensors = {f"hada_{name.replace('w_', f'w{i}_').replace('t', f't{i}')}": shape
                   for i in (1, 2) for name, shape in pair.items()}
        return {**tensors, "alpha": ()}
    if module == "networks.lokr":
        factor = -1 if "factor=4" not in args else 4
        in_m, in_n = lokr.factorization(in_dim, factor)
        out_l, out_k = lokr.factorization(out_dim, factor)
        tensors = {"lokr_w1": (out_l, in_m), "alpha": ()}
        if dim >= max(out_k, in_n) / 2:
            tensors["lokr_w2"] = (out_k, in_n, *(kernel if is_3x3 else ()))
        elif tucker:
            tensors.update(lokr_t2=(dim, dim, *kernel), lokr_w2_a=(dim, out_k), lokr_w2_b=(dim, in_n))
        else:
            tensors.update(lokr_w2_a=(out_k, dim), lokr_w2_b=(dim, in_n * math.prod(kernel)))
        return tensors
    assert lora_name.startswith("oft_unet_")
    return {"oft_blocks": (dim, out_dim // dim, out_dim // dim), "alpha": ()}


def module_kind(lora_name: str, weight_shape: tuple[int, ...]) -> str:
    if lora_name.startswith("lora_te"):
        return "text encoder"
    if len(weight_shape) == 2:
        return "linear"
    return "conv1x1" if weight_shape[2:] == (1, 1) else "conv3x3"


@pytest.mark.parametrize("variant", VARIANTS)
def test_file_layout_matches_the_documented_convention(variant, models):
    network = make_network(variant, models)
    state = network.lora_state_dict()
    assert all(value.dtype == torch.float32 for value in state.values())
    kinds = set()
    for lora in network.all_loras():
        shape = tuple(network.wrapped_module(lora).weight.shape)
        kinds.add(module_kind(lora.lora_name, shape))
        own = {key.partition(".")[2]: tuple(value.shape) for key, value in state.items()
               if key.partition(".")[0] == lora.lora_name}
        assert own == expected_tensors(variant, lora.lora_name, shape, lora.lora_dim), lora.lora_name
    # kohya's OFT has no text encoder modules
    assert kinds == {"linear", "conv1x1", "conv3x3", *(["text encoder"] if variant != "oft" else [])}
    prefixes = {lora.lora_name.split("_")[1] for lora in network.text_encoder_loras}
    if variant != "oft":  # kohya's DyLoRA writes lora_te_ for both SDXL encoders; we do not
        assert prefixes == ({"te1", "te2"} if models.is_sdxl else {"te"})
    if models.is_sdxl:  # UNet modules named after the original (SGM) layout, as kohya's SDXL trainer
        assert any("_input_blocks_4_1_" in lora.lora_name for lora in network.unet_loras)


def test_lokr_factorization_is_kohyas():
    # kohya's docs/loha_lokr.md examples
    assert [lokr.factorization(d) for d in (128, 512, 1024)] == [(8, 16), (16, 32), (32, 32)]
    assert [lokr.factorization(d, 4) for d in (128, 512)] == [(4, 32), (4, 128)]
    assert lokr.factorization(7) == (1, 7) and lokr.factorization(512, 3) == (2, 256)


def test_block_wise_lora_ranks_and_learning_rates(models):
    from networks import lora

    is_sdxl = models.is_sdxl
    count, sides, mid = (23, 9, 3) if is_sdxl else (25, 12, 1)
    dims = [2 + index % 3 for index in range(count)]
    # kohya's layout: [embeddings (SDXL)] + down + mid + up [+ out (SDXL)]
    lr_weights = ([1.0] if is_sdxl else []) + [0.5] * sides + [1.0] * mid + [0.0] * sides + ([1.0] if is_sdxl else [])
    network = lora.create_network(
        1.0, 4, 1.0, None, models.text_encoders, models.unet, unet_module_names=unet_names(models),
        block_dims=",".join(map(str, dims)), down_lr_weight=",".join(["0.5"] * sides),
        up_lr_weight=",".join(["0.1"] * sides), block_lr_zero_threshold="0.2")  # up: 0.1 is not above 0.2 -> 0
    indices = [lora.block_index(module.lora_name, is_sdxl) for module in network.unet_loras]
    assert {lr_weights[index] for index in indices} == {0.5, 1.0}  # down and mid trained, up cut
    for module, index in zip(network.unet_loras, indices):
        assert (module.lora_dim, module.lr_weight, module.lr_block) == (dims[index], lr_weights[index], index)
    assert all(module.lora_dim == 4 for module in network.text_encoder_loras)  # text encoders: not block-wise
    groups = network.prepare_optimizer_params(None, 1e-3, 1e-4)
    unet_ids = {id(p) for module in network.unet_loras for p in module.parameters()}
    unet_groups = [group for group in groups if id(group["params"][0]) in unet_ids]
    assert len(unet_groups) == len(set(indices))  # one group per block, as kohya
    assert {group["lr"] for group in unet_groups} == {5e-4, 1e-3}


def test_booleans_are_read_as_the_gui_writes_them(models):
    for text, with_convs in (("False", False), ("false", False), ("0", False), ("True", True), ("1", True)):
        network = registry.network_type("networks.oft").create_network(
            1.0, 4, 1e-3, None, models.text_encoders, models.unet, unet_module_names=unet_names(models),
            enable_conv=text)
        has_3x3 = any(network.wrapped_module(m).weight.dim() == 4 and network.wrapped_module(m).weight.shape[2] == 3
                      for m in network.unet_loras)
        assert has_3x3 == with_convs, text


# --------------------------------------------------------------------------- merging
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", ["sdxl", "sd15"])
def test_merged_model_reproduces_base_plus_network(variant, kind, tmp_path):
    models = build_models(kind)
    network = make_network(variant, models, multiplier=0.7)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in network.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    network.eval()
    path = tmp_path / "net.safetensors"
    module, _, args = VARIANTS[variant]
    network_base.save_lora_file(network.lora_state_dict(), str(path), {
        "ss_network_module": module, "ss_network_args": json.dumps(network_base.parse_network_args(args))})
    cast_models(models, torch.float64)
    network.double()  # the file's float32 values, exactly
    with torch.no_grad():
        base = model_outputs(models)
        network.apply_to()
        applied = model_outputs(models)
        network.restore()
        merged_count = merge_lora.merge_into_models(models, [str(path)], [0.7])
        merged = model_outputs(models)
    assert merged_count == len(network.all_loras())
    effects = [float((from_network - from_base).abs().max()) for from_network, from_base in zip(applied, base)]
    assert effects[-1] > 1e-2  # the network changes the UNet (and the text encoders, but for OFT)
    for from_merge, from_network, effect in zip(merged, applied, effects):
        assert float((from_merge - from_network).abs().max()) <= merge_rounding_bound(torch.float64) * effect


# --------------------------------------------------------------------------- training
def train_args(tiny_models, dataset: Path, kind: str, variant: str, output_dir: Path, *extra: str) -> list[str]:
    module, dim, args = VARIANTS[variant]
    return model_args(tiny_models, kind) + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", "net", "--seed", "3", "--max_data_loader_n_workers", "0",
        "--network_module", module, "--network_dim", str(dim), "--network_alpha", "1" if module != "networks.oft" else "0.01",
        "--network_args", *args, "--learning_rate", "1e-2", "--max_train_steps", "3", "--save_state",
        "--save_every_n_steps", "2", "--log_jsonl", str(output_dir / "log.jsonl"), *extra,
    ]


@pytest.fixture(scope="module")
def trained(tiny_models, one_image_dataset, tmp_path_factory):
    """variant, kind -> output folder of a 3-step run (state at step 2, final file net.safetensors)."""
    return trainings_run_once(tmp_path_factory, lambda variant, kind, output_dir: train_args(
        tiny_models, one_image_dataset, kind, variant, output_dir))


def test_dylora_trains_the_same_with_gradient_checkpointing(trained, tiny_models, one_image_dataset, tmp_path):
    """The recomputation of a checkpointed block draws the rank its forward drew (kohya's Python-random draw
    does not: 0.04 apart after these 3 steps), so checkpointing changes no bit of a DyLoRA."""
    run_trainer("sdxl_train_network", train_args(tiny_models, one_image_dataset, "sdxl", "dylora", tmp_path,
                                                 "--gradient_checkpointing"))
    plain = read_lora_file(str(trained("dylora", "sdxl") / "net.safetensors"))
    checkpointed = read_lora_file(str(tmp_path / "net.safetensors"))
    assert plain.keys() == checkpointed.keys()
    assert all(torch.equal(plain[key], checkpointed[key]) for key in plain)


ZERO_INIT = {"networks.lora": "lora_up.weight", "networks.dylora": "lora_up.weight", "networks.lora_fa": "lora_up.weight",
             "networks.loha": "hada_w2_a", "networks.lokr": ("lokr_w2", "lokr_w2_b"), "networks.oft": "oft_blocks"}


@pytest.mark.parametrize(("variant", "kind"), TRAINED_CASES)
def test_trains_and_writes_the_networks_keys(variant, kind, trained, monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    output_dir = trained(variant, kind)
    losses = [json.loads(line)["loss/current"] for line in (output_dir / "log.jsonl").read_text().splitlines()]
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
    weights = read_lora_file(str(output_dir / "net.safetensors"))
    module = VARIANTS[variant][0]
    assert read_lora_metadata(str(output_dir / "net.safetensors"))["ss_network_module"] == module
    assert all(bool(torch.isfinite(value).all()) for value in weights.values())
    # weights move: the tensors that start at zero do not stay there
    moved = [value for key, value in weights.items() if key.endswith(ZERO_INIT[module])]
    assert moved and sum(bool(value.abs().max() > 0) for value in moved) > len(moved) // 2
    # the file holds exactly this type's network for that model (keys and shapes)
    network = make_network(variant, build_models(kind))
    expected = network.lora_state_dict()
    if variant == "lora_blocks":  # block-wise: the trainer's module selection is the network's
        assert set(weights) == set(expected)
    assert {key: tuple(value.shape) for key, value in weights.items()} == \
        {key: tuple(value.shape) for key, value in expected.items()}


@pytest.mark.parametrize(("variant", "kind"), TRAINED_CASES)
def test_resume_gives_identical_bytes(variant, kind, trained, tiny_models, one_image_dataset, tmp_path):
    reference = trained(variant, kind)
    resumed = tmp_path / "resumed"
    shutil.copytree(reference, resumed)
    (resumed / "net.safetensors").unlink()
    for extra in resumed.glob("net-step*.safetensors"):
        extra.unlink()
    run_trainer(TRAIN_SCRIPTS[kind], train_args(tiny_models, one_image_dataset, kind, variant, resumed,
                                          "--resume", str(resumed / "net-step00000002-state")))
    assert (resumed / "net.safetensors").read_bytes() == (reference / "net.safetensors").read_bytes()


@pytest.mark.parametrize(("variant", "kind"), TRAINED_CASES)
def test_continues_from_a_file(variant, kind, trained, tiny_models, one_image_dataset, tmp_path):
    source = trained(variant, kind) / "net.safetensors"
    extra = ["--network_weights", str(source), "--max_train_steps", "1"]
    if kind == "sdxl":
        extra.append("--dim_from_weights")
    argv = train_args(tiny_models, one_image_dataset, kind, variant, tmp_path, *extra)
    argv = [item for item in argv if item not in ("--save_state",)]
    run_trainer(TRAIN_SCRIPTS[kind], argv)
    before, after = read_lora_file(str(source)), read_lora_file(str(tmp_path / "net.safetensors"))
    assert {key: value.shape for key, value in before.items()} == {key: value.shape for key, value in after.items()}
    changed = [key for key in before if not torch.equal(before[key], after[key])]
    assert changed  # it trained on from the file's values ...
    assert all(float((after[key] - before[key]).abs().max()) < 0.5 for key in before)  # ... not from scratch
    if variant == "lora_fa":  # the frozen down projection stays what the file holds
        assert all(torch.equal(before[key], after[key]) for key in before if key.endswith("lora_down.weight"))


def test_merge_lora_writes_a_checkpoint_with_the_network_merged(trained, tiny_models, tmp_path):
    source = trained("lokr", "sdxl") / "net.safetensors"
    merged_file = tmp_path / "merged.safetensors"
    merge_lora.main(["--sd_model", str(tiny_models["sdxl_file"]), "--model_config_dir",
                     str(tiny_models["sdxl_config"]), "--save_to", str(merged_file), "--models", str(source)])
    load = dict(sdxl=True, model_config_dir=tiny_models["sdxl_config"])
    base = model_loading.load_models(tiny_models["sdxl_file"], **load)
    network = registry.network_from_file(str(source), base.text_encoders, base.unet, unet_names(base), "--models")
    network.eval()
    network.apply_to()
    with torch.no_grad():
        expected = model_outputs(base)
        merged = model_outputs(model_loading.load_models(merged_file, **load))
    for a, b in zip(merged, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


# --------------------------------------------------------------------------- tools and refusals
def test_tools_read_every_type(trained, tmp_path, capsys):
    from networks import check_lora_weights, resize_lora
    from tools import show_metadata

    for variant in ("loha", "oft", "dylora"):
        path = trained(variant, "sdxl") / "net.safetensors"
        assert check_lora_weights.main([str(path)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert len([line for line in lines if not line.startswith("#")]) - 1 == \
            len(network_base.group_by_module(read_lora_file(str(path))))
        described = show_metadata.describe(path)
        assert described["metadata"]["ss_network_module"] == VARIANTS[variant][0]
        assert described["network"]["type"] == VARIANTS[variant][0]
    check_lora_weights.main([str(trained("oft", "sdxl") / "net.safetensors")])
    assert ",n/a" in capsys.readouterr().out  # OFT's change depends on the base weight
    with pytest.raises(UserError, match="a networks.loha file; resizing works on LoRA/LoCon files only"):
        resize_lora.main(["--model", str(trained("loha", "sdxl") / "net.safetensors"), "--save_to",
                          str(tmp_path / "r.safetensors"), "--new_rank", "2"])
    resize_lora.main(["--model", str(trained("dylora", "sdxl") / "net.safetensors"), "--save_to",
                      str(tmp_path / "r.safetensors"), "--new_rank", "2"])  # DyLoRA files are LoRA files


@pytest.mark.parametrize("variant, extra, message", [
    ("loha", ["--network_args", "conv_dim=2", "dora_wd=True"], "unknown key dora_wd for networks.loha (valid: conv_dim"),
    ("lokr", ["--network_args", "factor=x"], "--network_args factor=x is not a int"),
    ("dylora", ["--network_args", "unit=0"], "unit=0"),
    ("oft", ["--network_args", "enable_conv=maybe"], "enable_conv=maybe is not a boolean"),
    ("oft", ["--network_args", "loraplus_lr_ratio=4"], "unknown key loraplus_lr_ratio for networks.oft"),
    ("lora_fa", ["--network_args", "block_dims=1,x"], "block_dims=1,x: 'x' is not a int"),
    ("loha", ["--scale_weight_norms", "1"], "--scale_weight_norms: networks.loha does not support max-norm"),
    ("oft", ["--network_train_text_encoder_only"], "networks.oft: no modules in the parts being trained"),
    ("oft", ["--network_dim", "5"], "--network_dim 5: networks.oft splits"),
])
def test_bad_network_settings_are_one_line_errors(variant, extra, message, tiny_models, one_image_dataset, tmp_path,
                                                 capsys):
    argv = train_args(tiny_models, one_image_dataset, "sdxl", variant, tmp_path, "--max_train_steps", "1")
    if extra[0] == "--network_args":  # replace the variant's arguments
        start = argv.index("--network_args")
        end = next(i for i in range(start + 1, len(argv)) if argv[i].startswith("--"))
        argv = argv[:start] + argv[end:]
    error = train_expecting_user_error(argv + extra, capsys)
    assert message in error
    assert not (tmp_path / "net.safetensors").exists()
