"""networks/extract_lora_from_dylora.py: kohya's cut of a DyLoRA file (one file per multiple of --unit below its
rank) is slicing of every lora_down/lora_up, alpha kept, with kohya's metadata and each file's own hashes (the
harness found our tensors bit-equal to kohya's files); bad input is one line before anything is written."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_convert_to_lora import random_network_file

from library import model_loading
from library.errors import UserError
from library.lora_metadata import addnet_hashes
from networks import extract_lora_from_dylora, network_base
from networks.network_base import read_lora_file, read_lora_metadata

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dylora_file(tiny_models, tmp_path_factory) -> Path:
    """A rank-4 (conv rank 4), unit-2 DyLoRA on the tiny SD1.5 with random weights and a training comment."""
    path = tmp_path_factory.mktemp("dylora") / "dy.safetensors"
    models = model_loading.load_models(tiny_models["sd15"], sdxl=False)
    random_network_file(models, "networks.dylora", ["conv_dim=4", "unit=2"], path)
    weights, metadata = read_lora_file(str(path)), read_lora_metadata(str(path))
    network_base.save_lora_file(weights, str(path), {**metadata, "ss_network_dim": "4",
                                                     "ss_training_comment": "trained", "sshs_model_hash": "old"})
    return path


def test_cuts_are_slices_with_kohyas_metadata(dylora_file, tmp_path, capsys):
    extract_lora_from_dylora.main(["--model", str(dylora_file), "--save_to", str(tmp_path / "cut.safetensors"),
                                   "--unit", "2"])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["cut-0002.safetensors"]  # ranks below 4 only
    source, source_metadata = read_lora_file(str(dylora_file)), read_lora_metadata(str(dylora_file))
    cut = read_lora_file(str(tmp_path / "cut-0002.safetensors"))
    assert set(cut) == set(source)
    for key, value in source.items():
        expected = value[:2] if "lora_down" in key else value[:, :2] if "lora_up" in key else value
        assert torch.equal(cut[key], expected), key
    assert any(value.dim() == 4 and value.shape[2] == 3 for key, value in cut.items() if "lora_down" in key)
    metadata = read_lora_metadata(str(tmp_path / "cut-0002.safetensors"))
    assert metadata["ss_network_dim"] == "2" and metadata["ss_network_module"] == "networks.dylora"
    assert metadata["ss_training_comment"] == "split from DyLoRA, rank 4 to 2; trained"
    assert metadata["ss_network_args"] == source_metadata["ss_network_args"]
    without_hashes = {key: value for key, value in metadata.items() if not key.startswith("sshs_")}
    assert addnet_hashes(cut, without_hashes) == {key: metadata[key] for key in ("sshs_model_hash", "sshs_legacy_hash")}


def test_bad_input_is_one_line_before_writing(dylora_file, tiny_models, tmp_path):
    plain = tmp_path / "plain.safetensors"
    random_network_file(model_loading.load_models(tiny_models["sd15"], sdxl=False), "networks.lora", [], plain)
    out = str(tmp_path / "cut.safetensors")
    cases = [
        (["--model", str(dylora_file), "--unit", "0"], "--unit must be a rank >= 1"),
        (["--model", str(dylora_file), "--unit", "4"], "--unit 4: the file's rank is 4"),
        (["--model", str(dylora_file), "--unit", "3"], "--unit 3: the file was trained with unit 2"),
        (["--model", str(tmp_path / "missing.safetensors"), "--unit", "2"], "--model .* does not exist"),
        (["--model", str(plain), "--unit", "2"], "a networks.lora file, not DyLoRA"),
    ]
    before = sorted(tmp_path.iterdir())
    for argv, message in cases:
        with pytest.raises(UserError, match=message):
            extract_lora_from_dylora.main(["--save_to", out, *argv])
    # the rank-2 cut of "dy.safetensors" would be dy-0002.safetensors: the input itself
    source_copy = tmp_path / "dy-0002.safetensors"
    source_copy.write_bytes(dylora_file.read_bytes())
    with pytest.raises(UserError, match="same file as --model"):
        extract_lora_from_dylora.main(["--model", str(source_copy), "--save_to", str(tmp_path / "dy.safetensors"),
                                       "--unit", "2"])
    assert sorted(tmp_path.iterdir()) == sorted([*before, source_copy])
    result = subprocess.run([sys.executable, str(REPO / "networks" / "extract_lora_from_dylora.py"), "--model",
                             str(dylora_file), "--save_to", out, "--unit", "3"], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--unit 3" in result.stderr
    assert json.loads(read_lora_metadata(str(dylora_file))["ss_network_args"])["unit"] == "2"
