"""A diverged run loses nothing: no LoRA file or state holding NaN/Inf (or overflowing
--save_precision) is written, replaces a good one, is named by the tracker or makes rotation
remove a good one; --resume auto resumes the last good state."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import model_args, run_trainer

from library.train_state import Progress, StateStore, verify_state
from networks.lora import read_lora_file


def training_args(tiny_models, dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", "run", "--max_data_loader_n_workers", "0",
        "--network_train_unet_only", "--seed", "1", "--save_state", "--save_every_n_steps", "1", *extra,
    ]


def train_until_refused(argv: list[str], capsys) -> str:
    """Run a training whose final LoRA file is refused (exit code 1); returns its output."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        run_trainer("sdxl_train_network", argv)
    assert exited.value.code == 1
    return capsys.readouterr().out


def tracked(output_dir: Path) -> str:
    return json.loads((output_dir / "run-state.json").read_text())["state"]


def contents(output_dir: Path) -> dict[str, bytes]:
    return {str(path.relative_to(output_dir)): path.read_bytes() for path in sorted(output_dir.rglob("*"))
            if path.is_file()}


def test_a_diverging_run_saves_only_finite_weights_and_ends_failed(tiny_models, demo_dataset, tmp_path, capsys):
    """lr 1000 (fp32, no self-healing): the first Adam steps make the forward overflow, every later step has a
    non-finite loss and is skipped, so no update is non-finite and every save holds finite weights (a resume
    continues exactly); the run ends "failed" with exit code 1 and writes no final file claiming to be the result."""
    output_dir = tmp_path / "out"
    # keep the last 1 step: step S removes S - 2
    argv = training_args(tiny_models, demo_dataset, output_dir, "--learning_rate", "1e3", "--max_train_steps", "5",
                         "--save_last_n_steps", "1", "--save_state_on_train_end")
    output = train_until_refused(argv, capsys)
    assert "failed: the last 3 steps had a non-finite loss on every sample: the final weights overflow the forward" \
        in output
    assert "done:" not in output and "not saving" not in output
    assert "2 trained; skipped: guard 0, loss scaler 0, non-finite loss 3, non-finite gradient 0" in output
    kept = {"run-step00000004", "run-step00000005"}
    assert {path.name for path in output_dir.iterdir()} == (
        {name + ".safetensors" for name in kept} | {name + "-state" for name in kept} | {"run-state.json"})
    assert tracked(output_dir) == "run-step00000005-state"
    for name in kept:
        assert verify_state(output_dir / f"{name}-state") == (True, "intact")
        weights = list(read_lora_file(str(output_dir / f"{name}-state" / "lora.safetensors")).values())
        weights += list(read_lora_file(str(output_dir / f"{name}.safetensors")).values())
        assert all(torch.isfinite(value).all() for value in weights)

    # --resume auto continues from the last state and ends the same way, removing nothing
    output = train_until_refused(argv + ["--resume", "auto"], capsys)
    assert f"--resume auto: resuming from {output_dir / 'run-step00000005'}-state" in output
    assert "failed: the last 3 steps had a non-finite loss on every sample" in output
    assert {path.name for path in output_dir.iterdir() if path.name.endswith("-state")} == {
        name + "-state" for name in kept}


def test_an_fp16_overflow_replaces_no_good_file_or_state(tiny_models, demo_dataset, tmp_path, capsys):
    output_dir = tmp_path / "out"
    common = ("--max_train_steps", "1", "--save_precision", "fp16", "--save_state_on_train_end")
    run_trainer("sdxl_train_network", training_args(tiny_models, demo_dataset, output_dir, *common))
    good = contents(output_dir)
    assert {"run-step00000001-state/lora.safetensors", "run-state/lora.safetensors", "run.safetensors",
            "run-step00000001.safetensors"} <= set(good)
    # the same save points again, from a run whose first Adam step moves weights by ~1e5: finite in fp32,
    # Inf in fp16
    output = train_until_refused(training_args(tiny_models, demo_dataset, output_dir, *common,
                                               "--learning_rate", "1e5"), capsys)
    refusals = [line for line in output.splitlines() if line.startswith("not saving")]
    assert len(refusals) == 4  # step file, step state, final file, final state: one line each
    assert all("holds values beyond the range of --save_precision fp16 (they would be saved as Inf" in line
               for line in refusals)
    assert "run-state stays the newest state (--resume auto resumes it)" in refusals[-1]
    assert contents(output_dir) == good


def test_a_state_whose_optimizer_overflowed_is_refused(tmp_path, capsys):
    lora_down = torch.nn.Parameter(torch.ones(2, 4))
    optimizer = torch.optim.AdamW([lora_down], lr=1e-3)
    store = StateStore(str(tmp_path), "run", {"network_dim": 2})
    lora = {"lora_unet_block.lora_down.weight": lora_down.detach()}
    assert store.save("run-step00000001-state", Progress(global_step=1), lora, {"optimizer": optimizer.state_dict()})
    # a finite gradient whose square exceeds float32: the second moment becomes Inf while the weights
    # stay finite (the update is exp_avg / sqrt(Inf) = 0); every later update of it would be 0 or NaN
    lora_down.grad = torch.full_like(lora_down, 1e30)
    optimizer.step()
    assert torch.isfinite(lora_down).all()
    capsys.readouterr()
    saved = store.save("run-step00000002-state", Progress(global_step=2), lora, {"optimizer": optimizer.state_dict()})
    assert saved is None
    assert capsys.readouterr().out.strip() == (
        "not saving state run-step00000002-state: the optimizer's exp_avg_sq of parameter 0 holds NaN/Inf "
        "(the training diverged); run-step00000001-state stays the newest state (--resume auto resumes it)")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run-state.json", "run-step00000001-state"]
    assert json.loads((tmp_path / "run-state.json").read_text())["state"] == "run-step00000001-state"


def test_an_alpha_beyond_the_save_precision_stays_float32_instead_of_refusing_the_file():
    """A full-rank LoKr (the GUI's LoKr presets: --network_dim 100000) has alpha 100000, beyond fp16."""
    from library.lora_files import cast_for_saving, save_refusal
    trained = {"lora_unet_a.lokr_w1": torch.full((2, 2), 0.5), "lora_unet_a.alpha": torch.tensor(100000.0)}
    assert save_refusal(trained, torch.float16) is None
    saved = cast_for_saving(trained, torch.float16)
    assert saved["lora_unet_a.lokr_w1"].dtype == torch.float16
    assert saved["lora_unet_a.alpha"].dtype == torch.float32 and float(saved["lora_unet_a.alpha"]) == 100000.0
    trained["lora_unet_a.lokr_w1"] = torch.full((2, 2), 1e5)  # a trained weight beyond fp16 is still refused
    assert "beyond the range of --save_precision fp16" in save_refusal(trained, torch.float16)
