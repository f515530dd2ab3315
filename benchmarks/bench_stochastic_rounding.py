"""Time of the bf16 stochastic rounding that fused Adafactor does for every bf16 weight at every step.

    python benchmarks/bench_stochastic_rounding.py [--blocks 2] [--repeats 3]

``library.fused_backward.stochastic_round_to_bfloat16_`` (16-bit draws from numpy's PCG64, four per
64-bit word) against the same rounding with the draws from torch's CPU ``randint`` (one per element, as
kohya's ``copy_stochastic_`` in ``library/adafactor_fused.py`` and this project before did), on the
weight shapes of ``--blocks`` full-size SDXL transformer blocks (1280 channels, GEGLU 5120, cross-attention
to 2048: 34.7 M elements each). Both roundings run on the same float32 values and are checked to land on
one of the two bf16 neighbours. Prints the time per element of each, the ratio, and what each costs per
step for the 2.567 G weights of a full-size SDXL UNet (``--full_bf16 --fused_backward_pass``). Not run in CI.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from library.fused_backward import stochastic_round_to_bfloat16_  # noqa: E402

SDXL_UNET_WEIGHTS = 2_567_463_684
BLOCK_SHAPES = [(1280, 1280)] * 4 + [(1280, 1280), (1280, 2048), (1280, 2048), (1280, 1280)] + [(10240, 1280), (1280, 5120)]


def randint_rounding(target: torch.Tensor, source: torch.Tensor, generator: torch.Generator) -> None:
    """The same rounding with one torch ``randint`` draw per element (the baseline)."""
    bits = torch.randint(0, 1 << 16, source.shape, dtype=torch.int32, generator=generator)
    bits.add_(source.view(torch.int32))
    bits.bitwise_and_(-65536)
    target.copy_(bits.view(torch.float32))


def timed(round_all, repeats: int) -> float:
    round_all()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        round_all()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=2, help="full-size SDXL transformer blocks (default 2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats after a warm-up (default 3)")
    args = parser.parse_args()
    torch.manual_seed(0)
    sources = [torch.randn(shape) * 0.02 for _ in range(args.blocks) for shape in BLOCK_SHAPES]
    targets = [torch.empty_like(source, dtype=torch.bfloat16) for source in sources]
    elements = sum(source.numel() for source in sources)
    generator = torch.Generator().manual_seed(0)

    def ours() -> None:
        for index, (target, source) in enumerate(zip(targets, sources)):
            stochastic_round_to_bfloat16_(target, source, index)

    def baseline() -> None:
        for target, source in zip(targets, sources):
            randint_rounding(target, source, generator)

    results = {}
    for name, round_all in [("randint", baseline), ("ours", ours)]:
        seconds = timed(round_all, args.repeats)
        for target, source in zip(targets, sources):  # each value on one of its two bf16 neighbours
            down = (source.view(torch.int32) & -65536).view(torch.float32)
            up = ((source.view(torch.int32) & -65536) + 65536).view(torch.float32)
            assert bool(((target.float() == down) | (target.float() == up)).all()), name
        results[name] = seconds
        print(f"{name:8s} ns_per_element={seconds / elements * 1e9:.2f} seconds={seconds:.3f} elements={elements} "
              f"sdxl_unet_step_s={seconds / elements * SDXL_UNET_WEIGHTS:.1f} threads={torch.get_num_threads()}")
    print(f"ours/randint: time_ratio={results['ours'] / results['randint']:.3f}")


if __name__ == "__main__":
    main()
