"""What the self-healing costs a healthy run: the healthy-point snapshot's time and memory.

    python benchmarks/bench_healing.py [--steps 30] [--every 50]

1. The tiny SDXL, the quickstart's run (fp16, ``--grad_guard_preset stable``, rank 16, conv rank 16) in
   this process with a snapshot at every step (``--rewind_every_n_steps 1``): the median time of an
   optimizer step (start of one step to the start of the next, snapshot excluded) and of a snapshot
   (``RunStates.capture``), and the snapshot's bytes. The overhead at the default cadence is
   ``snapshot / (every * step)``.
2. A full-size SDXL LoRA (rank 16, UNet + both text encoders: the shapes of ``bench_grad_guard.py``)
   with AdamW state: the snapshot of the weights and both moments, timed on this machine's CPU.

The last line: ``snapshot_overhead_pct=<tiny SDXL, at --every> snapshot_mib=<tiny> full_snapshot_mib=<x>
full_snapshot_s=<x>``. Target: overhead <= 2% at the default cadence (50). Not run in CI.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def train_quickstart(steps: int, *extra: str) -> None:
    """The quickstart's run on the tiny SDXL (fp16, ``--grad_guard_preset stable``, rank 16, conv rank 16)
    for ``steps`` optimizer steps in this process, its output silenced; ``extra``: more flags."""
    import sdxl_train_network
    from tools.build_tiny_models import build_tiny_models
    from tools.make_demo_dataset import make_demo_dataset

    with tempfile.TemporaryDirectory() as tmp:
        models = build_tiny_models(Path(tmp) / "models")
        make_demo_dataset(str(Path(tmp) / "dataset"))
        argv = ["--pretrained_model_name_or_path", str(models["sdxl_file"]), "--model_config_dir",
                str(models["sdxl_config"]), "--train_data_dir", str(Path(tmp) / "dataset"), "--caption_extension",
                ".txt", "--resolution", "64", "--output_dir", str(Path(tmp) / "out"), "--network_dim", "16",
                "--network_alpha", "16", "--network_args", "conv_dim=16", "conv_alpha=16", "--learning_rate",
                "5e-3", "--mixed_precision", "fp16", "--max_train_steps", str(steps), "--seed", "42",
                "--max_data_loader_n_workers", "0", "--grad_guard_preset", "stable", *extra]
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            sdxl_train_network.main(argv)


def timed_run(trainer_class: type, train: Callable[[], None]) -> dict[str, float]:
    """``train()`` with every optimizer step of ``trainer_class`` and every healthy-point capture
    (``RunStates.capture``) timed: the median step (start to start, the capture in between excluded) and
    capture, past the first two, and the last capture's bytes."""
    from library.train_state import RunStates

    step_starts, captures, sizes = [], [], []
    original_step, original_capture = trainer_class.train_step, RunStates.capture

    def train_step(self, run, window):
        step_starts.append(time.perf_counter())
        return original_step(self, run, window)

    def capture(self, step, position):
        start = time.perf_counter()
        original_capture(self, step, position)
        captures.append(time.perf_counter() - start)
        sizes.append(self.healthy_point_bytes())

    trainer_class.train_step, RunStates.capture = train_step, capture
    try:
        train()
    finally:
        trainer_class.train_step, RunStates.capture = original_step, original_capture
    step_times = [b - a - snapshot for a, b, snapshot in zip(step_starts, step_starts[1:], captures[1:])]
    return {"step_s": statistics.median(step_times[2:]), "snapshot_s": statistics.median(captures[2:]),
            "snapshot_bytes": sizes[-1]}


def tiny_sdxl(steps: int) -> dict[str, float]:
    import sdxl_train_network

    return timed_run(sdxl_train_network.SdxlNetworkTrainer,
                     lambda: train_quickstart(steps, "--rewind_every_n_steps", "1"))


def full_size_snapshot(repeats: int) -> dict[str, float]:
    """A full-size LoRA's weights and AdamW moments copied as ``RunStates.capture`` copies them."""
    from bench_grad_guard import lora_gradient_shapes

    from library.train_state import copied

    parameters = [torch.nn.Parameter(torch.randn(shape) * 0.01) for shape in lora_gradient_shapes()]
    optimizer = torch.optim.AdamW(parameters, lr=1e-4)
    for parameter in parameters:
        parameter.grad = torch.randn_like(parameter)
    optimizer.step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        snapshot = {"network": copied({str(i): p.detach() for i, p in enumerate(parameters)}),
                    "optimizer": copied(optimizer.state_dict())}
        times.append(time.perf_counter() - start)
    size = sum(t.numel() * t.element_size() for t in snapshot["network"].values())
    size += sum(t.numel() * t.element_size() for state in snapshot["optimizer"]["state"].values()
                for t in state.values() if torch.is_tensor(t))
    return {"parameters": sum(p.numel() for p in parameters), "snapshot_s": statistics.median(times),
            "snapshot_bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="tiny SDXL optimizer steps (default 30)")
    parser.add_argument("--every", type=int, default=50, help="snapshot cadence to report (default 50)")
    parser.add_argument("--repeats", type=int, default=3, help="full-size snapshots to time (default 3)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tiny = tiny_sdxl(args.steps)
    print(f"tiny SDXL: step {tiny['step_s'] * 1000:.1f} ms, snapshot {tiny['snapshot_s'] * 1000:.2f} ms, "
          f"{tiny['snapshot_bytes'] / 2**20:.2f} MiB (LoRA + AdamW state + scaler, guard, monitor, RNGs)")
    overhead = 100 * tiny["snapshot_s"] / (args.every * tiny["step_s"])
    every_step = 100 * tiny["snapshot_s"] / tiny["step_s"]
    print(f"overhead: {overhead:.3f}% at one snapshot per {args.every} steps ({every_step:.2f}% at one per step)")
    full = full_size_snapshot(args.repeats)
    print(f"full-size SDXL LoRA rank 16: {full['parameters'] / 1e6:.1f} M parameters, snapshot "
          f"{full['snapshot_bytes'] / 2**20:.0f} MiB (weights + AdamW moments) in {full['snapshot_s']:.3f} s on CPU")
    print(f"snapshot_overhead_pct={overhead:.3f} snapshot_mib={tiny['snapshot_bytes'] / 2**20:.2f} "
          f"full_snapshot_mib={full['snapshot_bytes'] / 2**20:.0f} full_snapshot_s={full['snapshot_s']:.3f}")


if __name__ == "__main__":
    main()
