"""Cost of the gradient guard's measurement on the gradients of a full-size SDXL LoRA (rank 16).

Builds only the gradient shapes (no model): the 722 LoRA modules inside SDXL's
Transformer2DModels plus CLIP-L and OpenCLIP bigG, each a lora_down [16, in] and
a lora_up [out, 16], their gradients views of one flat buffer as the trainer keeps them
(``library.flat_gradients.FlatGradients``). Prints the guard's measurement (one host sync
each, as in training) as ratios to one ``torch.linalg.vector_norm`` of that buffer plus
``.item()``, and what the buffer costs per step (``gather copy``: autograd's separate
gradients copied into it, one ``_foreach_copy_``); the last line is
``norm_ratio=<x> cosine_ratio=<y> loop_speedup=<z>`` (also written to ``--json``, which
``bench_gpu_sdxl.py --summary --guard_json`` reads).

    python benchmarks/bench_grad_guard.py [--repeats 20] [--device cpu|cuda] [--json guard.json]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402

from library.flat_gradients import FlatGradients  # noqa: E402
from library.grad_guard import GradientMonitor  # noqa: E402

RANK = 16
CROSS_ATTENTION_DIM = 2048
# (channels, transformer layers per Transformer2DModel, number of such models) in SDXL's UNet:
# down 640: 2 models, down 1280: 2, mid 1280: 1, up 1280: 3, up 640: 3.
SDXL_TRANSFORMER_LEVELS = ((640, 2, 2 + 3), (1280, 10, 2 + 1 + 3))
# (hidden, mlp, layers) of CLIP-L and OpenCLIP bigG.
SDXL_TEXT_ENCODERS = ((768, 3072, 12), (1280, 5120, 32))


def sdxl_lora_linear_shapes() -> list[tuple[int, int]]:
    """(in_features, out_features) of every Linear a kohya LoRA targets in SDXL (UNet + both TEs)."""
    linears: list[tuple[int, int]] = []
    for channels, layers, models in SDXL_TRANSFORMER_LEVELS:
        for _ in range(models):
            linears.append((channels, channels))  # proj_in
            for _ in range(layers):
                linears += [(channels, channels)] * 4  # attn1 q, k, v, out
                linears += [(channels, channels), (CROSS_ATTENTION_DIM, channels),
                            (CROSS_ATTENTION_DIM, channels), (channels, channels)]  # attn2 q, k, v, out
                linears.append((channels, 2 * 4 * channels))  # ff.net.0.proj (GEGLU doubles the 4x inner dim)
                linears.append((4 * channels, channels))  # ff.net.2
            linears.append((channels, channels))  # proj_out
    for hidden, mlp, layers in SDXL_TEXT_ENCODERS:
        for _ in range(layers):
            linears += [(hidden, hidden)] * 4  # q, k, v, out_proj
            linears += [(hidden, mlp), (mlp, hidden)]  # fc1, fc2
    return linears


def lora_gradient_shapes() -> list[tuple[int, int]]:
    shapes = []
    for in_features, out_features in sdxl_lora_linear_shapes():
        shapes += [(RANK, in_features), (out_features, RANK)]  # lora_down, lora_up
    return shapes


def time_seconds(function: Callable[[], object], repeats: int,
                 synchronize: Callable[[], None]) -> tuple[float, float]:
    """(min, median) wall time of ``function`` after two warm-up calls."""
    function()
    function()
    timings = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        function()
        synchronize()
        timings.append(time.perf_counter() - start)
    return min(timings), statistics.median(timings)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per variant (median). Default: 20")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device for the tensors. Default: cuda if available, else cpu")
    parser.add_argument("--json", help="also write the three ratios to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    unet_modules = sum(models * (2 + layers * 10) for _, layers, models in SDXL_TRANSFORMER_LEVELS)
    shapes = lora_gradient_shapes()
    generator = torch.Generator(device="cpu").manual_seed(0)
    parameters = [torch.nn.Parameter(torch.empty(shape, device=device)) for shape in shapes]
    gradients = FlatGradients(parameters)
    total = gradients.numel
    flat = gradients.flat
    flat.copy_(torch.randn(total, generator=generator))
    for parameter, view in zip(parameters, gradients.views):
        parameter.grad = view  # as after FlatGradients.gather()
    gradients.gather()
    grads = [p.grad for p in parameters]
    separate = [torch.randn(p.shape, generator=generator).to(device) for p in parameters]
    print(f"device={device} threads={torch.get_num_threads()} unet_lora_modules={unet_modules} "
          f"tensors={len(shapes)} values={total} ({total * 4 / 2**20:.0f} MiB fp32)")

    norm_monitor = GradientMonitor(gradients)
    cosine_monitor = GradientMonitor(gradients, cosine=True)
    cosine_monitor.measure()  # steady state: a previous gradient exists

    variants = {
        "flat vector_norm": lambda: torch.linalg.vector_norm(flat).item(),
        "guard norm": norm_monitor.measure,
        "guard norm + cosine": cosine_monitor.measure,
        "python loop": lambda: torch.sqrt(sum((g * g).sum() for g in grads)).item(),
        # what FlatGradients.gather adds per step: autograd's separate gradients copied into the buffer
        "gather copy": lambda: (torch._foreach_copy_(gradients.views, separate), synchronize()),
    }
    timings = {name: time_seconds(function, args.repeats, synchronize) for name, function in variants.items()}
    baseline_min_s, baseline_median_s = timings["flat vector_norm"]
    for name, (min_s, median_s) in timings.items():
        print(f"{name:>20}: min {min_s * 1e3:8.2f} ms ({min_s / baseline_min_s:5.2f}x)  "
              f"median {median_s * 1e3:8.2f} ms ({median_s / baseline_median_s:5.2f}x)")
    # Ratios of the minimum times: the least disturbed run of each variant on a shared machine.
    best = {name: min_s for name, (min_s, _) in timings.items()}
    ratios = {"norm_ratio": best["guard norm"] / best["flat vector_norm"],
              "cosine_ratio": best["guard norm + cosine"] / best["flat vector_norm"],
              "loop_speedup": best["python loop"] / best["guard norm"]}
    if args.json:
        Path(args.json).write_text(json.dumps({"device": str(device), **ratios}))
    print(" ".join(f"{key}={value:.2f}" for key, value in ratios.items()))


if __name__ == "__main__":
    main()
