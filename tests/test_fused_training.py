"""``--fused_backward_pass`` / ``--fused_optimizer_groups`` in the full fine-tuners (``sdxl_train.py`` on the tiny
SDXL): the loop's own step path with the update applied during the backward (library/training/gradient_step.py,
library/fused_backward.py) trains the same weights as the unfused run, bit for bit, through guard skips and
applied steps, with the fp16 loss scaler and the whole step's ``--max_grad_norm``; kill -9 + ``--resume auto``
gives the uninterrupted run's bytes; the combinations kohya refuses are one line, exit 2.

Why bit-equal and not "to float32 rounding": both passes backward the same graph, so each gradient is the
tensor an unfused backward produces; it is unscaled by the same multiply, clipped by the same coefficient
(computed from the same per-tensor norms, combined in clip_grad_norm_'s order) and stepped by the optimizer's
own step() on a view of its groups (docs/fused_backward.md). Only the guard's logged norm is summed in another
order (per tensor, then over tensors): its relative difference is within float32 summation error, far from
the decision thresholds used here."""
from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch
from conftest import model_args, run_trainer, train_expecting_user_error
from safetensors.torch import load_file
from test_training_core import run_script

from library.train_state import Progress, StateStore, protected_arguments

STEPS = ("--max_train_steps", "3")
# The guard's threshold before its window fills is FACTOR x the median of the norms so far, the current one
# included: 0.99 skips the first step (its norm is the whole window) and, with the norms falling as the tiny
# model fits, applies the next ones. Both runs must skip the same steps for their weights to agree.
FORCED_SKIP = ("--skip_grad_norm", "--skip_grad_norm_warmup_factor", "0.99")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from tools.make_demo_dataset import make_demo_dataset

    root = tmp_path_factory.mktemp("fused_dataset")
    make_demo_dataset(str(root), count=3, size=64, repeats=1)
    return root


def train(tiny_models, dataset: Path, output_dir: Path, options: list[str], capsys) -> list[str]:
    capsys.readouterr()
    run_trainer("sdxl_train", model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64", "--seed", "1",
        "--max_data_loader_n_workers", "0", "--output_dir", str(output_dir), "--output_name", "ft", *STEPS,
        "--save_model_as", "safetensors", "--save_state_on_train_end", "--grad_norm_log", "--max_grad_norm", "1",
        *FORCED_SKIP, *options])
    return capsys.readouterr().out.strip().splitlines()


def components(output_dir: Path) -> dict:
    return torch.load(output_dir / "ft-state" / "components.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("options, fused", [
    # a third of the tiny UNet's 12.4 MB of gradients kept: the second pass pruned to the rest
    (["--optimizer_type", "Adafactor", "--mixed_precision", "fp16"],
     ["--fused_backward_pass", "--fused_backward_kept_gradient_gib", "0.004"]),
    # none kept: the second pass computes every gradient again
    (["--optimizer_type", "AdamW", "--learning_rate", "1e-3", "--mixed_precision", "fp16"],
     ["--fused_optimizer_groups", "3", "--fused_backward_kept_gradient_gib", "0"]),
], ids=["fused_backward_pass-adafactor-kept", "fused_optimizer_groups-adamw"])
def test_fused_trains_the_unfused_weights_through_a_guard_skip(options, fused, tiny_models, dataset, tmp_path, capsys):
    """Through the trainer's step path (accelerate's backward, the announced second pass), the scaler and the
    guard's skip, with a third of the gradients kept by the measuring pass, or none."""
    unfused_end = train(tiny_models, dataset, tmp_path / "unfused", options, capsys)[-1]
    fused_lines = train(tiny_models, dataset, tmp_path / "fused", options + fused, capsys)
    fused_end = fused_lines[-1]
    passes = [re.search(r"kept ([\d.e-]+) GiB .* computed (\d+) of (\d+) gradients again", line)
              for line in fused_lines if line.startswith("fused backward: ")]
    assert len(passes) == 1 and passes[0], fused_lines
    kept_gib, computed, count = float(passes[0][1]), int(passes[0][2]), int(passes[0][3])
    if "0.004" in fused:
        assert 0 < kept_gib <= 0.004 and 0 < computed < count
    else:
        assert kept_gib == 0 and computed == count
    for end in (unfused_end, fused_end):  # a skipped step and applied ones in each run
        assert re.match(r"done: 3 steps, [12] trained; skipped: guard [12],", end), end
    assert fused_end == unfused_end
    trained = load_file(tmp_path / "unfused" / "ft-state" / "lora.safetensors")  # every trained tensor
    assert trained.keys() == load_file(tmp_path / "fused" / "ft-state" / "lora.safetensors").keys()
    for name, tensor in load_file(tmp_path / "fused" / "ft-state" / "lora.safetensors").items():
        assert torch.equal(tensor, trained[name]), name
    base = load_file(tiny_models["sdxl_file"])  # and the run did train
    assert not torch.equal(trained["unet.conv_in.weight"], base["model.diffusion_model.input_blocks.0.0.weight"])
    # the optimizer's per-parameter state (indices: the parameters in order; the groups differ with
    # --fused_optimizer_groups, kohya's split) and the loss scaler's
    unfused_state, fused_state = components(tmp_path / "unfused"), components(tmp_path / "fused")
    assert unfused_state["optimizer"]["state"].keys() == fused_state["optimizer"]["state"].keys()
    for index, values in unfused_state["optimizer"]["state"].items():
        for key, value in values.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(fused_state["optimizer"]["state"][index][key]))
    assert unfused_state["loss_scaler"] == fused_state["loss_scaler"]
    assert unfused_state["grad_guard"]["skipped_steps"] == fused_state["grad_guard"]["skipped_steps"]


@pytest.mark.slow
def test_fused_killed_then_resumed_gives_the_uninterrupted_bytes(tiny_models, dataset, tmp_path):
    """bf16 weights with the fused Adafactor: stochastic rounding drawn from (seed, parameter, step), so a
    resumed run draws what the uninterrupted one drew. The runs before the kill keep every gradient of the
    tiny UNet (the automatic budget); the resumed one keeps none: the budget changes the memory, never the
    bytes, so a state resumes under another one."""
    def argv(output_dir: Path) -> list[str]:
        return model_args(tiny_models, "sdxl") + [
            "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64", "--seed", "3",
            "--max_data_loader_n_workers", "0", "--output_dir", str(output_dir), "--output_name", "ft",
            "--max_train_steps", "4", "--save_model_as", "safetensors", "--save_state", "--save_every_n_steps", "1",
            "--grad_norm_log", "--optimizer_type", "Adafactor", "--mixed_precision", "bf16", "--full_bf16",
            "--fused_backward_pass"]
    from conftest import run_trainer_output

    # the runs that are not killed need no process of their own
    run_trainer_output("sdxl_train", argv(tmp_path / "whole"))
    killed = run_script("sdxl_train.py", argv(tmp_path / "killed") + ["--debug_kill_in_state_write", "3"], expect=None)
    assert killed.returncode == -signal.SIGKILL
    resumed = run_trainer_output("sdxl_train", argv(tmp_path / "killed") + [
        "--resume", "auto", "--fused_backward_kept_gradient_gib", "0"])
    assert "resumed at step 2 " in resumed
    for name in ("ft.safetensors", "gradient_logs+ft.txt"):
        assert (tmp_path / "killed" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name


def test_a_state_resumes_only_with_the_fused_optimizer_groups_it_was_written_with(tiny_models, dataset, tmp_path,
                                                                                  capsys):
    """The groups are the optimizer state's layout: another split (or none) is refused in one line before the model
    loads; ``--fused_backward_pass`` (per parameter, kohya's) ignores the groups."""
    import sdxl_train

    argv = model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64", "--seed", "1",
        "--output_dir", str(tmp_path), "--output_name", "ft", "--optimizer_type", "AdamW", *STEPS]
    written = sdxl_train.setup_parser().parse_args(argv + ["--fused_optimizer_groups", "3"])
    state = StateStore(str(tmp_path), "ft", protected_arguments(written, 1)).save(
        "ft-state", Progress(global_step=1), {"unet.conv_in.weight": torch.ones(2)}, {})
    for groups, shown in ((["--fused_optimizer_groups", "2"], "2"), ([], "None")):
        message = train_expecting_user_error(argv + ["--resume", str(state), *groups], capsys, script="sdxl_train")
        assert message == (f"error: --resume {state}: the state was written with fused_optimizer_groups=3, this run "
                           f"has fused_optimizer_groups={shown}; resume with the same settings"), message
    per_parameter = sdxl_train.setup_parser().parse_args(argv + ["--fused_backward_pass", "--fused_optimizer_groups", "2"])
    assert protected_arguments(per_parameter, 1)["fused_optimizer_groups"] is None
