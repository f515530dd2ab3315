"""Careless users of the file tools, fourth sweep (issue 29): a tool never writes over its own input, mistakes are
one line naming the flag or file (exit code 2) before any model is loaded when the file headers already tell,
and every file the LoRA tools write is read back by our own loader and tools."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from library import model_loading
from library.errors import UserError
from library.grad_log import BASE_COLUMNS, EVENTS_FILE_PREFIX, LOG_FILE_PREFIX
from networks import check_lora_weights, convert_to_lora, lora, merge_lora, registry, resize_lora
from networks.network_base import read_lora_file, save_lora_file
from tools import plot_grad_log, replay_grad_guard

REPO = Path(__file__).resolve().parent.parent
KINDS = {"sdxl": "sdxl", "sd15": "sd1"}


def random_lora(models, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A LoRA/LoCon with kohya's names for ``models`` (text encoders, UNet, 3x3 convs) and random nonzero ups."""
    from library import checkpoint_keys

    names = checkpoint_keys.unet_module_name_map(models.unet.config) if models.is_sdxl else None
    torch.manual_seed(seed)
    network = lora.create_network(1.0, rank, rank / 2, None, models.text_encoders, models.unet,
                                  unet_module_names=names, conv_dim=rank, conv_alpha=rank / 2)
    state = network.lora_state_dict(torch.float32)
    return {key: torch.randn_like(value) * 0.1 if key.endswith("lora_up.weight") else value
            for key, value in state.items()}


@pytest.fixture(scope="module")
def lora_files(tiny_models, tmp_path_factory) -> dict[str, Path]:
    """``{kind}_{n}``: random rank-4 LoRAs (n = 0, 1) for the tiny sdxl and sd15 models, kohya metadata."""
    from tools.build_tiny_models import tiny_sd, tiny_sdxl

    root = tmp_path_factory.mktemp("sweep4_loras")
    files = {}
    for kind, models in (("sdxl", tiny_sdxl()), ("sd15", tiny_sd("sd1"))):
        for index in range(2):
            path = root / f"{kind}_{index}.safetensors"
            save_lora_file(random_lora(models, 4, index), str(path),
                           {"ss_network_module": "networks.lora", "ss_network_dim": "4", "ss_network_alpha": "2.0"})
            files[f"{kind}_{index}"] = path
    return files


def model_flags(tiny_models, kind: str) -> list[str]:
    return ["--sd_model", str(tiny_models[f"{kind}_file"]), "--model_config_dir", str(tiny_models[f"{kind}_config"])]


@pytest.fixture
def no_model_loading(monkeypatch):
    """A tripwire: the refusals below must come before the base model is read."""
    def refuse(*args, **kwargs):
        raise AssertionError("the base model was loaded before the mistake was reported")
    monkeypatch.setattr(model_loading, "load_models", refuse)


def refused(main, argv: list[str], *expected: str) -> str:
    with pytest.raises(UserError) as error:
        main(argv)
    message = str(error.value)
    assert "\n" not in message and all(text in message for text in expected), message
    return message


# -- a tool writing over its own input ---------------------------------------------------------------
def test_tools_refuse_to_overwrite_their_input(lora_files, tiny_models, tmp_path, no_model_loading):
    base = tmp_path / "base.safetensors"
    base.write_bytes(tiny_models["sdxl_file"].read_bytes())
    before = base.read_bytes()
    refused(merge_lora.main, ["--sd_model", str(base), "--model_config_dir", str(tiny_models["sdxl_config"]),
                              "--save_to", str(base), "--models", str(lora_files["sdxl_0"])], "--save_to", "--sd_model")
    assert base.read_bytes() == before
    lora_copy = tmp_path / "lora.safetensors"
    lora_copy.write_bytes(lora_files["sdxl_0"].read_bytes())
    refused(merge_lora.main, ["--save_to", str(lora_copy), "--models", str(lora_copy), str(lora_files["sdxl_1"])],
            "--save_to", "--models")
    refused(resize_lora.main, ["--model", str(lora_copy), "--save_to", str(lora_copy), "--new_rank", "2"],
            "--save_to", "--model")
    refused(convert_to_lora.main, [*model_flags(tiny_models, "sdxl"), "--model", str(lora_copy),
                                   "--save_to", str(lora_copy)], "--save_to", "--model")
    assert lora_copy.read_bytes() == lora_files["sdxl_0"].read_bytes()


def write_gradient_log(folder: Path, events: bytes | None = None) -> Path:
    log = folder / f"{LOG_FILE_PREFIX}run.txt"
    rows = "".join(f"1,{step},{1.0 + step / 10},0.5,0.1,0\n" for step in range(1, 31))
    log.write_text(",".join(BASE_COLUMNS) + "\n" + rows, encoding="utf-8")
    if events is not None:
        (folder / f"{EVENTS_FILE_PREFIX}run.txt").write_bytes(events)
    return log


def test_log_tools_refuse_to_overwrite_the_log(tmp_path):
    log = write_gradient_log(tmp_path)
    before = log.read_bytes()
    refused(replay_grad_guard.main, [str(log), "--out", str(log)], "--out", "LOG")
    same_log_as_png = tmp_path / "grad.png"
    same_log_as_png.write_bytes(before)
    refused(plot_grad_log.main, [str(same_log_as_png), "--out", str(same_log_as_png)], "--out", "LOG")
    assert log.read_bytes() == before and same_log_as_png.read_bytes() == before


# -- tracebacks ----------------------------------------------------------------------------------------
def test_convert_to_an_existing_folder_is_refused_before_converting(lora_files, tiny_models, tmp_path,
                                                                     no_model_loading):
    folder = tmp_path / "out.safetensors"
    folder.mkdir()
    refused(convert_to_lora.main, [*model_flags(tiny_models, "sdxl"), "--model", str(lora_files["sdxl_0"]),
                                   "--save_to", str(folder)], "--save_to", "is a folder")


@pytest.mark.parametrize("ratio", ["nan", "inf"])
def test_merge_refuses_non_finite_ratios(ratio, lora_files, tmp_path):
    refused(merge_lora.main, ["--save_to", str(tmp_path / "m.safetensors"), "--models", str(lora_files["sdxl_0"]),
                              "--ratios", ratio], "--ratios")


DAMAGED_EVENTS = {
    "not UTF-8": b"Step,Event,Detail\n3,rewind,\xff\xfe\x00\x81\n",
    "rewind detail not a number": b"Step,Event,Detail\n3,healthy,\n5,rewind,three\n",
}


@pytest.mark.parametrize("damage", DAMAGED_EVENTS)
def test_log_tools_report_a_damaged_events_file_in_one_line(damage, tmp_path):
    log = write_gradient_log(tmp_path, DAMAGED_EVENTS[damage])
    events = tmp_path / f"{EVENTS_FILE_PREFIX}run.txt"
    refused(plot_grad_log.main, [str(log), "--out", str(tmp_path / "p.png")], str(events))
    refused(replay_grad_guard.main, [str(log), "--out", str(tmp_path / "r.csv")], str(events))
    refused(replay_grad_guard.main, [str(log), "--out", str(tmp_path / "r.csv"), "--events", str(events)],
            "--events")


def test_plot_bounds_the_dpi(tmp_path):
    log = write_gradient_log(tmp_path)
    refused(plot_grad_log.main, [str(log), "--out", str(tmp_path / "p.png"), "--dpi", "100000"], "--dpi", "at most")


# -- refused only after the model loaded although the headers tell ------------------------------------
@pytest.mark.parametrize("tool", ["merge", "convert"])
def test_an_sd15_lora_on_an_sdxl_model_is_refused_before_loading(tool, lora_files, tiny_models, tmp_path,
                                                                  no_model_loading):
    out = str(tmp_path / "o.safetensors")
    if tool == "merge":
        refused(merge_lora.main, [*model_flags(tiny_models, "sdxl"), "--save_to", out,
                                  "--models", str(lora_files["sd15_0"])], "SD 1.x", "SDXL", "--models")
    else:
        refused(convert_to_lora.main, [*model_flags(tiny_models, "sdxl"), "--save_to", out,
                                       "--model", str(lora_files["sd15_0"])], "SD 1.x", "SDXL", "--model")


def test_convert_a_text_file_is_refused_before_loading(tiny_models, tmp_path, no_model_loading):
    notes = tmp_path / "notes.txt"
    notes.write_text("my training notes\n", encoding="utf-8")
    message = refused(convert_to_lora.main, [*model_flags(tiny_models, "sdxl"), "--model", str(notes),
                                             "--save_to", str(tmp_path / "o.safetensors")], str(notes), "not a network")
    assert "pop from" not in message


def test_check_lora_weights_says_a_checkpoint_is_not_a_network_file(tiny_models):
    result = subprocess.run([sys.executable, str(REPO / "networks" / "check_lora_weights.py"),
                             str(tiny_models["sdxl_file"])], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2 and "not a network file" in result.stderr, (result.stdout, result.stderr)
    assert "modules" not in result.stdout


# -- misleading messages ------------------------------------------------------------------------------
def test_a_folder_given_as_a_lora_is_named_a_folder(tmp_path):
    refused(merge_lora.main, ["--save_to", str(tmp_path / "m.safetensors"), "--models", str(tmp_path)], "is a folder")
    refused(resize_lora.main, ["--model", str(tmp_path), "--save_to", str(tmp_path / "r.safetensors")], "is a folder")


def test_a_png_given_as_a_lora_is_not_a_lora_and_no_unsafe_advice_is_quoted(tmp_path):
    image = tmp_path / "sample.png"
    image.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(200))
    for main, argv in ((merge_lora.main, ["--save_to", str(tmp_path / "m.safetensors"), "--models", str(image)]),
                       (resize_lora.main, ["--model", str(image), "--save_to", str(tmp_path / "r.safetensors")])):
        message = refused(main, argv, str(image), "not a network file")
        assert "weights_only" not in message


class Anything:
    """Not a tensor: torch.load(weights_only=True) refuses it."""


def test_a_pickled_object_file_is_refused_without_unsafe_advice(tmp_path):
    pickled = tmp_path / "lora.pt"
    torch.save({"x": Anything()}, pickled)
    message = refused(resize_lora.main, ["--model", str(pickled), "--save_to", str(tmp_path / "r.safetensors")],
                      str(pickled))
    assert "weights_only" not in message and "False" not in message


# -- issue 29 item 3: what the tools write is read back by our own loader and tools ---------------------
@pytest.mark.parametrize("kind", ["sdxl", "sd15"])
def test_tool_outputs_are_read_back_by_our_loader_and_tools(kind, lora_files, tiny_models, tmp_path):
    first, second = str(lora_files[f"{kind}_0"]), str(lora_files[f"{kind}_1"])
    outputs = {
        "resize": (resize_lora.main, ["--model", first, "--new_rank", "2"]),
        "resize dynamic": (resize_lora.main, ["--model", first, "--new_rank", "4", "--dynamic_method", "sv_fro",
                                              "--dynamic_param", "0.9", "--save_precision", "fp16"]),
        "merge": (merge_lora.main, ["--models", first, second, "--ratios", "1", "0.5"]),
        "concat": (merge_lora.main, ["--models", first, second, "--concat", "--shuffle", "--save_precision", "bf16"]),
        "convert": (convert_to_lora.main, [*model_flags(tiny_models, kind), "--model", first, "--dim", "3"]),
    }
    models = model_loading.load_models(tiny_models[f"{kind}_file"], sdxl=kind == "sdxl",
                                       model_config_dir=tiny_models[f"{kind}_config"])
    from library import checkpoint_keys

    names = checkpoint_keys.unet_module_name_map(models.unet.config) if models.is_sdxl else None
    written = []
    for label, (main, argv) in outputs.items():
        path = tmp_path / f"{label.replace(' ', '_')}.safetensors"
        main([*argv, "--save_to", str(path)])
        assert check_lora_weights.main([str(path)]) == 0, label
        network = registry.network_from_file(str(path), models.text_encoders, models.unet, names, label)
        assert len(network.all_loras()) == len(read_lora_file(str(path))) // 3, label
        written.append(str(path))
    merged = tmp_path / "merged_model.safetensors"
    merge_lora.main([*model_flags(tiny_models, kind), "--save_to", str(merged), "--models", *written])
    assert merged.stat().st_size > 0


def test_safetensors_model_file_named_as_lora_is_not_treated_as_lycoris(tmp_path):
    """A checkpoint-shaped file (no lora_/oft_ module names) is no network of any type."""
    path = tmp_path / "model.safetensors"
    save_file({"model.diffusion_model.out.2.weight": torch.zeros(2, 2)}, str(path))
    refused(merge_lora.main, ["--save_to", str(tmp_path / "m.safetensors"), "--models", str(path)], str(path))
