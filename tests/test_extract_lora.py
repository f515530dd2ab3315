"""networks/extract_lora_from_models.py: a LoRA merged into a base is extracted back from (base, merged), with
kohya's module set, names, ranks, alphas and metadata; the text encoders are skipped under --min_diff;
bad inputs are one line and exit code 2 before any model is read. kohya's own tool is compared on
full-size files by benchmarks/bench_extract_lora.py (its loaders only know the real architectures)."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from library import checkpoint_keys, model_loading
from library.errors import UserError
from library.model_weights import ModelWeights
from networks import extract_lora_from_models as extract
from networks import lora, merge_lora, network_base
from networks.lora import lora_delta, lora_modules, read_lora_file

REPO_ROOT = Path(__file__).resolve().parent.parent
RANK = 2
EPS = torch.finfo(torch.float32).eps
KOHYA_MINIMAL_METADATA = {"ss_v2", "ss_base_model_version", "ss_network_module", "ss_network_dim", "ss_network_alpha",
                          "ss_network_args", "sshs_model_hash", "sshs_legacy_hash"}
KOHYA_MODELSPEC = {"modelspec.sai_model_spec", "modelspec.architecture", "modelspec.implementation", "modelspec.title",
                   "modelspec.resolution", "modelspec.date", "modelspec.prediction_type"}


def kind_flags(name: str) -> list[str]:
    return ["--sdxl"] if name == "sdxl" else []


def load_tiny(tiny_models, name: str) -> model_loading.StableDiffusionModels:
    return model_loading.load_models(tiny_models[f"{name}_file"], sdxl=name == "sdxl",
                                     model_config_dir=tiny_models[f"{name}_config"],
                                     tokenizer_cache_dir=tiny_models["tokenizers"])


def trainer_network(models, dim: int, conv_dim: int | None = None) -> network_base.AdapterNetwork:
    """The trainer's LoRA network (kohya's module set) with --network_dim/--network_alpha dim."""
    names = checkpoint_keys.unet_module_name_map(models.unet.config) if models.is_sdxl else None
    conv = {} if conv_dim is None else {"conv_dim": str(conv_dim), "conv_alpha": str(conv_dim)}
    return lora.create_network(1.0, dim, dim, None, models.text_encoders, models.unet, unet_module_names=names, **conv)


@pytest.fixture(scope="module")
def tuned_models(tiny_models, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Per kind: (a random rank-2 LoRA on the text encoders and UNet, the base with it merged in)."""
    root = tmp_path_factory.mktemp("extract_lora")
    made = {}
    for name in ("sdxl", "sd15"):
        network = trainer_network(load_tiny(tiny_models, name), RANK)
        generator = torch.Generator().manual_seed(5)
        # Factors of 0.2: every weight change is well above --min_diff's 0.01 somewhere.
        weights = {key: value.float() if key.endswith("alpha") else torch.randn(value.shape, generator=generator) * 0.2
                   for key, value in network.state_dict().items()}
        lora_file, tuned = root / f"{name}_lora.safetensors", root / f"{name}_tuned.safetensors"
        network_base.save_lora_file(weights, str(lora_file), {"ss_network_module": "networks.lora"})
        merge_lora.main(["--sd_model", str(tiny_models[f"{name}_file"]), "--model_config_dir",
                         str(tiny_models[f"{name}_config"]), "--tokenizer_cache_dir", str(tiny_models["tokenizers"]),
                         "--save_to", str(tuned), "--models", str(lora_file), *kind_flags(name)])
        made[name] = (lora_file, tuned)
    return made


def run_extract(tiny_models, name: str, org: Path, tuned: Path, out: Path, *extra: str) -> dict[str, torch.Tensor]:
    extract.main(["--model_org", str(org), "--model_tuned", str(tuned), "--save_to", str(out),
                  "--model_config_dir", str(tiny_models[f"{name}_config"]), *kind_flags(name), *extra])
    return read_lora_file(str(out))


def module_bound(weight_norm: float, delta: torch.Tensor) -> float:
    """What float32 allows between a LoRA delta and the one extracted from the stored weights: the merged
    weight's rounding (eps/2 per element of W + delta, at most twice through the rank-r truncation) plus the
    float32 SVD and the float32 factors (a few eps x sqrt(size) x ||delta||)."""
    size = max(delta.reshape(delta.shape[0], -1).shape)
    return EPS * (weight_norm + 4 * math.sqrt(size) * float(delta.norm()))


@pytest.mark.parametrize("name", ["sdxl", "sd15"])
def test_known_delta_recovered(name, tiny_models, tuned_models, tmp_path):
    lora_file, tuned = tuned_models[name]
    out = tmp_path / "extracted.safetensors"
    extracted = lora_modules(run_extract(tiny_models, name, tiny_models[f"{name}_file"], tuned, out,
                                         "--dim", str(RANK), "--clamp_quantile", "1"))
    source = lora_modules(read_lora_file(str(lora_file)))
    assert set(extracted) == set(source)
    models = load_tiny(tiny_models, name)
    unet, text_encoders = extract.architecture(
        extract.setup_parser().parse_args(["--model_org", str(tiny_models[f"{name}_file"]), "--model_tuned", "x",
                                           "--save_to", "y", "--model_config_dir", str(tiny_models[f"{name}_config"])]),
        models.kind)
    text_targets, unet_targets = extract.extract_targets(unet, text_encoders, models.kind, with_convs=False)
    worst = 0.0
    with ModelWeights(tuned, "tuned", models.kind, (unet, text_encoders)) as tuned_weights:
        for target in [*text_targets, *unet_targets]:
            expected = lora_delta(source[target.lora_name], torch.float64)
            got = lora_delta(extracted[target.lora_name], torch.float64)
            weight_norm = float(tuned_weights.get(target.component, target.weight_name).double().norm())
            error = float((got - expected).norm())
            assert error <= module_bound(weight_norm, expected), target.lora_name
            assert float(extracted[target.lora_name]["alpha"]) == RANK  # kohya: alpha = rank, scale 1
            worst = max(worst, error / float(expected.norm()))
    assert worst < 1e-5
    # The trainer's --network_weights loader takes it as a LoRA of --network_dim/--network_alpha RANK.
    trainer_network(models, RANK).load_weights(str(out))
    with safe_open(str(out), "pt") as handle:
        metadata = handle.metadata()
    assert KOHYA_MINIMAL_METADATA | KOHYA_MODELSPEC == set(metadata)
    assert metadata["ss_network_dim"] == str(RANK) and metadata["ss_network_alpha"] == f"{float(RANK)}"
    assert metadata["ss_base_model_version"] == ("sdxl_base_v1-0" if name == "sdxl" else "sd_v1")
    assert metadata["ss_network_args"] == "{}" and metadata["ss_v2"] == "False"
    assert metadata["modelspec.title"] == "extracted"


def test_merging_the_extracted_lora_gives_the_tuned_model(tiny_models, tuned_models, tmp_path):
    _, tuned = tuned_models["sd15"]
    out = tmp_path / "extracted.safetensors"
    run_extract(tiny_models, "sd15", tiny_models["sd15_file"], tuned, out, "--dim", str(RANK), "--clamp_quantile", "1")
    merged = tmp_path / "merged.safetensors"
    merge_lora.main(["--sd_model", str(tiny_models["sd15_file"]), "--model_config_dir", str(tiny_models["sd15_config"]),
                     "--tokenizer_cache_dir", str(tiny_models["tokenizers"]), "--save_to", str(merged),
                     "--models", str(out)])
    with safe_open(str(merged), "pt") as ours, safe_open(str(tuned), "pt") as expected, \
            safe_open(str(tiny_models["sd15_file"]), "pt") as base:
        assert set(ours.keys()) == set(expected.keys())
        for key in expected.keys():
            want, got, org = (handle.get_tensor(key).double() for handle in (expected, ours, base))
            if want.dim() < 2:
                assert torch.equal(got, want), key
                continue
            size = max(want.reshape(want.shape[0], -1).shape)
            bound = EPS * (2 * float(want.norm()) + 4 * math.sqrt(size) * (float(want.norm()) + float(org.norm())))
            assert float((got - want).norm()) <= bound, key


def test_diffusers_folder_input_matches_single_file(tiny_models, tuned_models, tmp_path):
    _, tuned = tuned_models["sdxl"]
    from_file = run_extract(tiny_models, "sdxl", tiny_models["sdxl_file"], tuned, tmp_path / "a.safetensors",
                            "--dim", str(RANK), "--clamp_quantile", "1")
    from_folder = run_extract(tiny_models, "sdxl", tiny_models["sdxl"], tuned, tmp_path / "b.safetensors",
                              "--dim", str(RANK), "--clamp_quantile", "1")
    assert set(from_file) == set(from_folder)
    for name, parts in lora_modules(from_file).items():
        expected = lora_delta(parts, torch.float64)
        got = lora_delta(lora_modules(from_folder)[name], torch.float64)
        assert float((got - expected).norm()) <= 8 * EPS * math.sqrt(max(expected.shape)) * float(expected.norm())


def test_min_diff_skips_the_text_encoders(tiny_models, tuned_models, tmp_path):
    _, tuned = tuned_models["sd15"]
    weights = run_extract(tiny_models, "sd15", tiny_models["sd15_file"], tuned, tmp_path / "unet.safetensors",
                          "--min_diff", "1000")
    names = set(lora_modules(weights))
    assert names and all(name.startswith("lora_unet_") for name in names)
    with_text = lora_modules(run_extract(tiny_models, "sd15", tiny_models["sd15_file"], tuned,
                                         tmp_path / "all.safetensors"))
    assert {name for name in with_text if name.startswith("lora_unet_")} == names
    assert any(name.startswith("lora_te_") for name in with_text)
    # Default --dim 4 and --clamp_quantile 0.99: the delta is rank 2, the factors are clamped (kohya).
    assert all(parts["down"].shape[0] == 4 and float(parts["alpha"]) == 4 for parts in with_text.values())


def test_conv_dim_takes_kohya_conv_modules(tiny_models, tuned_models, tmp_path):
    _, tuned = tuned_models["sdxl"]
    out = tmp_path / "conv.safetensors"
    weights = run_extract(tiny_models, "sdxl", tiny_models["sdxl_file"], tuned, out, "--dim", "4", "--conv_dim", "3")
    trainer_network(load_tiny(tiny_models, "sdxl"), 4, conv_dim=3).load_weights(str(out))  # same keys and shapes
    conv_modules = [name for name, parts in lora_modules(weights).items() if parts["down"].dim() == 4
                    and tuple(parts["down"].shape[2:]) == (3, 3)]
    assert conv_modules and all(lora_modules(weights)[name]["down"].shape[0] == 3 for name in conv_modules)
    with safe_open(str(out), "pt") as handle:
        assert handle.metadata()["ss_network_args"] == '{"conv_dim": "3", "conv_alpha": "3.0"}'


def test_no_metadata_writes_kohya_minimal_keys(tiny_models, tuned_models, tmp_path):
    _, tuned = tuned_models["sd15"]
    out = tmp_path / "minimal.safetensors"
    run_extract(tiny_models, "sd15", tiny_models["sd15_file"], tuned, out, "--no_metadata", "--save_precision", "fp16")
    with safe_open(str(out), "pt") as handle:
        assert set(handle.metadata()) == KOHYA_MINIMAL_METADATA
        assert all(handle.get_tensor(key).dtype == torch.float16 for key in handle.keys())


@pytest.mark.parametrize("case", ["missing", "not_a_model", "dim_zero", "dim_negative", "output_is_input",
                                  "different_kinds", "kind_flag", "quantile"])
def test_bad_input_is_one_line_before_loading(case, tiny_models, tuned_models, tmp_path):
    _, tuned = tuned_models["sd15"]
    org, out = str(tiny_models["sd15_file"]), str(tmp_path / "out.safetensors")
    argv = {"missing": ["--model_org", str(tmp_path / "nope.safetensors"), "--model_tuned", str(tuned)],
            "not_a_model": ["--model_org", str(tmp_path), "--model_tuned", str(tuned)],
            "dim_zero": ["--model_org", org, "--model_tuned", str(tuned), "--dim", "0"],
            "dim_negative": ["--model_org", org, "--model_tuned", str(tuned), "--dim", "-3"],
            "output_is_input": ["--model_org", org, "--model_tuned", str(tuned)],
            "different_kinds": ["--model_org", str(tiny_models["sdxl_file"]), "--model_tuned", str(tuned)],
            "kind_flag": ["--model_org", org, "--model_tuned", str(tuned), "--sdxl"],
            "quantile": ["--model_org", org, "--model_tuned", str(tuned), "--clamp_quantile", "1.5"]}[case]
    expected = {"missing": "--model_org .* does not exist", "not_a_model": "--model_org .* not a diffusers model",
                "dim_zero": "--dim must be a rank >= 1", "dim_negative": "--dim must be a rank >= 1",
                "output_is_input": "--save_to .* same file as --model_tuned",
                "different_kinds": "is SDXL, --model_tuned .* is SD1.x", "kind_flag": "is SD1.x, not SDXL; drop",
                "quantile": "--clamp_quantile 1.5"}[case]
    save_to = str(tuned) if case == "output_is_input" else out
    with pytest.raises(UserError, match=expected):
        extract.main([*argv, "--save_to", save_to])
    assert not Path(out).exists()


def test_bad_input_exit_code(tmp_path):
    result = subprocess.run([sys.executable, str(REPO_ROOT / "networks" / "extract_lora_from_models.py"),
                             "--model_org", str(tmp_path / "a.safetensors"), "--model_tuned", str(tmp_path / "b"),
                             "--save_to", str(tmp_path / "out.safetensors")], capture_output=True, text=True)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "--model_org" in result.stderr


# kohya's extract tool's module lists on the real architectures (its own model classes and lora.create_network,
# built on the meta device in /work/harness_extract): (text encoder modules, UNet modules) without and with
# --conv_dim, and samples of (name, wrapped weight shape). Ours matched them in full (names and shapes).
KOHYA_MODULE_COUNTS = {("sdxl", False): (264, 722), ("sdxl", True): (264, 788),
                       ("sd1", False): (72, 192), ("sd1", True): (72, 278)}
KOHYA_MODULE_SAMPLES = {
    "sdxl": {"lora_te2_text_model_encoder_layers_6_mlp_fc2": (1280, 5120),
             "lora_unet_input_blocks_8_1_transformer_blocks_8_ff_net_0_proj": (10240, 1280),
             "lora_unet_input_blocks_4_1_proj_in": (640, 640),
             "lora_unet_input_blocks_3_0_op": (320, 320, 3, 3),
             "lora_unet_output_blocks_2_2_conv": (1280, 1280, 3, 3),
             "lora_unet_output_blocks_8_0_skip_connection": (320, 640, 1, 1),
             "lora_unet_middle_block_0_emb_layers_1": (1280, 1280)},
    "sd1": {"lora_te_text_model_encoder_layers_9_self_attn_k_proj": (768, 768),
            "lora_unet_up_blocks_2_resnets_0_conv_shortcut": (640, 1920, 1, 1),
            "lora_unet_down_blocks_2_downsamplers_0_conv": (1280, 1280, 3, 3),
            "lora_unet_mid_block_resnets_1_time_emb_proj": (1280, 1280)},
}


@pytest.mark.parametrize("kind", ["sdxl", "sd1"])
def test_full_size_module_set_is_kohyas(kind):
    unet, _, text_encoders, _ = model_loading.build_empty_models(kind, model_loading.shipped_config_dir(kind),
                                                                 with_vae=False)
    for with_convs in (False, True):
        text_targets, unet_targets = extract.extract_targets(unet, text_encoders, kind, with_convs)
        assert (len(text_targets), len(unet_targets)) == KOHYA_MODULE_COUNTS[(kind, with_convs)]
        shapes = {target.lora_name: target.shape for target in [*text_targets, *unet_targets]}
        assert len(shapes) == len(text_targets) + len(unet_targets)
    assert {name: shapes[name] for name in KOHYA_MODULE_SAMPLES[kind]} == KOHYA_MODULE_SAMPLES[kind]


def test_kohya_ss_gui_command_line(tiny_models, tuned_models, tmp_path):
    """The flags the kohya_ss GUI's Extract LoRA tab always passes (its defaults: dim and conv dim 128, fp16),
    here above the tiny modules' sizes, so every rank is capped at the module's (kohya's rule)."""
    _, tuned = tuned_models["sdxl"]
    out = tmp_path / "gui.safetensors"
    weights = run_extract(tiny_models, "sdxl", tiny_models["sdxl_file"], tuned, out,
                          "--load_precision", "fp16", "--save_precision", "fp16", "--dim", "128", "--device", "cpu",
                          "--clamp_quantile", "0.99", "--min_diff", "0.01", "--conv_dim", "128",
                          "--load_original_model_to", "cpu", "--load_tuned_model_to", "cpu")
    modules = lora_modules(weights)
    assert all(value.dtype == torch.float16 for value in weights.values())
    for parts in modules.values():
        rank = min(parts["up"].shape[0], parts["down"].shape[1])
        assert parts["down"].shape[0] == rank and float(parts["alpha"]) == rank
    assert any(name.startswith("lora_te2_") for name in modules)
