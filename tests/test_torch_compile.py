"""kohya's --torch_compile: the compiled tiny SDXL trains (fp16, loss scaler, stable guard, gradient
checkpointing, dropout) and SIGKILL + --resume auto gives the bytes of the same compiled run
uninterrupted; the kohya_ss GUI's ``accelerate launch --dynamo_backend no`` compiles nothing.

Compiling is slow on a CPU (inductor builds C++ kernels: minutes on a cold cache, ~20 s warm), so
one compiled training is shared by the tests and its dataset has one bucket (one graph).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import model_args, run_trainer, run_trainer_output, train_expecting_user_error

from library import torch_compile

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "SOURCE_DATE_EPOCH": "1700000000", "OMP_NUM_THREADS": "1"}
COMPILE_TIMEOUT_S = 1200  # a cold inductor cache on a busy 2-core machine


def compiled_args(tiny_models, dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", "run", "--seed", "5", "--max_data_loader_n_workers", "0",
        "--network_dim", "4", "--learning_rate", "1e-3", "--mixed_precision", "fp16", "--grad_guard_preset", "stable",
        "--gradient_checkpointing", "--gradient_accumulation_steps", "2", "--max_train_steps", "8", "--save_state",
        "--save_every_n_steps", "2", "--network_train_unet_only", "--torch_compile",
        # dropout inside the compiled graph draws from inductor's RNG, seeded from torch's: a resume
        # must continue that stream exactly (module_dropout would break the graph at every layer)
        "--network_dropout", "0.1", "--network_args", "rank_dropout=0.1",
        *extra,
    ]


def launch(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "sdxl_train_network.py"), *argv], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def compiled_run(tiny_models, demo_dataset, tmp_path_factory) -> Path:
    """The compiled training, uninterrupted, in this process (so the compile can be checked)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    output_dir = tmp_path_factory.mktemp("compiled")
    start = time.perf_counter()
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    os.environ["SOURCE_DATE_EPOCH"] = ENV["SOURCE_DATE_EPOCH"]  # the file's metadata times, as in the subprocesses
    try:
        run_trainer("sdxl_train_network", compiled_args(tiny_models, demo_dataset, output_dir))
    finally:
        if epoch is None:
            del os.environ["SOURCE_DATE_EPOCH"]
        else:
            os.environ["SOURCE_DATE_EPOCH"] = epoch
    print(f"compiled training (8 steps, compile included): {time.perf_counter() - start:.1f} s")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # the UNet really was compiled
    torch._dynamo.reset()
    return output_dir


@pytest.mark.device
def test_compiled_training_learns_with_the_scaler_and_guard(compiled_run):
    rows = (compiled_run / "gradient_logs+run.txt").read_text().strip().splitlines()
    header, values = rows[0].split(","), [dict(zip(rows[0].split(","), row.split(","))) for row in rows[1:]]
    assert [row["Step"] for row in values] == [str(step) for step in range(1, 9)]
    assert "Scale" in header and "CosineSim" in header
    assert all(float(row["Gradient Norm"]) > 0 for row in values)  # gradients flowed through the compiled graph
    from safetensors.torch import load_file

    weights = load_file(str(compiled_run / "run.safetensors"))
    ups = [value for key, value in weights.items() if key.endswith("lora_up.weight")]
    assert ups and all(torch.isfinite(up).all() for up in ups) and any(up.abs().sum() > 0 for up in ups)


@pytest.mark.device
def test_sigkill_after_a_state_then_resume_gives_the_compiled_runs_bytes(
        compiled_run, tiny_models, demo_dataset, tmp_path):
    output_dir = tmp_path / "run"
    argv = compiled_args(tiny_models, demo_dataset, output_dir)
    process = launch(argv)
    tracker = output_dir / "run-state.json"
    deadline = time.monotonic() + COMPILE_TIMEOUT_S
    while not (tracker.is_file() and json.loads(tracker.read_text())["global_step"] >= 4):
        assert process.poll() is None and time.monotonic() < deadline, "no step-4 state before the end"
        time.sleep(0.05)
    time.sleep(random.Random(0).uniform(0.0, 0.3))
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    # the resume in this process (it needs none of its own): inductor's kernels of the fixture's compile are
    # loaded, not built again
    torch._dynamo.reset()
    try:
        resumed = run_trainer_output("sdxl_train_network", argv + ["--resume", "auto"])
    finally:
        torch._dynamo.reset()
    assert "--resume auto: resuming from" in resumed and "--torch_compile: UNet compiled" in resumed
    assert (output_dir / "run.safetensors").read_bytes() == (compiled_run / "run.safetensors").read_bytes()
    assert (output_dir / "gradient_logs+run.txt").read_text() == (compiled_run / "gradient_logs+run.txt").read_text()


def test_the_gui_launch_compiles_nothing(tiny_models, demo_dataset, tmp_path):
    """What the kohya_ss GUI runs: accelerate launch --dynamo_backend no --dynamo_mode default, a TOML with
    dynamo_backend = "no"; with --torch_compile among the additional parameters nothing is compiled (kohya)."""
    config = tmp_path / "config_lora.toml"
    config.write_text(f'dynamo_backend = "no"\nmax_train_steps = 1\ntrain_data_dir = "{demo_dataset}"\n'
                      f'output_dir = "{tmp_path / "out"}"\nresolution = "64"\ncaption_extension = ".txt"\n'
                      f'max_data_loader_n_workers = 0\nnetwork_train_unet_only = true\n')
    command = [sys.executable, "-m", "accelerate.commands.launch", "--dynamo_backend", "no", "--dynamo_mode", "default",
               "--mixed_precision", "no", "--num_processes", "1", "--num_machines", "1",
               "--num_cpu_threads_per_process", "1", str(REPO / "sdxl_train_network.py"),
               *model_args(tiny_models, "sdxl"), "--config_file", str(config), "--torch_compile"]
    result = subprocess.run(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "--torch_compile with --dynamo_backend no: nothing is compiled" in result.stdout
    assert "compiled (" not in result.stdout
    assert (tmp_path / "out" / "last.safetensors").is_file()


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    torch_compile.add_arguments(parser)
    return parser.parse_args(argv)


def test_compile_settings_come_from_accelerate_launch_and_the_flags(monkeypatch):
    assert torch_compile.compile_options(parsed()) is None  # kohya: no --torch_compile, nothing compiled
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")  # accelerate launch --dynamo_backend inductor
    assert torch_compile.compile_options(parsed()) is None  # ... alone compiles nothing, as in kohya
    assert torch_compile.compile_options(parsed("--torch_compile")) == {
        "backend": "inductor", "mode": "default", "fullgraph": False}
    # accelerate launch --dynamo_mode max-autotune --dynamo_use_fullgraph --dynamo_use_dynamic
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "max-autotune")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_FULLGRAPH", "True")
    monkeypatch.setenv("ACCELERATE_DYNAMO_USE_DYNAMIC", "True")
    assert torch_compile.compile_options(parsed("--torch_compile", "--dynamo_backend", "AOT_EAGER")) == {
        "backend": "aot_eager", "mode": "max-autotune", "fullgraph": True, "dynamic": True}
    assert torch_compile.compile_options(parsed("--torch_compile", "--dynamo_mode", "default"))["mode"] == "default"
    assert torch_compile.compile_options(parsed("--torch_compile", "--dynamo_backend", "no")) is None


def test_a_backend_this_torch_lacks_is_refused_before_loading(tiny_models, demo_dataset, tmp_path, capsys):
    argv = model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(demo_dataset), "--output_dir", str(tmp_path / "out"), "--torch_compile",
        "--dynamo_backend", "tensort"]  # in kohya's list, in no torch
    error = train_expecting_user_error(argv, capsys)
    assert error.startswith("error: --dynamo_backend tensort: not a torch.compile backend") and "inductor" in error
    assert not (tmp_path / "out").exists()
