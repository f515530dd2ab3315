"""What the EMA of the LoRA weights (``--ema_decay``) costs per optimizer step, and its memory.

    python benchmarks/bench_ema.py [--steps 30] [--repeats 20] [--device cpu|cuda] [--full_step_s S]

1. The tiny SDXL, the quickstart's run (fp16, ``--grad_guard_preset stable``, rank 16, conv rank 16) in
   this process with ``--ema_decay 0.999``: the median time of an optimizer step (start of one step to
   the start of the next) and of the EMA update inside it (``LoraEma.after_optimizer_step``), and the
   average's memory against the LoRA's.
2. A full-size SDXL LoRA (rank 16, UNet + both text encoders: ``bench_grad_guard.lora_gradient_shapes``)
   on ``--device``: the update (one ``torch._foreach_lerp_``) against a per-parameter Python loop, as a
   percentage of a full-size step of ``--full_step_s`` seconds (default: the step measured on this
   device kind, README / docs/gpu.md: 7.15 s on the 2-core CPU, 1.087 s on an H100). On CUDA also the
   update of an average kept on the CPU (``--ema_device cpu``: a device-to-host copy first).

The last line: ``tiny_update_pct=<x> tiny_memory_ratio=<x> full_update_ms=<x> full_update_pct=<x>
full_memory_mib=<x> loop_speedup=<x>``. Target: update <= 2% of a step; memory one copy of the LoRA
weights (ratio 1.0 for float32 LoRA weights). Not run in CI.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Full-size SDXL steps measured with this trainer (README "Full-size SDXL on this machine", docs/gpu.md).
MEASURED_FULL_STEP_S = {"cpu": 7.15, "cuda": 1.087}


def tiny_sdxl(steps: int) -> dict[str, float]:
    """Median step and EMA update seconds of the quickstart run with an EMA, and the memory figures."""
    import sdxl_train_network
    from bench_healing import train_quickstart

    from library.ema import LoraEma

    trainer = sdxl_train_network.SdxlNetworkTrainer
    step_starts, updates, sizes = [], [], {}
    original_step, original_update = trainer.train_step, LoraEma.after_optimizer_step

    def train_step(self, run, window):
        step_starts.append(time.perf_counter())
        sizes["lora"] = sum(p.numel() * p.element_size() for p in run.optimization.trainable_params)
        sizes["ema"] = run.optimization.ema.memory_bytes()
        return original_step(self, run, window)

    def after_optimizer_step(self):
        start = time.perf_counter()
        original_update(self)
        updates.append(time.perf_counter() - start)

    trainer.train_step, LoraEma.after_optimizer_step = train_step, after_optimizer_step
    try:
        train_quickstart(steps, "--ema_decay", "0.999")
    finally:
        trainer.train_step, LoraEma.after_optimizer_step = original_step, original_update
    step_times = [b - a for a, b in zip(step_starts, step_starts[1:])]
    return {"step_s": statistics.median(step_times[2:]), "update_s": statistics.median(updates[2:]),
            "lora_bytes": sizes["lora"], "ema_bytes": sizes["ema"]}


def full_size(device: torch.device, repeats: int) -> dict[str, float]:
    """The update on a full-size LoRA's shapes: fused, per-parameter loop, and (CUDA) the CPU-kept average."""
    from bench_grad_guard import lora_gradient_shapes, time_seconds

    from library.ema import EmaConfig, LoraEma

    generator = torch.Generator().manual_seed(0)
    parameters = [torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.01).to(device))
                  for shape in lora_gradient_shapes()]
    config = EmaConfig(decay=0.999)
    average = LoraEma(parameters, config)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def time_median(function) -> float:
        return time_seconds(function, repeats, synchronize)[1]

    @torch.no_grad()
    def python_loop() -> None:
        for kept, parameter in zip(average.average, parameters):
            kept.lerp_(parameter, 1 - config.decay)

    figures = {"parameters": sum(p.numel() for p in parameters), "tensors": len(parameters),
               "lora_bytes": sum(p.numel() * p.element_size() for p in parameters),
               "ema_bytes": average.memory_bytes(),
               "update_s": time_median(average.after_optimizer_step), "loop_s": time_median(python_loop)}
    if device.type == "cuda":
        on_cpu = LoraEma(parameters, EmaConfig(decay=0.999, device="cpu"))
        figures["cpu_update_s"] = time_median(on_cpu.after_optimizer_step)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="tiny SDXL optimizer steps (default 30)")
    parser.add_argument("--repeats", type=int, default=20, help="timed full-size updates (median; default 20)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device of the full-size LoRA. Default: cuda if available, else cpu")
    parser.add_argument("--full_step_s", type=float, default=None,
                        help="seconds of a full-size SDXL step to compare with. Default: the measured one for the "
                             f"device kind ({MEASURED_FULL_STEP_S})")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)

    tiny = tiny_sdxl(args.steps)
    tiny_pct = 100 * tiny["update_s"] / tiny["step_s"]
    tiny_ratio = tiny["ema_bytes"] / tiny["lora_bytes"]
    print(f"tiny SDXL (rank 16 + conv 16, fp16, stable preset): step {tiny['step_s'] * 1000:.1f} ms, EMA update "
          f"{tiny['update_s'] * 1000:.3f} ms ({tiny_pct:.2f}% of the step); average "
          f"{tiny['ema_bytes'] / 2**20:.2f} MiB for a {tiny['lora_bytes'] / 2**20:.2f} MiB LoRA ({tiny_ratio:.2f}x)")

    full = full_size(device, args.repeats)
    step_s = args.full_step_s or MEASURED_FULL_STEP_S[device.type]
    full_pct = 100 * full["update_s"] / step_s
    speedup = full["loop_s"] / full["update_s"]
    print(f"full-size SDXL LoRA rank 16 (UNet + both text encoders, {full['tensors']} tensors, "
          f"{full['parameters'] / 1e6:.1f} M values) on {device}: update {full['update_s'] * 1000:.2f} ms "
          f"({full_pct:.3f}% of a {step_s} s step), per-parameter loop {full['loop_s'] * 1000:.2f} ms "
          f"({speedup:.2f}x the fused update); average {full['ema_bytes'] / 2**20:.0f} MiB for a "
          f"{full['lora_bytes'] / 2**20:.0f} MiB LoRA")
    if "cpu_update_s" in full:
        print(f"  --ema_device cpu: update {full['cpu_update_s'] * 1000:.2f} ms "
              f"({100 * full['cpu_update_s'] / step_s:.3f}% of the step), no GPU memory for the average")
    print(f"tiny_update_pct={tiny_pct:.3f} tiny_memory_ratio={tiny_ratio:.2f} full_update_ms={full['update_s'] * 1000:.2f} "
          f"full_update_pct={full_pct:.3f} full_memory_mib={full['ema_bytes'] / 2**20:.0f} loop_speedup={speedup:.2f}")


if __name__ == "__main__":
    main()
