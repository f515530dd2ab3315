"""Two CPU processes (torchrun, gloo): rank-consistent guard, scaler, loss normalisation and resume."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import model_args, run_trainer_output, train_expecting_user_error
from PIL import Image

from networks import lora

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "SOURCE_DATE_EPOCH": "1700000000", "OMP_NUM_THREADS": "1"}


def launch(argv: list[str], processes: int, check: bool = True,
           script: str = "sdxl_train_network.py") -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node N <script> ...`` (plain python for one process)."""
    if processes == 1:
        command = [sys.executable, str(REPO / script)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                   "--master_port", str(29500 + os.getpid() % 1000), str(REPO / script)]
    result = subprocess.run(command + argv, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    if check:
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return result


def in_this_process(argv: list[str]) -> None:
    """The one-process run in the test's process (saves a process start); its weights are read from its file
    (--debug_report_weights writes to the process's stdout file descriptor, which a test's captured stdout lacks)."""
    run_trainer_output("sdxl_train_network", [arg for arg in argv if arg != "--debug_report_weights"])


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


def test_two_processes_batch_one_equal_one_process_batch_two(tiny_models, masked_dataset, tmp_path):
    """Masked loss of different areas: the global exact normalisation makes the split irrelevant."""
    flags = ("--alpha_mask", "--masked_loss", "--optimizer_type", "torch.optim.SGD", "--learning_rate", "0.5",
             "--max_train_steps", "3", "--save_precision", "float")
    two = launch(common(tiny_models, masked_dataset, tmp_path / "two", "--train_batch_size", "1", *flags), 2)
    in_this_process(common(tiny_models, masked_dataset, tmp_path / "one", "--train_batch_size", "2", *flags))
    hashes = rank_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]  # both ranks hold the same LoRA
    a = lora.read_lora_file(str(tmp_path / "two" / "last.safetensors"))
    b = lora.read_lora_file(str(tmp_path / "one" / "last.safetensors"))
    for key in a:  # measured: at most 1 ulp (1.2e-7 on a weight near 1)
        assert torch.allclose(a[key], b[key], rtol=1e-5, atol=1e-7), key
    assert any(a[key].abs().sum() > 0 for key in a if "lora_up" in key)


# A NaN written into rank 1's gradient after the gradient all-reduce, so only rank 1 sees it; a state every 2 steps.
NAN_ON_ONE_RANK = ("--mixed_precision", "fp16", "--train_batch_size", "1", "--max_train_steps", "6",
                   "--grad_guard_preset", "stable", "--debug_inject_grad", "2=nan@1",
                   "--save_state", "--save_every_n_steps", "2")


@pytest.fixture(scope="module")
def nan_on_one_rank(tiny_models, demo_dataset, tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """(output folder, result) of the uninterrupted two-process run with the NaN on rank 1: the reference of the
    kill + resume, and the states the one-process resume is refused."""
    output_dir = tmp_path_factory.mktemp("nan_on_one_rank")
    return output_dir, launch(common(tiny_models, demo_dataset, output_dir, *NAN_ON_ONE_RANK), 2)


def test_nan_on_one_rank_lowers_the_scale_on_both_and_resume_is_exact(nan_on_one_rank, tiny_models, demo_dataset,
                                                                      tmp_path):
    # The loss scaler's found-inf flag must be agreed so that both ranks skip and both lower the scale.
    reference_dir, reference = nan_on_one_rank
    hashes = rank_hashes(reference)
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    rows = [row.split(",") for row in (reference_dir / "gradient_logs+last.txt").read_text().splitlines()[1:]]
    assert [row[6] for row in rows] == ["65536.0", "65536.0"] + ["32768.0"] * 4  # the scale used at each step

    killed_dir = tmp_path / "killed"
    crashed = launch(common(tiny_models, demo_dataset, killed_dir, *NAN_ON_ONE_RANK, "--debug_kill_in_state_write",
                            "2"), 2, check=False)
    assert crashed.returncode != 0
    resumed = launch(common(tiny_models, demo_dataset, killed_dir, *NAN_ON_ONE_RANK, "--resume", "auto"), 2)
    assert "resuming from" in resumed.stdout
    assert (killed_dir / "last.safetensors").read_bytes() == (reference_dir / "last.safetensors").read_bytes()
    assert (killed_dir / "gradient_logs+last.txt").read_text() == \
        (reference_dir / "gradient_logs+last.txt").read_text()


def test_resume_with_another_world_size_is_refused(nan_on_one_rank, tiny_models, demo_dataset, tmp_path, capsys):
    """The two-process run's state, resumed by one process with otherwise the same options."""
    state = nan_on_one_rank[0] / "last-step00000002-state"
    error = train_expecting_user_error(common(tiny_models, demo_dataset, tmp_path, *NAN_ON_ONE_RANK, "--resume",
                                              str(state)), capsys)
    assert "world_size=2, this run has world_size=1" in error, error


def test_guard_skip_decided_on_one_rank_is_taken_by_both(tiny_models, demo_dataset, tmp_path):
    """Immediate NaN skipping: only rank 1 sees the NaN, both ranks skip the step. Without --seed:
    the ranks must still agree on one (else their LoRA initialisations differ)."""
    argv = common(tiny_models, demo_dataset, tmp_path / "out", "--mixed_precision", "fp16",
                  "--max_train_steps", "3", "--grad_guard_preset", "minimal", "--debug_inject_grad", "2=nan@1")
    del argv[argv.index("--seed"):argv.index("--seed") + 2]
    result = launch(argv, 2)
    hashes = rank_hashes(result)
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    assert result.stdout.count("skipped: guard 1,") == 2


@pytest.mark.parametrize("network", [
    ("--network_module", "networks.dylora", "--network_args", "unit=2"),
    ("--network_module", "lycoris.kohya", "--network_args", "algo=lokr", "factor=-1"),
])
def test_two_processes_equal_one_process_for_other_network_types(tiny_models, masked_dataset, tmp_path, network):
    """Momentum exposes any gradient a process invents: DyLoRA leaves the rank slices not drawn
    this step without a gradient (the optimizer skips them), and 2 processes must leave them so too.
    (SGD, not Adam: Adam's normalisation turns rounding differences of tiny gradients into visible ones.)"""
    flags = ("--optimizer_type", "torch.optim.SGD", "--optimizer_args", "momentum=0.9", "--learning_rate", "0.5",
             "--max_train_steps", "3",
             "--save_precision", "float", *network)
    two = launch(common(tiny_models, masked_dataset, tmp_path / "two", "--train_batch_size", "1", *flags), 2)
    in_this_process(common(tiny_models, masked_dataset, tmp_path / "one", "--train_batch_size", "2", *flags))
    hashes = rank_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]
    a = lora.read_lora_file(str(tmp_path / "two" / "last.safetensors"))
    b = lora.read_lora_file(str(tmp_path / "one" / "last.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-5, atol=1e-6), key


@pytest.mark.slow
def test_full_sdxl_two_processes_equal_one_process_batch_two(tiny_models, masked_dataset, tmp_path):
    """sdxl_train.py (the whole UNet trains): 2 processes of batch 1 write the checkpoint 1 process of batch 2
    writes, to float32 rounding of the gradients' sums (SGD with momentum, masked loss of different areas)."""
    from safetensors.torch import load_file

    def argv(output_dir: Path, batch: str) -> list[str]:
        return model_args(tiny_models, "sdxl") + [
            "--train_data_dir", str(masked_dataset), "--caption_extension", ".txt", "--resolution", "64",
            "--output_dir", str(output_dir), "--output_name", "ft", "--seed", "7", "--max_data_loader_n_workers", "0",
            "--debug_report_weights", "--alpha_mask", "--masked_loss", "--optimizer_type", "torch.optim.SGD",
            "--optimizer_args", "momentum=0.9", "--learning_rate", "0.05", "--max_train_steps", "3",
            "--save_model_as", "safetensors", "--save_precision", "float", "--train_batch_size", batch]

    two = launch(argv(tmp_path / "two", "1"), 2, script="sdxl_train.py")
    launch(argv(tmp_path / "one", "2"), 1, script="sdxl_train.py")
    hashes = rank_hashes(two)
    assert len(hashes) == 2 and hashes[0] == hashes[1]  # both ranks hold the same model
    a, b = load_file(tmp_path / "two" / "ft.safetensors"), load_file(tmp_path / "one" / "ft.safetensors")
    base = load_file(tiny_models["sdxl_file"])
    assert a.keys() == b.keys()
    unet = [key for key in a if key.startswith("model.diffusion_model.")]
    assert any(not torch.equal(a[key], base[key].float()) for key in unet)  # it trained
    for key in a:  # measured: at most 1 ulp (1.2e-7 on a weight near 1)
        assert torch.allclose(a[key], b[key], rtol=1e-5, atol=1e-7), key
