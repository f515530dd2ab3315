"""Peak memory and step time of the fused backward (library/fused_backward.py) against an unfused step.

    python benchmarks/bench_fused_backward.py [--layers 4] [--tokens 256] [--steps 3] [--gradient_checkpointing]

The model: ``--layers`` full-size SDXL transformer layers (diffusers ``Transformer2DModel``: 1280 channels,
20 heads of 64, cross-attention to 77 x 2048 text states, GEGLU 5120: SDXL's deepest level, 38 M
parameters a layer), fp32, Adafactor (``relative_step=False``, lr 1e-5) with ``--max_grad_norm 1``,
batch 1 of ``--tokens`` image tokens (256 = a 16 x 16 latent level). Each variant runs in its own
process, one after the other:

* ``unfused``: backward, ``clip_grad_norm_``, ``optimizer.step()``, ``zero_grad`` (kohya's unfused step);
* ``kohya_single``: kohya's ``--fused_backward_pass``: one backward whose hooks clip each tensor on its
  own and step it (no whole-step norm: no guard, no scaler check);
* ``ours``: this project's: a measuring backward over the retained graph, then an applying one
  (the guard's norm, the overflow check and the whole-step clip are exact);
* ``groups4``: ours with ``--fused_optimizer_groups 4`` (4 Adafactors, each stepped when its quarter is ready);
* ``replay``: the other exact design, emulated: forward + a backward whose hooks measure each gradient and
  free it, then forward + backward again with kohya's stepping hooks (no clip).

Memory: the kernel's peak RSS (``VmHWM``) of the training steps, reset after the model and optimizer
are built (``/proc/self/clear_refs``), minus the RSS at that point: what the steps add on top of the
weights (``step_peak_gib``). The children run with ``MALLOC_MMAP_THRESHOLD_=131072``, so every tensor
above 128 KiB is its own mapping, returned to the kernel when freed: RSS then follows the live tensors
instead of what glibc keeps. Time: the median step after one warm-up step, wall and CPU seconds (the
CPU figure is less disturbed by other processes on a shared machine); the forward and backward alone
are timed in the unfused run. Prints one line per variant, then the ratios. Not run in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

VARIANTS = ("unfused", "kohya_single", "ours", "groups4", "replay")


def status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def child(variant: str, layers: int, tokens: int, steps: int, checkpointing: bool) -> dict:
    import torch
    from diffusers.models import Transformer2DModel
    from transformers.optimization import Adafactor

    from library.fused_backward import FusedBackward, split_into_groups, step_one_parameter
    from library.grad_guard import _flat_norm

    torch.manual_seed(0)
    model = Transformer2DModel(num_attention_heads=20, attention_head_dim=64, in_channels=1280, num_layers=layers,
                               cross_attention_dim=2048, use_linear_projection=True, norm_num_groups=32)
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    params = list(model.parameters())
    settings = dict(lr=1e-5, relative_step=False, scale_parameter=False, warmup_init=False)
    side = int(tokens ** 0.5)
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 1280, side, side, generator=generator)
    text = torch.randn(1, 77, 2048, generator=generator)

    def loss_of_forward() -> torch.Tensor:
        return model(latents, encoder_hidden_states=text).sample.square().mean()

    if variant == "groups4":
        optimizers = [Adafactor([group], **settings) for group in split_into_groups([{"params": params, "lr": 1e-5}], 4)]
    else:
        optimizers = [Adafactor(params, **settings)]
    optimizer = optimizers[0]
    fused = None
    if variant in ("ours", "groups4"):
        fused = FusedBackward(optimizers, per_parameter=variant == "ours", max_grad_norm=1.0)
    elif variant in ("kohya_single", "replay"):
        measuring = [False]
        norms = torch.zeros(len(params))

        def kohya_hook(parameter: torch.Tensor) -> None:  # kohya's hook: clip this tensor alone, step, free
            if measuring[0]:  # replay's first pass: measure and free
                norms[0] += _flat_norm(parameter.grad.reshape(-1)).square()
            else:
                if variant == "kohya_single":
                    torch.nn.utils.clip_grad_norm_(parameter, 1.0)
                step_one_parameter(optimizer, optimizer.param_groups[0], parameter)
            parameter.grad = None
        for parameter in params:
            parameter.register_post_accumulate_grad_hook(kohya_hook)

    step_s, cpu_s, forward_s, backward_s = [], [], [], []
    gradient_bytes = sum(p.numel() * p.element_size() for p in params)
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on: the steps'
    baseline_kib = status_kib("VmRSS")
    for step in range(steps + 1):
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = loss_of_forward()
        forward_end = time.process_time()
        if variant == "unfused":
            loss.backward()
            backward_end = time.process_time()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            forward_s.append(forward_end - start_cpu)
            backward_s.append(backward_end - forward_end)
        elif variant == "kohya_single":
            loss.backward()
        elif variant == "replay":
            measuring[0] = True
            loss.backward()
            measuring[0] = False
            float(norms[0])  # the decision's host sync
            loss = loss_of_forward()
            loss.backward()
        else:
            fused.measure(loss)
            assert fused.apply()
        del loss
        step_s.append(time.perf_counter() - start)
        cpu_s.append(time.process_time() - start_cpu)
    peak_kib = status_kib("VmHWM")
    result = dict(variant=variant, step_s=statistics.median(step_s[1:]), cpu_s=statistics.median(cpu_s[1:]),
                  peak_rss_gib=peak_kib / 2**20,
                  step_peak_gib=(peak_kib - baseline_kib) / 2**20, weights_gib=gradient_bytes / 2**30,
                  params_m=sum(p.numel() for p in params) / 1e6)
    if forward_s:
        result.update(forward_s=statistics.median(forward_s[1:]), backward_s=statistics.median(backward_s[1:]))
    if fused is not None:
        result["held_gradient_gib"] = fused.peak_gradient_bytes / 2**30
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="full-size SDXL transformer layers (38 M parameters each)")
    parser.add_argument("--tokens", type=int, default=256, help="image tokens (a square number)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.layers, args.tokens, args.steps, args.gradient_checkpointing)))
        return
    results = {}
    for variant in args.variants:
        command = [sys.executable, __file__, "--child", variant, "--layers", str(args.layers), "--tokens",
                   str(args.tokens), "--steps", str(args.steps)]
        if args.gradient_checkpointing:
            command.append("--gradient_checkpointing")
        environment = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")
        output = subprocess.run(command, check=True, capture_output=True, text=True, env=environment).stdout
        results[variant] = json.loads(output.strip().splitlines()[-1])
        row = results[variant]
        print(f"{variant:13s} step_s={row['step_s']:.2f} cpu_s={row['cpu_s']:.2f} step_peak_gib={row['step_peak_gib']:.3f} "
              f"peak_rss_gib={row['peak_rss_gib']:.3f} params_m={row['params_m']:.0f} "
              f"weights_gib={row['weights_gib']:.3f}"
              + (f" held_gradient_gib={row['held_gradient_gib']:.3f}" if "held_gradient_gib" in row else "")
              + (f" forward_cpu_s={row['forward_s']:.2f} backward_cpu_s={row['backward_s']:.2f}"
                 if "forward_s" in row else ""),
              flush=True)
    if "unfused" not in results:
        return
    base = results["unfused"]
    for variant, row in results.items():
        if variant != "unfused":
            print(f"{variant}/unfused: step_peak_ratio={row['step_peak_gib'] / base['step_peak_gib']:.3f} "
                  f"peak_rss_ratio={row['peak_rss_gib'] / base['peak_rss_gib']:.3f} "
                  f"step_time_ratio={row['step_s'] / base['step_s']:.3f} cpu_time_ratio={row['cpu_s'] / base['cpu_s']:.3f}")
    print(f"unfused CPU seconds: forward {base['forward_s']:.2f}, backward {base['backward_s']:.2f}, optimizer step + "
          f"clip {base['cpu_s'] - base['forward_s'] - base['backward_s']:.2f}")


if __name__ == "__main__":
    main()
