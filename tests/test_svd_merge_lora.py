"""networks/svd_merge_lora.py: files of several types and ranks merged into one LoRA by SVD, without a base
model; the printed errors are the real ones, full rank reproduces the summed change, --lbws scales the
modules kohya's rule assigns (a table measured with kohya's own get_lbw_block_index), bad input is one line."""
from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_convert_to_lora import random_network_file

from library import model_loading
from library.errors import UserError
from networks import loha, lokr, svd_merge_lora
from networks.lora import lora_delta, lora_modules
from networks.network_base import read_lora_file, read_lora_metadata

REPO = Path(__file__).resolve().parent.parent
EPS32 = torch.finfo(torch.float32).eps
FILES = {  # name -> (--network_module, --network_args): network_dim 4 each, conv ranks differ
    "lora": ("networks.lora", ["conv_dim=3", "conv_alpha=1"]),
    "loha": ("networks.loha", ["conv_dim=2", "conv_alpha=1"]),
    "lokr": ("networks.lokr", ["conv_dim=2"]),
}
RATIOS = {"lora": 1.0, "loha": 0.5, "lokr": -0.7}

# kohya's block of a module (svd_merge_lora.get_lbw_block_index on the tiny models' modules, measured in the
# harness): one module per block, as (name, slot in BASE IN00..IN11 MID OUT00..OUT11).
KOHYA_SDXL_BLOCKS = [
    ("lora_te1_text_model_encoder_layers_0_mlp_fc1", 0), ("lora_te2_text_model_encoder_layers_0_mlp_fc1", 0),
    ("lora_unet_input_blocks_1_0_emb_layers_1", 2), ("lora_unet_input_blocks_3_0_op", 4),
    ("lora_unet_input_blocks_4_0_emb_layers_1", 5), ("lora_unet_input_blocks_5_0_emb_layers_1", 6),
    ("lora_unet_input_blocks_6_0_op", 7), ("lora_unet_input_blocks_8_0_emb_layers_1", 9),
    ("lora_unet_middle_block_0_emb_layers_1", 13), ("lora_unet_output_blocks_0_0_emb_layers_1", 14),
    ("lora_unet_output_blocks_5_0_emb_layers_1", 19), ("lora_unet_output_blocks_8_0_emb_layers_1", 22),
]
KOHYA_SD15_BLOCKS = [
    ("lora_te_text_model_encoder_layers_0_mlp_fc1", 0), ("lora_unet_down_blocks_0_attentions_0_proj_in", 2),
    ("lora_unet_down_blocks_0_downsamplers_0_conv", 4), ("lora_unet_down_blocks_2_attentions_1_proj_in", 9),
    ("lora_unet_down_blocks_3_resnets_1_conv1", 12), ("lora_unet_mid_block_attentions_0_proj_in", 13),
    ("lora_unet_up_blocks_0_resnets_2_conv1", 16), ("lora_unet_up_blocks_3_attentions_2_proj_in", 25),
]


@pytest.fixture(scope="module")
def network_files(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """Random-weight network files of each type in FILES on the tiny SDXL, an OFT one, and an SD1.5 LoRA."""
    root = tmp_path_factory.mktemp("svd_merge")
    sdxl = model_loading.load_models(tiny_models["sdxl"], sdxl=True)
    files = {}
    for name, (module, args) in {**FILES, "oft": ("networks.oft", [])}.items():
        files[name] = root / f"{name}.safetensors"
        random_network_file(sdxl, module, args, files[name])
    files["sd15"] = root / "sd15.safetensors"
    random_network_file(model_loading.load_models(tiny_models["sd15"], sdxl=False), "networks.lora",
                        ["conv_dim=2", "conv_alpha=1"], files["sd15"])
    return files


def file_deltas(path: Path) -> dict[str, torch.Tensor]:
    """Each module's change from the file's tensors with the types' own formulas, (out, in*kh*kw) float64."""
    module = read_lora_metadata(str(path))["ss_network_module"]
    weights = read_lora_file(str(path))
    if module == "networks.lora":
        return {name: lora_delta(parts, torch.float64).reshape(parts["up"].shape[0], -1)
                for name, parts in lora_modules(weights).items()}
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in weights.items():
        name, _, tensor = key.partition(".")
        grouped.setdefault(name, {})[tensor] = value.double()
    formula = {"networks.loha": loha.module_delta, "networks.lokr": lokr.module_delta}[module]
    return {name: formula(parts).double().reshape(formula(parts).shape[0], -1) for name, parts in grouped.items()}


def summed_deltas(paths_and_factors) -> dict[str, torch.Tensor]:
    total: dict[str, torch.Tensor] = {}
    for path, factor in paths_and_factors:
        for name, delta in file_deltas(path).items():
            total[name] = total.get(name, 0) + factor * delta
    return total


def merge(network_files, tiny_models, out: Path, names, *extra: str, capsys=None) -> str:
    argv = ["--save_to", str(out), "--models", *(str(network_files[name]) for name in names),
            "--model_config_dir", str(tiny_models["sdxl_config"]), *extra]
    svd_merge_lora.main(argv)
    return capsys.readouterr().out if capsys is not None else ""


def test_printed_errors_equal_an_independent_measurement(network_files, tiny_models, tmp_path, capsys):
    out = tmp_path / "merged.safetensors"
    printed = merge(network_files, tiny_models, out, FILES, "--ratios", *(str(RATIOS[n]) for n in FILES),
                    "--new_rank", "3", "--new_conv_rank", "2", capsys=capsys)
    truth = summed_deltas((network_files[name], RATIOS[name]) for name in FILES)
    merged = lora_modules(read_lora_file(str(out)))
    assert set(merged) == set(truth)
    lines = dict(re.findall(r"^(\S+): rank \d+, relative error (\S+)$", printed, re.M))
    assert set(lines) == set(truth)
    squares = errors = 0.0
    for name, delta in truth.items():
        parts = merged[name]
        is_conv3x3 = parts["down"].dim() == 4 and parts["down"].shape[2] == 3
        assert parts["down"].shape[0] == min(2 if is_conv3x3 else 3, *parts["down"].shape[1:2], parts["up"].shape[0])
        error = float((lora_delta(parts, torch.float64).reshape(delta.shape) - delta).norm())
        # printed with 3 significant digits; the float32 factors add ~eps32 * ||delta|| to the error
        measured = error / float(delta.norm())
        assert abs(float(lines[name]) - measured) <= 5e-3 * measured + 10 * EPS32, name
        squares += float(delta.norm()) ** 2
        errors += error ** 2
    overall = float(re.search(r"overall relative error (\S+),", printed).group(1))
    assert 0.01 < overall < 1 and abs(overall - math.sqrt(errors / squares)) <= 5e-3 * overall


def test_full_rank_reproduces_the_summed_change(network_files, tiny_models, tmp_path, capsys):
    out = tmp_path / "full.safetensors"
    merge(network_files, tiny_models, out, FILES, "--ratios", *(str(RATIOS[n]) for n in FILES),
          "--new_rank", "100000", capsys=capsys)
    truth = summed_deltas((network_files[name], RATIOS[name]) for name in FILES)
    merged = lora_modules(read_lora_file(str(out)))
    for name, delta in truth.items():
        error = float((lora_delta(merged[name], torch.float64).reshape(delta.shape) - delta).norm())
        # float32 factors: each product term rounds at ~eps32; at most min(out, in) terms add up
        assert error <= 4 * EPS32 * math.sqrt(min(delta.shape)) * float(delta.norm()), name
        assert float(merged[name]["alpha"]) == merged[name]["down"].shape[0]  # scale 1, as kohya writes


@pytest.mark.parametrize("kind", ["sdxl", "sd15"])
def test_lbws_scale_the_modules_kohyas_rule_assigns(kind, network_files, tiny_models, tmp_path, capsys):
    """Every block gets its own weight (slot + 2); at full rank each module's change is its block's weight times
    the file's, for the modules measured with kohya's code; a module outside the preset keeps weight 1."""
    source = network_files["lora" if kind == "sdxl" else "sd15"]
    table, preset = (KOHYA_SDXL_BLOCKS, svd_merge_lora.lora_block_weights.TARGET_BLOCKS[20]) if kind == "sdxl" else (
        KOHYA_SD15_BLOCKS, svd_merge_lora.lora_block_weights.TARGET_BLOCKS[17])
    blocks = svd_merge_lora.lora_block_weights.BLOCKS
    lbw = [blocks.index(block) + 2 for block in preset]
    out = tmp_path / "lbw.safetensors"
    svd_merge_lora.main(["--save_to", str(out), "--models", str(source), "--new_rank", "100000",
                         "--model_config_dir", str(tiny_models[f"{kind}_config"]), "--lbws", str(lbw)])
    capsys.readouterr()
    truth = file_deltas(source)
    merged = lora_modules(read_lora_file(str(out)))
    for name, slot in table:
        expected = slot + 2 if blocks[slot] in preset else 1.0
        change = lora_delta(merged[name], torch.float64).reshape(truth[name].shape)
        error = float((change - expected * truth[name]).norm())
        assert error <= 4 * EPS32 * math.sqrt(min(change.shape)) * expected * float(truth[name].norm()), name
    assert kind == "sdxl" or blocks[4] not in preset  # the SD1.5 table holds a module outside the 17 preset


def test_metadata_is_kohyas(network_files, tiny_models, tmp_path, capsys):
    out = tmp_path / "meta.safetensors"
    merge(network_files, tiny_models, out, ["lora", "loha"], "--new_rank", "3", "--new_conv_rank", "2",
          "--save_precision", "fp16", capsys=capsys)
    metadata = read_lora_metadata(str(out))
    assert {key: metadata[key] for key in ("ss_network_module", "ss_network_dim", "ss_network_alpha",
                                           "ss_network_args", "ss_base_model_version")} == {
        "ss_network_module": "networks.lora", "ss_network_dim": "3", "ss_network_alpha": "3",
        "ss_network_args": '{"conv_dim": 2, "conv_alpha": 2}', "ss_base_model_version": "sdxl_base_v1-0"}
    assert metadata["modelspec.title"] == "meta" and metadata["modelspec.merged_from"] == "lora, loha"
    assert metadata["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert {"sshs_model_hash", "sshs_legacy_hash"} <= set(metadata)
    assert all(value.dtype == torch.float16 for value in read_lora_file(str(out)).values())
    bare = tmp_path / "bare.safetensors"
    merge(network_files, tiny_models, bare, ["lora"], "--no_metadata", capsys=capsys)
    bare_metadata = read_lora_metadata(str(bare))
    assert not any(key.startswith("modelspec.") for key in bare_metadata)
    assert {"ss_network_dim", "sshs_model_hash"} <= set(bare_metadata)


def test_base_dependent_types_need_the_base_model(network_files, tiny_models, tmp_path, capsys):
    out = tmp_path / "oft.safetensors"
    with pytest.raises(UserError, match="depends on the base weights.*--sd_model"):
        merge(network_files, tiny_models, out, ["lora", "oft"])
    assert not out.exists()
    printed = merge(network_files, tiny_models, out, ["lora", "oft"], "--sd_model", str(tiny_models["sdxl_file"]),
                    "--new_rank", "2", capsys=capsys)
    assert out.exists() and "overall relative error" in printed


def test_bad_input_is_one_line_before_any_work(network_files, tiny_models, tmp_path):
    out = tmp_path / "x.safetensors"
    lora, sd15 = str(network_files["lora"]), str(network_files["sd15"])
    cases = [
        (["--models", str(tmp_path / "missing.safetensors")], "--models .*missing.safetensors does not exist"),
        (["--models", lora, sd15], "--models .*sd15.safetensors is a network for SD1.x"),
        (["--models", lora, lora, "--ratios", "1"], "--ratios: 1 value"),
        (["--models", lora, "--lbws", "[1]", "[1]"], "--lbws: 2 list"),
        (["--models", lora, "--lbws", "[1,2"], "--lbws .*JSON list of numbers"),
        (["--models", lora, "--lbws", "[1,1,1]"], "--lbws .*3 numbers"),
        (["--models", lora, "--lbws", str([1] * 17)], "--lbws: 17 numbers is the SD1.x/2.x preset"),
        (["--models", lora, "--new_rank", "0"], "--new_rank must be a rank >= 1"),
        (["--models", lora, "--new_conv_rank", "-1"], "--new_conv_rank must be a rank >= 1"),
        # no --model_config_dir: the shipped (full-size) SDXL architecture, which the tiny files do not fit
        (["--models", lora], "--models .*lora.safetensors does not fit the SDXL architecture .*--model_config_dir"),
    ]
    for argv, message in cases:
        with pytest.raises(UserError, match=message):
            svd_merge_lora.main(["--save_to", str(out), *argv])
    weights = read_lora_file(lora)
    weights[next(key for key in weights if key.endswith("lora_up.weight"))][0, 0] = float("nan")
    diverged = tmp_path / "diverged.safetensors"
    save_file(weights, str(diverged), read_lora_metadata(lora))
    with pytest.raises(UserError, match="diverged.safetensors: module .* holds NaN/Inf"):
        svd_merge_lora.main(["--save_to", str(out), "--models", lora, str(diverged), "--model_config_dir",
                             str(tiny_models["sdxl_config"])])
    with pytest.raises(UserError, match="--save_to .* same file as --models"):
        svd_merge_lora.main(["--save_to", lora, "--models", lora])
    assert not out.exists()
    result = subprocess.run([sys.executable, str(REPO / "networks" / "svd_merge_lora.py"), "--save_to", str(out),
                             "--models", lora, "--ratios", "1", "2"], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--ratios" in result.stderr
