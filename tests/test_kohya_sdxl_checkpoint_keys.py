"""A full-size SDXL checkpoint as the full fine-tuners save it has exactly the tensors kohya's loader takes.

kohya's ``sdxl_model_util.load_models_from_sdxl_checkpoint`` hard-codes the real SDXL architecture (its own
UNet class, CLIP configs, VAE config) and loads strictly (a missing or unexpected key is an error), so
the tiny models cannot show it. ``tests/data/kohya_sdxl_checkpoint_keys.json`` holds every key and shape
kohya's SDXL saver writes (``save_stable_diffusion_checkpoint``'s dict: kohya's own model classes, built on
the meta device, through kohya's own conversions), recorded with kohya sd-scripts 48d368fa in its venv
(transformers 4.54.1, diffusers 0.32.1) by the harness ``/work/harness_fullsize/kohya_keys.py``.

The same harness (``kohya_load_check.py``) checked the real thing once: ``sdxl_train.py`` trained a
random-weight full-size SDXL one step (``--full_bf16``, Adafactor, ``--save_precision bf16``) and kohya's
loader loaded the written checkpoint with every key matched; all 2641 tensors it holds equal the file's
(UNet; the run's ``check_written`` compared the file with the trained weights) or the base file's cast to
bf16 (text encoders, VAE, through kohya's own conversions): 0 unequal (docs/full_fine_tuning.md, "Full size:
kohya's loader and the benchmark").
Here: the key set and shapes of the file our saver writes (``checkpoint_files.original_layout_tensors``
over full-size models on the meta device, plus the base file's carried ``logit_scale``) equal the record.
"""
from __future__ import annotations

import json
from pathlib import Path

from library import checkpoint_files
from library.model_loading import build_empty_models, shipped_config_dir
from library.models import StableDiffusionModels

KOHYA_KEYS = Path(__file__).parent / "data" / "kohya_sdxl_checkpoint_keys.json"


def test_full_size_sdxl_checkpoint_keys_are_kohyas():
    unet, vae, text_encoders, _ = build_empty_models("sdxl", shipped_config_dir("sdxl"), with_vae=True)
    models = StableDiffusionModels("sdxl", [], text_encoders, vae, unet, {}, "meta")
    written = {key: list(tensor.shape) for key, tensor in checkpoint_files.original_layout_tensors(models).items()}
    for key in checkpoint_files.SDXL_CARRIED_KEYS:  # kept from the base file (a 0-d tensor in SDXL files)
        written[key] = []
    expected = json.loads(KOHYA_KEYS.read_text())
    assert len(expected) > 2500  # the record is the full-size model's
    assert sorted(set(expected) - set(written)) == []
    assert sorted(set(written) - set(expected)) == []
    assert {key: shape for key, shape in written.items() if shape != expected[key]} == {}
