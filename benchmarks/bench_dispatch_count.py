"""aten operations dispatched per optimizer step on the tiny SDXL: our trainer against the bare loop.

    python benchmarks/bench_dispatch_count.py [--precision fp16] [--no_checkpointing] [--batch 1]
                                              [--top 25] [--extra TRAINER FLAGS...]

On a GPU at batch 1 the full-size step is host-bound (docs/gpu.md): what decides its speed is how
many operations the host dispatches, each a kernel launch or at least a pass through the
dispatcher. This counts them on the CPU with a ``TorchDispatchMode`` that sees every aten call
(forward, backward, optimizer, guard, bookkeeping; an op's own internals not), over one whole
optimizer step in steady state: from the start of step 3 to the start of step 4, so everything
the loop does between steps counts. It also reports the CPU time per step (median from step 5 on,
``time.process_time``: other load on a shared machine does not inflate it), which on the tiny model
is mostly host overhead as well.

- ``ours``: ``sdxl_train_network.py`` in this process: rank 16 UNet-only LoRA, cached latents and
  text-encoder outputs, AdamW, ``--grad_guard_preset stable``, fp16 (our loss scaler), gradient
  checkpointing, batch 1 (the GPU benchmark's headline case);
- ``bare``: ``benchmarks/bare_loop.py`` (diffusers + peft + GradScaler + AdamW) on the same UNet.

Prints both totals, the ops that differ most (ours - bare, by name), and last
``ours_ops=.. bare_ops=.. ours/bare=..`` (target <= 1.05). CPU only; not run in CI.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # counts are of the CPU path; the GPU's are the same ops
REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "benchmarks")]

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

RANK = 16
COUNTED_STEP = 3  # 1-based: the optimizer step whose operations are counted (after warm-up)
TIMED_FROM = 5  # 1-based: CPU time per step is the median over the steps from this one on


class OpCounter(TorchDispatchMode):
    """Counts aten operations by name while active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def count_ours(models: dict, dataset: str, output_dir: str, precision: str, batch: int, checkpointing: bool,
               steps: int, extra: list[str]) -> tuple[collections.Counter, list[float]]:
    """Ops of step ``COUNTED_STEP`` and the CPU seconds of each step from ``TIMED_FROM`` on."""
    import sdxl_train_network

    trainer_class = sdxl_train_network.SdxlNetworkTrainer
    original_window = trainer_class.backward_window
    steps_started = [0]
    counter = OpCounter()
    starts: list[float] = []

    def backward_window(self, *args, **kwargs):
        steps_started[0] += 1
        if steps_started[0] >= TIMED_FROM:
            starts.append(time.process_time())
        if steps_started[0] == COUNTED_STEP:
            counter.__enter__()
        elif steps_started[0] == COUNTED_STEP + 1:
            counter.__exit__(None, None, None)
        return original_window(self, *args, **kwargs)

    trainer_class.backward_window = backward_window
    try:
        sdxl_train_network.main([
            "--pretrained_model_name_or_path", str(models["sdxl_file"]),
            "--model_config_dir", str(models["sdxl_config"]),
            "--train_data_dir", dataset, "--caption_extension", ".txt", "--resolution", "64",
            "--train_batch_size", str(batch), "--output_dir", output_dir, "--output_name", "bench",
            "--mixed_precision", precision, "--network_dim", str(RANK), "--network_alpha", str(RANK),
            "--network_train_unet_only", "--cache_latents", "--cache_text_encoder_outputs", "--optimizer_type", "AdamW",
            "--learning_rate", "1e-4", "--max_train_steps", str(steps), "--seed", "0",
            "--max_data_loader_n_workers", "0", *(["--gradient_checkpointing"] if checkpointing else []),
            *extra,
        ])
        starts.append(time.process_time())  # the end of the last step (saving the file is outside it)
    finally:
        trainer_class.backward_window = original_window
    assert steps_started[0] == steps
    return counter.counts, [b - a for a, b in zip(starts, starts[1:])]


def count_bare(models: dict, precision: str, batch: int, checkpointing: bool, steps: int
               ) -> tuple[collections.Counter, list[float], int]:
    """Ops of step ``COUNTED_STEP``, CPU seconds per step from ``TIMED_FROM`` on, LoRA modules."""
    from bare_loop import BareLoop

    from library.model_loading import load_models

    unet = load_models(str(models["sdxl_file"]), sdxl=True, model_config_dir=str(models["sdxl_config"]),
                       tokenizer_cache_dir=str(models["tokenizers"])).unet
    loop = BareLoop(unet, precision, batch, checkpointing, RANK, 1e-4, 64, torch.device("cpu"))
    counter = OpCounter()
    starts = []
    for index in range(steps):
        if index + 1 >= TIMED_FROM:
            starts.append(time.process_time())
        if index + 1 == COUNTED_STEP:
            with counter:
                loop.step(index)
        else:
            loop.step(index)
    starts.append(time.process_time())
    return counter.counts, [b - a for a, b in zip(starts, starts[1:])], loop.lora_modules


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=["no", "fp16", "bf16"], default="fp16", help="default fp16")
    parser.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    parser.add_argument("--no_checkpointing", action="store_true", help="without --gradient_checkpointing")
    parser.add_argument("--top", type=int, default=25, help="ops listed by count difference (default 25)")
    parser.add_argument("--steps", type=int, default=24,
                        help=f"steps per loop (default 24; CPU time per step: median from step {TIMED_FROM} on)")
    parser.add_argument("--no_guard", action="store_true", help="ours without --grad_guard_preset stable")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more trainer flags (after everything)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from tools.build_tiny_models import build_tiny_models
    from tools.make_demo_dataset import make_demo_dataset

    checkpointing = not args.no_checkpointing
    guard = [] if args.no_guard else ["--grad_guard_preset", "stable"]
    with tempfile.TemporaryDirectory() as tmp:
        models = build_tiny_models(Path(tmp) / "models")
        dataset = os.path.join(tmp, "dataset")
        make_demo_dataset(dataset, count=8, size=64, repeats=1)
        ours, ours_s = count_ours(models, dataset, os.path.join(tmp, "out"), args.precision, args.batch,
                                  checkpointing, args.steps, guard + args.extra)
        bare, bare_s, lora_modules = count_bare(models, args.precision, args.batch, checkpointing, args.steps)
    total_ours, total_bare = sum(ours.values()), sum(bare.values())
    print(f"tiny SDXL, {lora_modules} LoRA modules, {args.precision}, batch {args.batch}, "
          f"checkpointing {'on' if checkpointing else 'off'}: ours {total_ours} ops, bare {total_bare} ops")
    differences = sorted(set(ours) | set(bare), key=lambda name: -abs(ours[name] - bare[name]))
    print(f"{'op':<40} {'ours':>6} {'bare':>6} {'diff':>6}")
    for name in differences[:args.top]:
        if ours[name] != bare[name]:
            print(f"{name:<40} {ours[name]:>6} {bare[name]:>6} {ours[name] - bare[name]:>+6}")
    ours_step_s, bare_step_s = statistics.median(ours_s), statistics.median(bare_s)
    print(f"CPU seconds per step (median of {len(ours_s)}; the tiny model's step is mostly host overhead too): "
          f"ours {ours_step_s:.4f}, bare {bare_step_s:.4f}, ratio {ours_step_s / bare_step_s:.3f}")
    print(f"ours_ops={total_ours} bare_ops={total_bare} ours/bare={total_ours / total_bare:.3f}")


if __name__ == "__main__":
    main()
