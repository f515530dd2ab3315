"""The kohya_ss GUI v26's LoRA tab with "Train inpainting model" on and its Textual Inversion tab, as the
GUI's own code writes them (tests/data/gui_inpainting_ti.json: built headless, Start training clicked,
the command and TOML recorded; harness /work/harness_inp_ti): each recorded command runs our script on
its recorded TOML, changed only in paths, resolution (64) and step count (2)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import run_trainer
from safetensors.torch import load_file

RECORDED = json.loads((Path(__file__).parent / "data" / "gui_inpainting_ti.json").read_text(encoding="utf-8"))["runs"]


@pytest.fixture(scope="module")
def tiny_inpainting(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tools.build_tiny_models import build_tiny_inpainting_models

    return build_tiny_inpainting_models(tmp_path_factory.mktemp("tiny_inpainting"))


def replay(name: str, model: Path, train_data: Path, output_dir: Path) -> dict:
    """Run the recorded command's script on the recorded TOML; the TOML as run (parsed)."""
    import toml

    run = RECORDED[name]
    argv = run["train_argv"]
    config_at = argv.index("--config_file")
    assert argv[:2] == ["accelerate", "launch"] and argv[config_at + 2:] == []  # the TOML says everything
    script = Path(argv[config_at - 1]).stem
    text = "\n".join(run["toml_lines"]) + "\n"
    text = text.replace("{model}", str(model)).replace("{train_data}", str(train_data))
    text = text.replace("{output}", str(output_dir))
    text = re.sub(r'(?m)^resolution = .*$', 'resolution = "64,64"', text)
    text = re.sub(r"(?m)^max_train_steps = .*$", "max_train_steps = 2", text)
    (output_dir / "sample").mkdir(parents=True)
    (output_dir / "sample" / "prompt.txt").write_text("")  # the GUI's empty Samples box
    config = Path(argv[config_at + 1].replace("{output}", str(output_dir)))
    config.write_text(text, encoding="utf-8")
    run_trainer(script, ["--config_file", str(config)])
    return toml.loads(text)


@pytest.mark.slow
def test_gui_lora_tab_with_inpainting_trains(tiny_inpainting, one_image_dataset, tmp_path):
    written = replay("lora_inpainting_sdxl", tiny_inpainting["sdxl_inpaint"], one_image_dataset, tmp_path)
    assert written["train_inpainting"] is True and "cache_latents" not in written  # the GUI drops the caching
    weights = load_file(tmp_path / "lora_inpainting_sdxl.safetensors")
    assert any(key.startswith("lora_unet_") for key in weights)
    assert all(torch.isfinite(tensor.float()).all() for tensor in weights.values())


@pytest.mark.slow
@pytest.mark.parametrize("name,keys", [("ti_defaults_sdxl", ("clip_l", "clip_g")), ("ti_defaults_sd15", ("emb_params",))])
def test_gui_textual_inversion_tab_trains(name, keys, tiny_models, one_image_dataset, tmp_path):
    kind = RECORDED[name]["kind"]
    written = replay(name, tiny_models[kind], one_image_dataset, tmp_path)
    embedding = load_file(tmp_path / f"{name}.safetensors")
    assert set(embedding) == set(keys)
    for tensor in embedding.values():  # --num_vectors_per_token vectors of each encoder's width, fp16 (save_precision)
        assert tensor.shape[0] == written["num_vectors_per_token"] and tensor.dtype == torch.float16
        assert torch.isfinite(tensor).all()
