"""kohya's --torch_compile: the compiled tiny SDXL trains (fp16, loss scaler, stable guard, gradient
checkpointing, dropout) and SIGKILL + --resume auto gives the bytes of the same compiled run
uninterrupted; the kohya_ss GUI's ``accelerate launch --dynamo_backend no`` compiles nothing.

What each part proves, and with which backend. Inductor builds one C++ kernel per fused operation: the
tiny UNet's training graph is 272 kernels, seconds each on a CPU (25 minutes built 191 of them on a cold
cache on a shared 2-core machine), so on a CPU the whole-run tests use ``--dynamo_backend aot_eager``,
kohya's name for the backend that runs everything inductor receives except its code generation (the GPU
run, ``--device cuda``, keeps inductor):

* the trainings (``aot_eager``): TorchDynamo captures the LoRA'd UNet with gradient checkpointing, fp16
  autocast and the dropouts in one graph per training call (no graph break, no recompile between steps;
  counted), AOTAutograd builds its joint forward/backward, and the run trains with the loss scaler and
  the stable guard; a SIGKILL after a saved state then ``--resume auto`` gives the uninterrupted run's
  bytes (file and gradient log);
* inductor's own part (``test_inductor_dropout_continues_from_the_saved_random_state``): its generated
  kernels draw the dropout masks from its own generator, seeded from torch's at each call, so the random
  state a saved state holds continues them exactly: the property the resume relies on under inductor,
  on a LoRA'd layer (few kernels) with the same fp16 autocast, checkpointing and dropouts.
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
from typing import Iterator

import pytest
import torch
from conftest import model_args, run_trainer, run_trainer_output, train_expecting_user_error

from library import torch_compile

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "SOURCE_DATE_EPOCH": "1700000000", "OMP_NUM_THREADS": "1"}
COMPILE_TIMEOUT_S = 600  # the capture of the tiny UNet on a busy 2-core machine


def whole_run_backend() -> str:
    """The whole-run tests' backend: aot_eager on a CPU (see the module docstring); inductor in the GPU run
    (``--device cuda``), where its kernels are what a user's GPU compiles."""
    import conftest

    return "inductor" if conftest.DEVICE == "cuda" else "aot_eager"


def compiled_args(tiny_models, dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", "run", "--seed", "5", "--max_data_loader_n_workers", "0",
        "--network_dim", "4", "--learning_rate", "1e-3", "--mixed_precision", "fp16", "--grad_guard_preset", "stable",
        "--gradient_checkpointing", "--gradient_accumulation_steps", "2", "--max_train_steps", "4", "--save_state",
        "--save_every_n_steps", "1", "--network_train_unet_only", "--torch_compile", "--dynamo_backend", whole_run_backend(),
        # dropout inside the compiled graph: a resume must continue its random stream exactly
        # (module_dropout would break the graph at every layer)
        "--network_dropout", "0.1", "--network_args", "rank_dropout=0.1",
        *extra,
    ]


def launch(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(REPO / "sdxl_train_network.py"), *argv], cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def compiled_run(tiny_models, demo_dataset, tmp_path_factory) -> Iterator[Path]:
    """The compiled training, uninterrupted, in this process (so the compile can be checked). Its compiled
    graph stays for the resume in this process (the same guards hold for the resumed run's UNet) and is
    dropped after the module's tests."""
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
    print(f"compiled training (4 steps, compile included): {time.perf_counter() - start:.1f} s")
    # one graph for the whole run: no graph break, no recompile between steps or for the effect monitor's
    # probes (their calls without gradients run the uncompiled UNet; compiled, they were 2 more graphs)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    yield output_dir
    torch._dynamo.reset()


@pytest.mark.device
def test_compiled_training_learns_with_the_scaler_and_guard(compiled_run):
    rows = (compiled_run / "gradient_logs+run.txt").read_text().strip().splitlines()
    header, values = rows[0].split(","), [dict(zip(rows[0].split(","), row.split(","))) for row in rows[1:]]
    assert [row["Step"] for row in values] == [str(step) for step in range(1, 5)]
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
    while not (tracker.is_file() and json.loads(tracker.read_text())["global_step"] >= 2):
        assert process.poll() is None and time.monotonic() < deadline, "no step-2 state before the end"
        time.sleep(0.05)
    time.sleep(random.Random(0).uniform(0.0, 0.3))
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    # the resume in this process (it needs none of its own), with the fixture's compiled graph
    resumed = run_trainer_output("sdxl_train_network", argv + ["--resume", "auto"])
    assert "--resume auto: resuming from" in resumed and "--torch_compile: UNet compiled" in resumed
    assert (output_dir / "run.safetensors").read_bytes() == (compiled_run / "run.safetensors").read_bytes()
    assert (output_dir / "gradient_logs+run.txt").read_text() == (compiled_run / "gradient_logs+run.txt").read_text()


@pytest.mark.device
def test_inductor_dropout_continues_from_the_saved_random_state():
    """Inductor's part of the resume: a LoRA'd layer (dropout and rank dropout, as the trainings') under
    fp16 autocast and gradient checkpointing, compiled by inductor. Its dropout masks come from inductor's
    generated kernels (not torch's eager draws: the outputs differ from the uncompiled layer's with the
    same seed), seeded from torch's generator at each call: after the random state is put back as a
    resume puts it back (``train_state.set_rng_state``), the next steps give the same outputs and
    gradients, bit for bit, and the masks change from step to step."""
    from library import train_state
    from networks.lora import LoRAModule

    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 32)
    layer.requires_grad_(False)
    lora = LoRAModule("lora_unet_layer", layer, 1.0, 8, 8, dropout=0.25, rank_dropout=0.25)
    lora.apply_to()
    torch.nn.init.normal_(lora.lora_up.weight)  # a trained LoRA: its output shows the masks
    inputs = torch.randn(4, 32)

    def checkpointed(x: torch.Tensor) -> torch.Tensor:  # the UNet's blocks run like this with --gradient_checkpointing
        return torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)

    compiled = torch.compile(checkpointed, backend="inductor")

    def step(model) -> list[bytes]:
        with torch.autocast("cpu", dtype=torch.float16):
            output = model(inputs)
        output.float().square().sum().backward()
        results = [output.detach(), lora.lora_down.weight.grad, lora.lora_up.weight.grad]
        lora.zero_grad(set_to_none=True)
        return [tensor.numpy().tobytes() for tensor in results]

    try:
        torch.manual_seed(1)
        eager = step(checkpointed)
        torch.manual_seed(1)
        first = step(compiled)  # compiles
        assert first[0] != eager[0]  # the masks are inductor's draws, not torch's eager ones
        saved = train_state.rng_state()
        uninterrupted = [step(compiled) for _ in range(3)]
        train_state.set_rng_state(saved)
        resumed = [step(compiled) for _ in range(3)]
    finally:
        torch._dynamo.reset()
    assert resumed == uninterrupted
    assert len({result[0] for result in uninterrupted}) == 3  # new masks at every step


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
