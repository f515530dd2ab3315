"""Two CPU processes (torchrun, gloo): rank-consistent guard, scaler, loss normalisation and resume.

The two-process trainings the selected tests check run in one torchrun launch (``torchrun_sequence.py``: a
launch's start costs several tiny trainings); the run killed in a state write has a launch of the entry script
of its own."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from conftest import model_args, run_trainer_output, train_expecting_user_error
from PIL import Image
from torchrun_sequence import launch_in_sequence

from networks import lora

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "SOURCE_DATE_EPOCH": "1700000000", "OMP_NUM_THREADS": "1"}
MASTER_PORT = 29500 + os.getpid() % 1000


def launch(argv: list[str]) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2 sdxl_train_network.py argv``: the entry script's own launch."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
               "--master_port", str(MASTER_PORT), str(REPO / "sdxl_train_network.py"), *argv]
    return subprocess.run(command, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)


def in_this_process(argv: list[str], script: str = "sdxl_train_network") -> None:
    """The one-process run in the test's process (saves a process start); its weights are read from its file
    (--debug_report_weights writes to the process's stdout file descriptor, which a test's captured stdout lacks)."""
    run_trainer_output(script, [arg for arg in argv if arg != "--debug_report_weights"])


def rank_hashes(result: subprocess.CompletedProcess) -> dict[int, str]:
    return {int(rank): digest for rank, digest in re.findall(r"rank (\d) lora_sha256 ([0-9a-f]{64})", result.stdout)}


@pytest.fixture(scope="module")
def masked_dataset(tmp_path_factory) -> Path:
    """Two RGBA images whose alpha covers different areas (a quarter and three quarters)."""
    root = tmp_path_factory.mktemp("masked")
    folder = root / "1_thing"
    folder.mkdir()
    rng = np.random.default_rng(1)
    for index, covered_rows in enumerate((16, 48)):
        pixels = rng.integers(0, 256, (64, 64, 4), dtype=np.uint8)
        pixels[..., 3] = 0
        pixels[:covered_rows, :, 3] = 255
        Image.fromarray(pixels, "RGBA").save(folder / f"{index}.png")
        (folder / f"{index}.txt").write_text(f"thing {index}")
    return root


def common(tiny_models, dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--seed", "7", "--max_data_loader_n_workers", "0",
        "--network_train_unet_only", "--network_dim", "4", "--debug_report_weights", *extra,
    ]


MASKED_LOSS = ("--alpha_mask", "--masked_loss", "--optimizer_type", "torch.optim.SGD", "--learning_rate", "0.5",
               "--max_train_steps", "3", "--save_precision", "float")
# A NaN written into rank 1's gradient after the gradient all-reduce, so only rank 1 sees it; a state every 2 steps.
NAN_ON_ONE_RANK = ("--mixed_precision", "fp16", "--train_batch_size", "1", "--max_train_steps", "6",
                   "--grad_guard_preset", "stable", "--debug_inject_grad", "2=nan@1",
                   "--save_state", "--save_every_n_steps", "2")
GUARD_SKIP = ("--mixed_precision", "fp16", "--max_train_steps", "3", "--grad_guard_preset", "minimal",
              "--debug_inject_grad", "2=nan@1")
# SGD, not Adam: Adam's normalisation turns rounding differences of tiny gradients into visible ones.
OTHER_NETWORK_FLAGS = ("--optimizer_type", "torch.optim.SGD", "--optimizer_args", "momentum=0.9",
                       "--learning_rate", "0.5", "--max_train_steps", "3", "--save_precision", "float")
OTHER_NETWORKS = {
    "dylora": ("--network_module", "networks.dylora", "--network_args", "unit=2"),
    "lokr": ("--network_module", "lycoris.kohya", "--network_args", "algo=lokr", "factor=-1"),
}


def full_sdxl_argv(tiny_models, dataset: Path, output_dir: Path, batch: str) -> list[str]:
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", "ft", "--seed", "7", "--max_data_loader_n_workers", "0",
        "--debug_report_weights", "--alpha_mask", "--masked_loss", "--optimizer_type", "torch.optim.SGD",
        "--optimizer_args", "momentum=0.9", "--learning_rate", "0.05", "--max_train_steps", "3",
        "--save_model_as", "safetensors", "--save_precision", "float", "--train_batch_size", batch]


class TwoProcessRun(NamedTuple):
    output_dir: Path
    result: subprocess.CompletedProcess


# The two-process trainings each test checks.
RUNS_OF_TEST = {
    "test_two_processes_batch_one_equal_one_process_batch_two": ("masked_loss",),
    "test_nan_on_one_rank_lowers_the_scale_on_both_and_resume_is_exact": ("nan_on_one_rank", "nan_killed",
                                                                          "nan_resumed"),
    "test_resume_with_another_world_size_is_refused": ("nan_on_one_rank",),
    "test_guard_skip_decided_on_one_rank_is_taken_by_both": ("guard_skip",),
    "test_full_sdxl_two_processes_equal_one_process_batch_two": ("full_sdxl",),
}


def runs_of(item: pytest.Item) -> tuple[str, ...]:
    if item.originalname == "test_two_processes_equal_one_process_for_other_network_types":
        return (item.callspec.params["network"],)
    return RUNS_OF_TEST.get(item.originalname, ())


@pytest.fixture(scope="module")
def two_process_runs(request, tiny_models, masked_dataset, demo_dataset, tmp_path_factory) -> dict[str, TwoProcessRun]:
    """name -> (output folder, result) of the two-process trainings the selected tests of this module check, each
    trained once: the killed one by its own launch of the entry script (before its resume), all the others in
    one launch (``torchrun_sequence``: a launch's processes start in ~10 s, several times a tiny training)."""
    root = tmp_path_factory.mktemp("two_process_runs")
    selected = {name for item in request.session.items if getattr(item, "module", None) is request.module
                for name in runs_of(item)}
    killed_dir = root / "nan_killed"  # the killed run's folder, where its resume continues
    # in this order (the guard's run has no --seed: first, as in a fresh process, though the ranks are reseeded)
    guard_skip = common(tiny_models, demo_dataset, root / "guard_skip", *GUARD_SKIP)
    del guard_skip[guard_skip.index("--seed"):guard_skip.index("--seed") + 2]
    runs = {
        "guard_skip": ("sdxl_train_network", guard_skip),
        "nan_on_one_rank": ("sdxl_train_network", common(tiny_models, demo_dataset, root / "nan_on_one_rank",
                                                         *NAN_ON_ONE_RANK)),
        "nan_resumed": ("sdxl_train_network", common(tiny_models, demo_dataset, killed_dir, *NAN_ON_ONE_RANK,
                                                     "--resume", "auto")),
        "masked_loss": ("sdxl_train_network", common(tiny_models, masked_dataset, root / "masked_loss",
                                                     "--train_batch_size", "1", *MASKED_LOSS)),
        **{name: ("sdxl_train_network", common(tiny_models, masked_dataset, root / name, "--train_batch_size", "1",
                                               *OTHER_NETWORK_FLAGS, *network))
           for name, network in OTHER_NETWORKS.items()},
        "full_sdxl": ("sdxl_train", full_sdxl_argv(tiny_models, masked_dataset, root / "full_sdxl", "1")),
    }
    found = {}
    if "nan_killed" in selected:
        killed = launch(common(tiny_models, demo_dataset, killed_dir, *NAN_ON_ONE_RANK, "--debug_kill_in_state_write",
                               "2"))
        found["nan_killed"] = TwoProcessRun(killed_dir, killed)
    results = launch_in_sequence({name: run for name, run in runs.items() if name in selected}, root / "logs", ENV,
                                 master_port=MASTER_PORT)
    for name, result in results.items():
        found[name] = TwoProcessRun(killed_dir if name == "nan_resumed" else root / name, result)
    return found


def finished(runs: dict[str, TwoProcessRun], name: str) -> TwoProcessRun:
    run = runs[name]
    assert run.result.returncode == 0, (run.result.stdout + run.result.stderr)[-4000:]
    return run


def test_two_processes_batch_one_equal_one_process_batch_two(two_process_runs, tiny_models, masked_dataset, tmp_path):
    """Masked loss of different areas: the global exact normalisation makes the split irrelevant."""
    two_dir, two = finished(two_process_runs, "masked_loss")
    in_this_process(common(tiny_models, masked_dataset, tmp_path / "one", "--train_batch_size", "2", *MASKED_LOSS))
    hashes = rank_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]  # both ranks hold the same LoRA
    a = lora.read_lora_file(str(two_dir / "last.safetensors"))
    b = lora.read_lora_file(str(tmp_path / "one" / "last.safetensors"))
    for key in a:  # measured: at most 1 ulp (1.2e-7 on a weight near 1)
        assert torch.allclose(a[key], b[key], rtol=1e-5, atol=1e-7), key
    assert any(a[key].abs().sum() > 0 for key in a if "lora_up" in key)


def test_nan_on_one_rank_lowers_the_scale_on_both_and_resume_is_exact(two_process_runs):
    # The loss scaler's found-inf flag must be agreed so that both ranks skip and both lower the scale.
    reference_dir, reference = finished(two_process_runs, "nan_on_one_rank")
    hashes = rank_hashes(reference)
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    rows = [row.split(",") for row in (reference_dir / "gradient_logs+last.txt").read_text().splitlines()[1:]]
    assert [row[6] for row in rows] == ["65536.0", "65536.0"] + ["32768.0"] * 4  # the scale used at each step

    crashed = two_process_runs["nan_killed"].result  # its own launch, killed writing the step-4 state
    assert crashed.returncode != 0
    killed_dir, resumed = finished(two_process_runs, "nan_resumed")  # --resume auto in its folder
    assert "resuming from" in resumed.stdout
    assert (killed_dir / "last.safetensors").read_bytes() == (reference_dir / "last.safetensors").read_bytes()
    assert (killed_dir / "gradient_logs+last.txt").read_text() == \
        (reference_dir / "gradient_logs+last.txt").read_text()


def test_resume_with_another_world_size_is_refused(two_process_runs, tiny_models, demo_dataset, tmp_path, capsys):
    """The two-process run's state, resumed by one process with otherwise the same options."""
    state = finished(two_process_runs, "nan_on_one_rank").output_dir / "last-step00000002-state"
    error = train_expecting_user_error(common(tiny_models, demo_dataset, tmp_path, *NAN_ON_ONE_RANK, "--resume",
                                              str(state)), capsys)
    assert "world_size=2, this run has world_size=1" in error, error


def test_guard_skip_decided_on_one_rank_is_taken_by_both(two_process_runs):
    """Immediate NaN skipping: only rank 1 sees the NaN, both ranks skip the step. Without --seed:
    the ranks must still agree on one (else their LoRA initialisations differ)."""
    _, result = finished(two_process_runs, "guard_skip")
    assert "--seed not given: using" in result.stdout
    hashes = rank_hashes(result)
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    assert result.stdout.count("skipped: guard 1,") == 2


@pytest.mark.parametrize("network", list(OTHER_NETWORKS))
def test_two_processes_equal_one_process_for_other_network_types(two_process_runs, tiny_models, masked_dataset,
                                                                 tmp_path, network):
    """Momentum exposes any gradient a process invents: DyLoRA leaves the rank slices not drawn
    this step without a gradient (the optimizer skips them), and 2 processes must leave them so too."""
    two_dir, two = finished(two_process_runs, network)
    in_this_process(common(tiny_models, masked_dataset, tmp_path / "one", "--train_batch_size", "2",
                           *OTHER_NETWORK_FLAGS, *OTHER_NETWORKS[network]))
    hashes = rank_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    a = lora.read_lora_file(str(two_dir / "last.safetensors"))
    b = lora.read_lora_file(str(tmp_path / "one" / "last.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-5, atol=1e-6), key


@pytest.mark.slow
def test_full_sdxl_two_processes_equal_one_process_batch_two(two_process_runs, tiny_models, masked_dataset, tmp_path):
    """sdxl_train.py (the whole UNet trains): 2 processes of batch 1 write the checkpoint 1 process of batch 2
    writes, to float32 rounding of the gradients' sums (SGD with momentum, masked loss of different areas)."""
    from safetensors.torch import load_file

    two_dir, two = finished(two_process_runs, "full_sdxl")
    in_this_process(full_sdxl_argv(tiny_models, masked_dataset, tmp_path / "one", "2"), script="sdxl_train")
    hashes = rank_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]  # both ranks hold the same model
    a, b = load_file(two_dir / "ft.safetensors"), load_file(tmp_path / "one" / "ft.safetensors")
    base = load_file(tiny_models["sdxl_file"])
    assert a.keys() == b.keys()
    unet = [key for key in a if key.startswith("model.diffusion_model.")]
    assert any(not torch.equal(a[key], base[key].float()) for key in unet)  # it trained
    for key in a:  # measured: at most 1 ulp (1.2e-7 on a weight near 1)
        assert torch.allclose(a[key], b[key], rtol=1e-5, atol=1e-7), key
