"""Offline LoRA tools on a really trained tiny-SDXL LoRA: show_metadata, check_lora_weights, resize_lora.

show_metadata.py runs as a process (stdout is its JSON, stderr one line on bad input: nothing else may print);
check_lora_weights.py and resize_lora.py run as ``__main__`` in this process (their exit codes and streams; their
launches as processes are tests/test_gui_lora_tools.py's), saving a process start each (the imports of torch)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import model_args, run_script_as_main, run_trainer

from library.errors import UserError
from networks import check_lora_weights, resize_lora
from networks.lora import lora_delta, lora_modules, read_lora_file
from tools import show_metadata

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def trained_lora(tiny_models, demo_dataset, tmp_path_factory) -> Path:
    """A tiny SDXL LoRA (rank 8, conv rank 4) after a few steps with a large learning rate."""
    output_dir = tmp_path_factory.mktemp("trained_lora")
    run_trainer("sdxl_train_network", model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(demo_dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", "tools", "--seed", "1", "--max_data_loader_n_workers", "0",
        "--network_dim", "8", "--network_alpha", "4", "--network_args", "conv_dim=4", "conv_alpha=2",
        "--learning_rate", "1e-2", "--max_train_steps", "4", "--training_comment", "for the tools",
    ])
    return output_dir / "tools.safetensors"


def run_script(path: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO_ROOT / path), *argv], capture_output=True, text=True)


def run_tool(path: str, *argv: str) -> subprocess.CompletedProcess:
    """The script file as ``__main__`` in this process, any exit code (see the module docstring)."""
    return run_script_as_main([sys.executable, str(REPO_ROOT / path), *argv], REPO_ROOT, expect=None)


# --------------------------------------------------------------------------- show_metadata


def test_show_metadata_parses_nested_json(trained_lora):
    result = run_script("tools/show_metadata.py", str(trained_lora))
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    metadata = shown["metadata"]
    assert metadata["ss_network_dim"] == "8" and metadata["ss_training_comment"] == "for the tools"
    assert metadata["ss_network_args"] == {"conv_dim": "4", "conv_alpha": "2"}  # a dict, not a string
    assert isinstance(metadata["ss_dataset_dirs"], dict)
    assert metadata["modelspec.architecture"] == "stable-diffusion-xl-v1-base/lora"
    assert shown["tensor_count"] == len(read_lora_file(str(trained_lora)))
    raw = show_metadata.describe(trained_lora, raw=True)["metadata"]
    assert json.loads(raw["ss_network_args"]) == metadata["ss_network_args"]
    with_tensors = show_metadata.describe(trained_lora, tensors=True)["tensors"]
    assert any(key.endswith(".lora_down.weight") and value.startswith("F32 [8,")
               for key, value in with_tensors.items())


def test_show_metadata_user_errors(tmp_path):
    not_safetensors = tmp_path / "x.safetensors"
    not_safetensors.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    for path in (not_safetensors, tmp_path / "missing.safetensors"):
        result = run_script("tools/show_metadata.py", str(path))
        assert result.returncode == 2 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1


# --------------------------------------------------------------------------- check_lora_weights


def test_check_lora_weights_norms(trained_lora):
    result = run_tool("networks/check_lora_weights.py", str(trained_lora))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == ",".join(check_lora_weights.COLUMNS)
    weights = read_lora_file(str(trained_lora))
    modules = lora_modules(weights)
    rows = {line.split(",")[0]: line.split(",") for line in lines[1:] if not line.startswith("#")}
    assert set(rows) == set(modules)
    name, parts = next((n, p) for n, p in modules.items() if p["down"].dim() == 4 and p["down"].shape[2] == 3)
    _, rank, alpha, down_norm, up_norm, delta_norm = rows[name]
    assert (int(rank), float(alpha)) == (4, 2.0)
    assert float(down_norm) == pytest.approx(float(parts["down"].norm()), rel=1e-5)
    assert float(delta_norm) == pytest.approx(float(lora_delta(parts).norm()), rel=1e-5)
    assert float(delta_norm) > 0  # trained: the up weights moved away from zero


def test_check_lora_weights_names_non_finite_module(trained_lora, tmp_path):
    weights = read_lora_file(str(trained_lora))
    name = sorted(lora_modules(weights))[3]
    weights[f"{name}.lora_up.weight"][0, 0] = math.nan
    bad = tmp_path / "bad.safetensors"
    from safetensors.torch import save_file  # save_lora_file refuses NaN, as training does

    save_file(weights, str(bad))
    result = run_tool("networks/check_lora_weights.py", str(bad))
    assert result.returncode == 1
    assert f"NaN/Inf in LoRA module {name}" in result.stderr
    missing = run_tool("networks/check_lora_weights.py", str(tmp_path / "nope.safetensors"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: ")


# --------------------------------------------------------------------------- resize_lora


def test_resize_error_matches_discarded_singular_values(trained_lora, tmp_path):
    out = tmp_path / "r2.safetensors"
    result = run_tool("networks/resize_lora.py", "--model", str(trained_lora), "--save_to", str(out),
                        "--new_rank", "2")
    assert result.returncode == 0, result.stderr
    assert "retained energy (Frobenius)" in result.stdout
    original, resized = lora_modules(read_lora_file(str(trained_lora))), lora_modules(read_lora_file(str(out)))
    assert set(original) == set(resized)
    trained_modules = 0
    for name, parts in original.items():
        new = resized[name]
        delta = lora_delta(parts, torch.float64)
        singular_values = torch.linalg.svdvals(delta.reshape(delta.shape[0], -1))
        untrained = float(singular_values[0]) <= resize_lora.MIN_SINGULAR_VALUE  # e.g. unused last TE layer
        assert new["down"].shape[0] == (1 if untrained else 2)
        assert new["down"].shape[1:] == parts["down"].shape[1:] and new["up"].shape[0] == parts["up"].shape[0]
        if untrained:
            assert float(lora_delta(new).abs().max()) <= resize_lora.MIN_SINGULAR_VALUE
            continue
        trained_modules += 1
        expected_error = float(singular_values[2:].pow(2).sum().sqrt())
        error = float((lora_delta(new, torch.float64) - delta).norm())
        assert error == pytest.approx(expected_error, rel=1e-3, abs=1e-6 * float(singular_values[0]))
        # the scale alpha/rank is kept
        assert float(new["alpha"]) / 2 == pytest.approx(float(parts["alpha"]) / parts["down"].shape[0])
    assert trained_modules > len(original) // 2
    metadata = show_metadata.describe(out)["metadata"]
    assert metadata["ss_network_dim"] == "2" and "resized to rank 2" in metadata["ss_training_comment"]


def test_full_rank_resize_reproduces_delta(trained_lora, tmp_path):
    weights = read_lora_file(str(trained_lora))
    resized, results = resize_lora.resize_weights(weights, new_rank=64)
    for name, parts in lora_modules(weights).items():
        new = lora_modules(resized)[name]
        assert new["down"].shape[0] <= parts["down"].shape[0]
        torch.testing.assert_close(lora_delta(new, torch.float64), lora_delta(parts, torch.float64),
                                   rtol=1e-5, atol=1e-7)
    assert all(result.fro_retained == pytest.approx(1.0, abs=1e-6) for result in results)


def test_dynamic_rank_choice():
    singular_values = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.5])
    assert resize_lora.choose_rank(singular_values, 16, "sv_ratio", 4.0) == 2       # > 8/4, as kohya
    assert resize_lora.choose_rank(singular_values, 16, "sv_ratio", 4.5) == 3
    assert resize_lora.choose_rank(singular_values, 2, "sv_ratio", 4.0) == 2        # capped
    fro = [math.sqrt(sum(v * v for v in singular_values[:r].tolist()) / float(singular_values.pow(2).sum()))
           for r in range(1, 6)]
    assert resize_lora.choose_rank(singular_values, 16, "sv_fro", fro[1]) == 2
    assert resize_lora.choose_rank(singular_values, 16, "sv_fro", fro[1] + 1e-4) == 3
    assert resize_lora.choose_rank(singular_values, 16, "sv_cumulative", 12 / 15.5) == 2
    assert resize_lora.choose_rank(torch.zeros(4), 16, "sv_fro", 0.9) == 1


def test_dynamic_resize_file_and_user_errors(trained_lora, tmp_path):
    out = tmp_path / "dyn.safetensors"
    resize_lora.main(["--model", str(trained_lora), "--save_to", str(out), "--new_rank", "8",
                      "--dynamic_method", "sv_fro", "--dynamic_param", "0.9", "--save_precision", "fp16"])
    weights = read_lora_file(str(out))
    assert all(value.dtype == torch.float16 for value in weights.values())
    assert show_metadata.describe(out)["metadata"]["ss_network_dim"] == "Dynamic"
    for argv, match in ((["--new_rank", "0"], "--new_rank"),
                        (["--dynamic_method", "sv_ratio"], "--dynamic_param"),
                        (["--dynamic_method", "sv_fro", "--dynamic_param", "2"], "fraction")):
        with pytest.raises(UserError, match=match):
            resize_lora.main(["--model", str(trained_lora), "--save_to", str(tmp_path / "x.safetensors"), *argv])


@pytest.mark.parametrize("extra", ["lora_mid.weight", "dora_scale"])
def test_lora_tools_refuse_modules_with_lycoris_extras(extra):
    """A LyCORIS LoCon with use_tucker (lora_mid) or dora_wd (dora_scale) has lora_down/lora_up too:
    resizing or merging it as a plain LoRA would drop those tensors silently."""
    weights = {"lora_unet_a.lora_down.weight": torch.ones(2, 8), "lora_unet_a.lora_up.weight": torch.ones(8, 2),
               "lora_unet_a.alpha": torch.tensor(2.0), f"lora_unet_a.{extra}": torch.ones(2, 2)}
    with pytest.raises(UserError, match=f"lora_unet_a also holds {extra}"):
        resize_lora.resize_weights(weights, 1)
    del weights[f"lora_unet_a.{extra}"]
    assert resize_lora.resize_weights(weights, 1)[0]["lora_unet_a.lora_down.weight"].shape == (1, 8)


def synthetic_lora(out: int, inner: int, rank: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"lora_unet_a.lora_down.weight": torch.randn(rank, inner, generator=generator),
            "lora_unet_a.lora_up.weight": torch.randn(out, rank, generator=generator),
            "lora_unet_a.alpha": torch.tensor(rank / 2)}


def test_svd_lowrank_is_seeded_and_its_reported_error_is_measured():
    """--svd_lowrank_niter: kohya's torch.svd_lowrank path (here below kohya's 2048 bound, so that it is cheap),
    the same factors on every run, the caller's random state untouched, and the reported error the written
    LoRA's actual error, never below the full SVD's (Eckart-Young)."""
    weights = synthetic_lora(96, 80, 24)
    original = lora_delta(lora_modules(weights)["lora_unet_a"], torch.float64)
    state = torch.random.get_rng_state()
    first, (result,) = resize_lora.resize_weights(weights, 6, svd_lowrank_niter=1, lowrank_min_dim=16)
    second, _ = resize_lora.resize_weights(weights, 6, svd_lowrank_niter=1, lowrank_min_dim=16)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(torch.equal(first[key], second[key]) for key in first)
    written = lora_delta(lora_modules(first)["lora_unet_a"], torch.float64)
    measured = float((written - original).norm() / original.norm())
    assert abs(result.relative_error - measured) <= 1e-6 * measured  # float32 factors vs the float64 measure
    assert abs(result.fro_retained ** 2 + result.relative_error ** 2 - 1) <= 1e-6
    _, (full,) = resize_lora.resize_weights(weights, 6, svd_lowrank_niter=0)
    assert full.relative_error <= result.relative_error + 1e-9
    # kohya's rule: below 2048 rows or columns the full SVD is used whatever --svd_lowrank_niter says
    default, _ = resize_lora.resize_weights(weights, 6, svd_lowrank_niter=2)
    exact, _ = resize_lora.resize_weights(weights, 6, svd_lowrank_niter=0)
    assert all(torch.equal(default[key], exact[key]) for key in default)


def test_svd_lowrank_niter_flag(tmp_path):
    source = tmp_path / "in.safetensors"
    from networks.network_base import save_lora_file

    save_lora_file(synthetic_lora(40, 30, 8), str(source), {})
    with pytest.raises(UserError, match="--svd_lowrank_niter"):
        resize_lora.main(["--model", str(source), "--save_to", str(tmp_path / "o.safetensors"),
                          "--svd_lowrank_niter", "-1"])
    outputs = []
    for niter in ("0", "2"):  # the GUI always passes it; both accepted, same result on these shapes
        out = tmp_path / f"n{niter}.safetensors"
        resize_lora.main(["--model", str(source), "--save_to", str(out), "--new_rank", "3", "--device", "cuda",
                          "--svd_lowrank_niter", niter])
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
