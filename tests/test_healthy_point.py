"""The healthy point where it fits (``library.healthy_point``, ``--healthy_point_location``): on disk it
restores the very bytes the memory copy restores, a state holds it as a hard link, a kill while it is
written leaves a run that resumes to the uninterrupted bytes, and the folder is gone when a run ends."""
from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import model_args
from safetensors.torch import load_file
from test_training_core import run_script

from library import healthy_point
from library.train_state import RunStates, StateStore


class Wrapped(torch.nn.Module):
    """The network interface RunStates uses."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def training_state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    def load_training_state_dict(self, state) -> None:
        self.module.load_state_dict(state)


def small_run(tmp_path: Path, location: str, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, RunStates]:
    torch.manual_seed(seed)
    network = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(network.parameters(), lr=0.1)
    place = healthy_point.HealthyPointPlace(location, tmp_path / "run-healthy" / healthy_point.file_name(0))
    return network, optimizer, RunStates(StateStore(str(tmp_path), "run", {}), Wrapped(network),
                                         {"optimizer": optimizer}, place=place)


def train_step(network: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    network(torch.rand(1, 3)).sum().backward()  # draws from the RNG the point restores
    optimizer.step()
    optimizer.zero_grad()


def values(network: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = optimizer.state_dict()["state"][0]
    live = [*network.state_dict().values(), state["exp_avg"], state["exp_avg_sq"], torch.get_rng_state()]
    return [value.clone() for value in live]  # the live tensors change in place as training goes on


def test_a_rewind_from_disk_restores_what_a_rewind_from_memory_restores(tmp_path):
    restored = {}
    for location in ("memory", "disk"):
        network, optimizer, states = small_run(tmp_path / location, location)
        train_step(network, optimizer)
        states.capture(1, position=(1, 1))
        for _ in range(2):  # restored twice: the point is not consumed or aliased by the live objects
            train_step(network, optimizer)
            assert states.restore(torch.device("cpu")) == 1
            train_step(network, optimizer)  # the same draws and updates after each restore
            restored.setdefault(location, []).append(values(network, optimizer))
        file = tmp_path / location / "run-healthy" / "healthy_point.pt"
        assert file.is_file() == (location == "disk") and states.healthy_point_bytes() > 0
        states.close()
        assert not (tmp_path / location / "run-healthy").exists()
    for memory, disk in zip(restored["memory"], restored["disk"]):
        assert all(torch.equal(a, b) for a, b in zip(memory, disk))
    assert all(torch.equal(a, b) for a, b in zip(*restored["disk"]))


def test_auto_keeps_a_small_point_in_memory(tmp_path):
    network, optimizer, states = small_run(tmp_path, "auto")
    train_step(network, optimizer)
    states.capture(1, position=(1, 1))
    assert not healthy_point.is_on_disk(states.healthy_point) and not (tmp_path / "run-healthy").exists()
    assert healthy_point.HealthyPointPlace("auto", tmp_path / "x").on_disk(1 << 60)  # an exabyte does not fit


@pytest.mark.parametrize("resumed_location", ["disk", "memory", "auto"])
def test_a_state_holds_the_disk_point_as_a_link_and_resumes_it_anywhere(tmp_path, resumed_location):
    from library.train_state import Progress, verify_state

    network, optimizer, states = small_run(tmp_path, "disk")
    train_step(network, optimizer)
    states.capture(1, position=(1, 1))
    expected = values(network, optimizer)
    train_step(network, optimizer)
    assert states.save("run-state", Progress(global_step=2))
    linked = tmp_path / "run-state" / healthy_point.STATE_FILE
    assert os.path.samefile(linked, tmp_path / "run-healthy" / "healthy_point.pt")  # no second copy on disk
    assert verify_state(tmp_path / "run-state") == (True, "intact")  # the manifest lists its checksum
    train_step(network, optimizer)
    states.capture(3, position=(1, 3))  # the healthy file is replaced: the state's link keeps the old point
    assert not os.path.samefile(linked, tmp_path / "run-healthy" / "healthy_point.pt")
    states.close()
    network, optimizer, states = small_run(tmp_path, resumed_location, seed=1)
    train_step(network, optimizer)
    states.resume(tmp_path / "run-state", torch.device("cpu"))
    assert healthy_point.is_on_disk(states.healthy_point) == (resumed_location != "memory")
    assert states.restore(torch.device("cpu")) == 1
    assert all(torch.equal(a, b) for a, b in zip(values(network, optimizer), expected))


STREAMED_STATE = """
import resource, sys, torch
from library.train_state import Progress, StateStore
# 256 MiB each in 64 tensors of 4 MiB (a model's many tensors: checks that take a temporary per tensor stay small)
weights = {f"unet.block{index}.weight": torch.ones(2**20) for index in range(64)}
components = {"optimizer": {"state": {index: {"momentum_buffer": torch.ones(2**20)} for index in range(64)},
                            "param_groups": []}}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert StateStore(sys.argv[1], "run", {}).save("run-state", Progress(global_step=1), weights, components)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


def test_a_state_is_streamed_to_its_files_not_held_in_memory_a_second_time(tmp_path):
    """A full model's state (weights + optimizer) is as large as the memory it trains in: written as bytes in
    memory first, a 6.6 GB SDXL UNet state went out of memory at 19.2 GB. Here 512 MiB of state raise the peak
    RSS by less than an eighth of it (as bytes: by 512 MiB or more)."""
    from library.train_state import verify_state

    repo = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", STREAMED_STATE, str(tmp_path)], cwd=repo, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip()) < 64, done.stdout
    assert verify_state(tmp_path / "run-state") == (True, "intact")
    saved = load_file(tmp_path / "run-state" / "lora.safetensors")
    assert len(saved) == 64 and all(torch.equal(tensor, torch.ones(2**20)) for tensor in saved.values())


# --------------------------------------------------------------------------- a full fine-tune


def run_full(argv: list[str], expect: int | None = 0) -> subprocess.CompletedProcess:
    """``sdxl_train.py`` in a process of its own (for a run that is killed)."""
    return run_script("sdxl_train.py", argv, expect)


def train_full(argv: list[str]) -> str:
    """``sdxl_train.py`` in this process (a run that is not killed needs no process of its own); its output."""
    from conftest import run_trainer_output

    return run_trainer_output("sdxl_train", argv)


def end_line(output: str) -> str:
    """The run's last line (``done: ...``), found in stdout + the progress bar's stderr."""
    (line,) = re.findall(r"^(?:done|failed): .*$", output, re.M)
    return line


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from tools.make_demo_dataset import make_demo_dataset

    root = tmp_path_factory.mktemp("healthy_dataset")
    make_demo_dataset(str(root), count=4, size=64, repeats=1)
    return root


def diverging_argv(tiny_models, dataset: Path, output_dir: Path, location: str, *extra: str) -> list[str]:
    """A tiny SDXL full fine-tune in fp16 at a learning rate far too high (it diverges within a few steps,
    as tests/test_training_core.py's runs), a healthy point every 2 steps, a state every step. 5 steps: on CPU
    steps 2 and 3 overflow, step 3 rewinds to the initial point, step 4 is the next healthy point (the one the
    kill test dies writing) and step 5 runs after it, in the second epoch (the 3 steps after it that this ran
    before were all overflows the loss scaler skipped: they added nothing)."""
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", "ft", "--seed", "42", "--max_data_loader_n_workers", "0",
        "--mixed_precision", "fp16", "--grad_guard_preset", "stable", "--learning_rate", "1",
        "--optimizer_type", "AdamW", "--max_train_steps", "5", "--rewind_every_n_steps", "2",
        "--save_state", "--save_every_n_steps", "1", "--save_model_as", "safetensors",
        "--healthy_point_location", location, *extra]


COMPARED = ("ft.safetensors", "gradient_logs+ft.txt", "healing_log+ft.txt")


@pytest.fixture(scope="module")
def uninterrupted(tiny_models, dataset, tmp_path_factory):
    """location -> (output folder, stdout) of the uninterrupted diverging run."""
    runs = {}
    for location in ("memory", "disk"):
        output_dir = tmp_path_factory.mktemp(f"healthy_{location}")
        runs[location] = output_dir, train_full(diverging_argv(tiny_models, dataset, output_dir, location))
    return runs


@pytest.mark.slow
def test_a_diverging_full_fine_tune_rewinds_from_disk_to_the_bytes_of_memory(uninterrupted):
    (memory_dir, memory_out), (disk_dir, disk_out) = uninterrupted["memory"], uninterrupted["disk"]
    rewinds = re.findall(r"^step \d+: .*rewound to the healthy point of step \d+", disk_out, re.M)
    assert rewinds, disk_out[-3000:]  # the run diverged and went back to a healthy point read from disk
    assert rewinds == re.findall(r"^step \d+: .*rewound to the healthy point of step \d+", memory_out, re.M)
    assert re.search(r"^healthy point: \d+\.\d+ GiB written to .*ft-healthy", disk_out, re.M)
    assert "healthy point:" not in memory_out
    for name in COMPARED:
        assert (disk_dir / name).read_bytes() == (memory_dir / name).read_bytes(), name
    assert end_line(disk_out) == end_line(memory_out)
    assert not (disk_dir / "ft-healthy").exists()  # gone once the run succeeded
    # the states hold the point as a file (disk) or inside components.pt (memory)
    assert (disk_dir / "ft-state" / healthy_point.STATE_FILE).is_file()
    assert not (memory_dir / "ft-state" / healthy_point.STATE_FILE).exists()


@pytest.mark.slow
def test_killed_while_writing_the_healthy_point_then_resumed_gives_the_uninterrupted_bytes(
        uninterrupted, tiny_models, dataset, tmp_path):
    reference, _ = uninterrupted["memory"]
    argv = diverging_argv(tiny_models, dataset, tmp_path, "disk")
    with open(reference / "healing_log+ft.txt", newline="") as file:
        healthy_steps = [int(row["Step"]) for row in csv.DictReader(file) if row["Event"] == "healthy"]
    # the 1st write is the initial point (step 0); the 2nd dies at its step, whose state comes after it
    killed = run_full(argv + ["--debug_kill_in_healthy_point_write", "2"], expect=None)
    assert killed.returncode == -signal.SIGKILL
    left = [path.name for path in (tmp_path / "ft-healthy").iterdir()]
    assert any(name.startswith(".healthy_point.pt.tmp") for name in left), left  # the half-finished write
    resumed = train_full(argv + ["--resume", "auto"])
    assert f"resumed at step {healthy_steps[1] - 1} " in resumed  # the state before, never the healthy folder
    for name in COMPARED:
        assert (tmp_path / name).read_bytes() == (reference / name).read_bytes(), name
    assert not (tmp_path / "ft-healthy").exists()


@pytest.mark.parametrize("flags, expected", [
    (["--healthy_point_location", "disk"], "--healthy_point_location shapes the rewinds of --rewind_on_divergence"),
    (["--grad_guard_preset", "stable", "--healthy_point_location", "gpu"], "--healthy_point_location: invalid choice"),
])
def test_bad_location_is_one_line_before_the_model_loads(flags, expected, tiny_models, tmp_path, capsys):
    from conftest import train_expecting_user_error

    argv = model_args(tiny_models, "sdxl") + ["--train_data_dir", str(tmp_path), "--output_dir", str(tmp_path / "out"),
                                              *flags]
    assert expected in train_expecting_user_error(argv, capsys, script="sdxl_train")
