"""resize_lora on a full-size SDXL rank-128 LoRA: seconds and error with --svd_lowrank_niter 2 vs 0 (full SVD).

    python benchmarks/bench_resize_lora.py [--rank 128] [--new_rank 32] [--niter 2] [--threads 1] [--every K]

The LoRA: kohya's module names and shapes of networks.lora on the full-size SDXL base
(``library/model_configs/sdxl_base``, built on the meta device: no weights), UNet and both text
encoders, Linear and 1x1 modules (the trainer's default, no ``conv_dim``), seeded random down/up
factors in float32. Each run resizes every module (``--every K``: every K-th, a sample of all the shapes for a
busy machine) with ``networks.resize_lora.resize_weights``.

kohya's rule (kept here) uses ``torch.svd_lowrank`` only for deltas with both dimensions above 2048,
and no SDXL module is that large, so ``niter 2`` and ``niter 0`` do the same work on SDXL; the
``forced`` run lowers that bound to 0 to show what the approximate SVD would cost and save on
these shapes. Error: the relative Frobenius error of the written LoRA's deltas against the
original deltas over all modules, ``sqrt(sum ||D - D'||^2 / sum ||D||^2)``, measured on the
written factors (not from singular values). Last line: ratios to the full SVD. Not run in CI.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from library import checkpoint_keys  # noqa: E402
from library.model_loading import build_empty_models, shipped_config_dir  # noqa: E402
from networks import lora, resize_lora  # noqa: E402
from networks.lora import lora_delta, lora_modules  # noqa: E402


def full_size_lora(rank: int, every: int) -> dict[str, torch.Tensor]:
    """A random rank-``rank`` LoRA state dict with the names and shapes kohya's LoRA has on SDXL base."""
    unet, _, text_encoders, _ = build_empty_models("sdxl", shipped_config_dir("sdxl"), with_vae=False)
    names = checkpoint_keys.unet_module_name_map(unet.config)
    with torch.device("meta"):
        network = lora.create_network(1.0, rank, rank / 2, None, text_encoders, unet, unet_module_names=names)
    generator = torch.Generator().manual_seed(0)
    weights: dict[str, torch.Tensor] = {}
    for module in network.all_loras()[::every]:
        down_shape, up_shape = module.lora_down.weight.shape, module.lora_up.weight.shape
        weights[f"{module.lora_name}.lora_down.weight"] = torch.randn(down_shape, generator=generator) / math.sqrt(
            down_shape[1])
        weights[f"{module.lora_name}.lora_up.weight"] = torch.randn(up_shape, generator=generator) * 0.01
        weights[f"{module.lora_name}.alpha"] = torch.tensor(rank / 2)
    return weights


def overall_error(original: dict[str, torch.Tensor], resized: dict[str, torch.Tensor]) -> float:
    """sqrt(sum ||D - D'||^2 / sum ||D||^2) over all modules, in float64 from the factors as written."""
    resized_modules = lora_modules(resized)
    error = total = 0.0
    for name, parts in lora_modules(original).items():
        delta = lora_delta(parts, torch.float64)
        error += float((delta - lora_delta(resized_modules[name], torch.float64)).pow(2).sum())
        total += float(delta.pow(2).sum())
    return math.sqrt(error / total)


def run(weights: dict[str, torch.Tensor], new_rank: int, niter: int, lowrank_min_dim: int) -> tuple[float, float, int]:
    """(seconds, overall relative error, modules decomposed by svd_lowrank)."""
    start = time.perf_counter()
    resized, _ = resize_lora.resize_weights(weights, new_rank, svd_lowrank_niter=niter,
                                            lowrank_min_dim=lowrank_min_dim)
    seconds = time.perf_counter() - start
    approximate = sum(1 for parts in lora_modules(weights).values()
                      if niter > 0 and min(parts["up"].shape[0], parts["down"][0].numel()) > lowrank_min_dim)
    return seconds, overall_error(weights, resized), approximate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=128, help="rank of the random LoRA (default 128)")
    parser.add_argument("--new_rank", type=int, default=32, help="--new_rank of the resize (default 32)")
    parser.add_argument("--niter", type=int, default=2, help="--svd_lowrank_niter compared with 0 (default 2)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared machine more threads wait on each other)")
    parser.add_argument("--every", type=int, default=1, help="only every K-th module (default 1: all)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    weights = full_size_lora(args.rank, args.every)
    modules = len(weights) // 3
    print(f"SDXL LoRA: {modules} modules (every {args.every}), rank {args.rank}, "
          f"{sum(v.numel() * 4 for v in weights.values()) / 2**30:.2f} GiB float32; resize to {args.new_rank}",
          flush=True)
    results = {}
    for label, niter, bound in (("full SVD (niter 0)", 0, resize_lora.LOWRANK_MIN_DIM),
                                (f"niter {args.niter}", args.niter, resize_lora.LOWRANK_MIN_DIM),
                                (f"niter {args.niter} forced (every module)", args.niter, 0)):
        seconds, error, approximate = run(weights, args.new_rank, niter, bound)
        results[label] = (seconds, error)
        print(f"{label}: {seconds:.1f} s, overall relative error {error:.6f}, {approximate} of {modules} modules "
              f"by svd_lowrank", flush=True)
    full_s, full_e = results["full SVD (niter 0)"]
    kohya_s, kohya_e = results[f"niter {args.niter}"]
    forced_s, forced_e = results[f"niter {args.niter} forced (every module)"]
    print(f"time_ratio_niter{args.niter}_vs_full={kohya_s / full_s:.3f} error_niter{args.niter}={kohya_e:.6f} "
          f"error_full={full_e:.6f} forced_time_ratio={forced_s / full_s:.3f} forced_error={forced_e:.6f}")


if __name__ == "__main__":
    main()
