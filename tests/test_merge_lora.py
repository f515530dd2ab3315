"""networks/merge_lora.py: a merged checkpoint renders what base + LoRA renders in diffusers;
LoRAs merged into one LoRA as kohya merges them (--concat, --shuffle, --lbws)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import json
import math

import numpy as np
import pytest
import torch
from conftest import TRAIN_SCRIPTS, model_args, run_script_as_main, run_trainer
from test_bad_input_sweep4_tools import lora_files  # noqa: F401  (the fixture: random LoRAs for the tiny models)

from library.errors import UserError
from library import checkpoint_keys, model_loading
from networks import merge_lora, registry
from networks.lora import lora_delta, lora_modules, read_lora_file

REPO_ROOT = Path(__file__).resolve().parent.parent


def train(kind: str, tiny_models, dataset: Path, output_dir: Path, seed: int) -> Path:
    run_trainer(TRAIN_SCRIPTS[kind], model_args(tiny_models, kind) + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", f"lora{seed}", "--seed", str(seed),
        "--max_data_loader_n_workers", "0", "--network_dim", "4", "--network_alpha", "2",
        "--learning_rate", "3e-2", "--max_train_steps", "3",
    ])
    return output_dir / f"lora{seed}.safetensors"


@pytest.fixture(scope="module")
def loras(tiny_models, demo_dataset, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("merge_loras")
    return {kind: (train(kind, tiny_models, demo_dataset, root / kind, 1),
                   train(kind, tiny_models, demo_dataset, root / kind, 2)) for kind in TRAIN_SCRIPTS}


def render(pipe) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator("cpu").manual_seed(0)
    return pipe("a red circle", num_inference_steps=2, height=64, width=64, generator=generator,
                output_type="np").images[0]


def load_pipeline(kind: str, path: Path, tiny_models):
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    pipeline_class = StableDiffusionXLPipeline if kind == "sdxl" else StableDiffusionPipeline
    return pipeline_class.from_single_file(str(path), config=str(tiny_models[f"{kind}_config"]), local_files_only=True)


@pytest.mark.parametrize("kind", ["sdxl", "sd15"])
def test_merged_checkpoint_matches_base_plus_lora(kind, loras, tiny_models, tmp_path):
    first, second = loras[kind]
    merged = tmp_path / "merged.safetensors"
    # the script as __main__ in this process (tests/test_gui_lora_tools.py launches it as a process)
    run_script_as_main([sys.executable, str(REPO_ROOT / "networks" / "merge_lora.py"),
                        "--sd_model", str(tiny_models[f"{kind}_file"]),
                        "--model_config_dir", str(tiny_models[f"{kind}_config"]),
                        "--save_to", str(merged), "--models", str(first), str(second), "--ratios", "1.0", "0.5"],
                       REPO_ROOT)

    base = load_pipeline(kind, tiny_models[f"{kind}_file"], tiny_models)
    plain = render(base)
    base.load_lora_weights(str(first), adapter_name="first")
    base.load_lora_weights(str(second), adapter_name="second")
    base.set_adapters(["first", "second"], adapter_weights=[1.0, 0.5])
    with_lora = render(base)
    from_merged = render(load_pipeline(kind, merged, tiny_models))
    assert np.abs(with_lora - plain).max() > 1e-3  # the LoRAs do change the image
    np.testing.assert_allclose(from_merged, with_lora, atol=2e-4)


def factors(parts: dict, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(up, down) of a module as 2-D float64 matrices, down times ``scale`` and up times ``|scale|`` (kohya)."""
    up, down = parts["up"].double(), parts["down"].double()
    return up.reshape(up.shape[0], -1) * abs(scale), down.reshape(down.shape[0], -1) * scale


def test_loras_merged_into_one_lora_as_kohya_merges_them(lora_files, tmp_path):
    """kohya's LoRA + LoRA merge (what its merge_lora.py / sdxl_merge_lora.py write, compared on these files by a
    harness: equal to float32 rounding): factors scaled by s = sqrt(alpha / alpha_first) * ratio (up by |s|) and
    added; --concat stacks them; the alpha is the first LoRA's."""
    first, second = lora_files["sdxl_0"], lora_files["sdxl_1"]
    a, b = lora_modules(read_lora_file(str(first))), lora_modules(read_lora_file(str(second)))
    ratios = (0.8, -0.5)
    for flags in ([], ["--concat"]):
        out = tmp_path / f"ab{len(flags)}.safetensors"
        merge_lora.main(["--save_to", str(out), "--models", str(first), str(second),
                         "--ratios", *map(str, ratios), *flags])
        merged = lora_modules(read_lora_file(str(out)))
        assert set(merged) == set(a) | set(b)
        for name, parts in merged.items():
            alpha = float(a[name]["alpha"])
            (up_a, down_a), (up_b, down_b) = (factors(x[name], math.sqrt(float(x[name]["alpha"]) / alpha) * ratio)
                                              for x, ratio in ((a, ratios[0]), (b, ratios[1])))
            if flags:
                up, down = torch.cat([up_a, up_b], dim=1), torch.cat([down_a, down_b], dim=0)
            else:
                up, down = up_a + up_b, down_a + down_b
            expected = up @ down * alpha / down.shape[0]
            assert float(parts["alpha"]) == alpha and parts["down"].shape[0] == down.shape[0]
            # the file's factors are float32: each entry sums rank products rounded at ~6e-8 relative
            torch.testing.assert_close(lora_delta(parts, torch.float64).reshape(expected.shape), expected,
                                       rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


def test_merge_shuffle_keeps_the_deltas_and_repeats_its_bytes(lora_files, tmp_path):
    argv = ["--models", str(lora_files["sdxl_0"]), str(lora_files["sdxl_1"]), "--concat", "--no_metadata"]
    plain, shuffled, again = (tmp_path / f"{name}.safetensors" for name in ("plain", "shuffled", "again"))
    merge_lora.main([*argv, "--save_to", str(plain)])
    merge_lora.main([*argv, "--shuffle", "--save_to", str(shuffled)])
    merge_lora.main([*argv, "--shuffle", "--save_to", str(again)])
    assert shuffled.read_bytes() == again.read_bytes()
    plain_modules, shuffled_modules = lora_modules(read_lora_file(str(plain))), lora_modules(read_lora_file(str(shuffled)))
    assert any(not torch.equal(plain_modules[name]["down"], shuffled_modules[name]["down"]) for name in plain_modules)
    for name, parts in plain_modules.items():
        # the same float32 products summed in another order: equal in float64 to its rounding
        torch.testing.assert_close(lora_delta(shuffled_modules[name], torch.float64), lora_delta(parts, torch.float64),
                                   rtol=1e-12, atol=1e-15)


def test_block_weights_scale_the_blocks_they_name(lora_files, tiny_models, tmp_path):
    """--lbws (12 numbers: SDXL's BASE, IN04, IN05, IN07, IN08, MID, OUT00-OUT05): LoRA + LoRA scales both
    factors (the delta by w^2, as kohya); into a model the module's ratio is multiplied by w."""
    source = lora_files["sdxl_0"]
    weights = [0.5, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1]  # BASE (text encoders) 0.5, IN08 (input_blocks_8) 0
    out = tmp_path / "lbw.safetensors"
    merge_lora.main(["--save_to", str(out), "--models", str(source), "--lbws", json.dumps(weights)])
    original, merged = lora_modules(read_lora_file(str(source))), lora_modules(read_lora_file(str(out)))
    factor = {"lora_te": 0.25, "lora_unet_input_blocks_8_": 0.0}
    assert any(name.startswith("lora_unet_input_blocks_8_") for name in original)
    for name, parts in original.items():
        expected = next((value for prefix, value in factor.items() if name.startswith(prefix)), 1.0)
        torch.testing.assert_close(lora_delta(merged[name]), lora_delta(parts) * expected, rtol=1e-6, atol=1e-9)
    with pytest.raises(UserError, match="--lbws"):
        merge_lora.main(["--save_to", str(out), "--models", str(source), "--lbws", "[1,2,3]"])

    load = dict(sdxl=True, model_config_dir=tiny_models["sdxl_config"])
    merged_models = {}
    for label, extra in (("plain", []), ("lbw", ["--lbws", json.dumps(weights)])):
        path = tmp_path / f"{label}_model.safetensors"
        merge_lora.main(["--sd_model", str(tiny_models["sdxl_file"]), "--model_config_dir",
                         str(tiny_models["sdxl_config"]), "--save_to", str(path), "--models", str(source),
                         "--ratios", "0.7", *extra])
        merged_models[label] = dict(model_loading.load_models(path, **load).unet.named_modules())
    base = model_loading.load_models(tiny_models["sdxl_file"], **load)
    network = registry.network_from_file(str(source), base.text_encoders, base.unet,
                                         checkpoint_keys.unet_module_name_map(base.unet.config), "--models")
    paths = {id(module): path for path, module in base.unet.named_modules()}
    zeroed = 0
    for module in network.all_loras():
        path = paths.get(id(network.wrapped_module(module)))
        if path is None:  # a text encoder module (BASE: checked above on the LoRA)
            continue
        weight = network.wrapped_module(module).weight
        block = 0.0 if module.lora_name.startswith("lora_unet_input_blocks_8_") else 1.0
        zeroed += block == 0.0
        torch.testing.assert_close(merged_models["lbw"][path].weight - weight,
                                   block * (merged_models["plain"][path].weight - weight), rtol=1e-5, atol=1e-6)
    assert zeroed


def test_merge_user_errors(loras, tiny_models, tmp_path):
    first, _ = loras["sdxl"]
    with pytest.raises(UserError, match="--ratios"):
        merge_lora.main(["--save_to", str(tmp_path / "x.safetensors"), "--models", str(first), "--ratios", "1", "2"])
    sd15_lora = loras["sd15"][0]
    with pytest.raises(UserError, match="SD 1.x"):
        merge_lora.main(["--sd_model", str(tiny_models["sdxl_file"]), "--model_config_dir",
                         str(tiny_models["sdxl_config"]), "--save_to", str(tmp_path / "x.safetensors"),
                         "--models", str(sd15_lora)])
    assert not (tmp_path / "x.safetensors").exists()


def test_sdxl_merge_lora_is_the_same_tool(lora_files, tmp_path):
    """The GUI calls networks/sdxl_merge_lora.py for SDXL with the same flags: the same file comes out."""
    outputs = []
    for script in ("merge_lora.py", "sdxl_merge_lora.py"):
        out = tmp_path / f"{script}.safetensors"
        run_script_as_main([sys.executable, str(REPO_ROOT / "networks" / script), "--save_precision", "fp16",
                            "--precision", "float", "--save_to", str(out), "--models", str(lora_files["sdxl_0"]),
                            str(lora_files["sdxl_1"]), "--ratios", "1.0", "0.5", "--no_metadata"], REPO_ROOT)
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
    # the refusal as a process: exit code 2, one line (the files above ran as __main__ in this process)
    refused = subprocess.run([sys.executable, str(REPO_ROOT / "networks" / "sdxl_merge_lora.py"), "--save_to",
                              str(tmp_path / "x.safetensors"), "--models", str(tmp_path)], capture_output=True, text=True)
    assert refused.returncode == 2 and refused.stderr.startswith("error: ") and "is a folder" in refused.stderr


def test_merge_into_a_ckpt_as_kohya_writes_it(lora_files, tiny_models, tmp_path):
    """The GUI's Merge tab offers a .ckpt Save-to: kohya's torch.save layout (``state_dict``), the same tensors
    as the .safetensors merge, read back by our checkpoint reader."""
    from safetensors.torch import load_file

    from library import checkpoint_files

    outputs = {}
    for suffix in (".safetensors", ".ckpt"):
        outputs[suffix] = tmp_path / f"merged{suffix}"
        merge_lora.main(["--sd_model", str(tiny_models["sd15_file"]), "--model_config_dir",
                         str(tiny_models["sd15_config"]), "--save_to", str(outputs[suffix]),
                         "--models", str(lora_files["sd15_0"])])
    pickled = torch.load(outputs[".ckpt"], map_location="cpu", weights_only=True)
    assert set(pickled) == {"state_dict", "epoch", "global_step"}
    from_ckpt = checkpoint_files.load_pickled_state_dict(outputs[".ckpt"])
    expected = load_file(str(outputs[".safetensors"]))
    assert set(from_ckpt) == set(expected)
    for key, value in expected.items():
        assert torch.equal(from_ckpt[key], value), key


def test_merged_model_is_saved_as_kohya_saves_a_checkpoint(lora_files, tiny_models, tmp_path):
    """kohya's save_stable_diffusion_checkpoint through library.full_model_files: a checkpoint's model spec
    (merged_from: the base's title and the LoRA's file name), the base file's logit_scale carried (SDXL);
    --no_metadata writes none."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    logit_scale = checkpoint_keys.SDXL_OPEN_CLIP_PREFIX + "logit_scale"
    base = tmp_path / "base.safetensors"
    save_file({**load_file(str(tiny_models["sdxl_file"])), logit_scale: torch.tensor(4.6052)}, str(base),
              {"modelspec.title": "Base"})
    for extra, out in (([], tmp_path / "merged.safetensors"), (["--no_metadata"], tmp_path / "bare.safetensors")):
        merge_lora.main(["--sd_model", str(base), "--model_config_dir", str(tiny_models["sdxl_config"]),
                         "--save_to", str(out), "--models", str(lora_files["sdxl_0"]), *extra])
        with safe_open(str(out), framework="pt") as handle:
            assert torch.equal(handle.get_tensor(logit_scale), torch.tensor(4.6052))
            metadata = handle.metadata() or {}
        if extra:
            assert metadata == {}
            continue
        assert metadata["modelspec.architecture"] == "stable-diffusion-xl-v1-base"
        assert (metadata["modelspec.title"], metadata["modelspec.merged_from"]) == ("merged", "Base, sdxl_0")
        assert metadata["modelspec.resolution"] == "1024x1024" and not any(k.startswith("ss_") for k in metadata)
