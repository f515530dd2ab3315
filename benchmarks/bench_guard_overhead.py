"""End-to-end cost of the gradient guard's stable preset on the tiny SDXL (target <= 5% of a step).

    python benchmarks/bench_guard_overhead.py [--resolution 64] [--steps 10 40] [--repeats 3]

Steady seconds per step with and without ``--grad_guard_preset stable`` (norm, cosine against
a flat copy of the previous gradient, CSV log), fp16 with the loss scaler, each the best of
``--repeats`` pairs of short/long runs. Last line: ``guard_overhead=<ratio - 1>``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from bench_tiny_sdxl_step import train_once  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolution", type=int, default=64, help="pixels (default 64)")
    parser.add_argument("--steps", type=int, nargs=2, default=[10, 40], help="short and long runs (default 10 40)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per setting (default 3)")
    args = parser.parse_args()
    from tools.build_tiny_models import build_tiny_models
    from tools.make_demo_dataset import make_demo_dataset

    with tempfile.TemporaryDirectory() as tmp:
        models = build_tiny_models(os.path.join(tmp, "models"))
        dataset = os.path.join(tmp, "dataset")
        make_demo_dataset(dataset, count=8, size=args.resolution)
        step_s = {}
        for name, extra in (("plain", ()), ("stable", ("--grad_guard_preset", "stable"))):
            best = float("inf")
            for _ in range(args.repeats):
                short, _ = train_once(models, dataset, os.path.join(tmp, "a"), args.resolution, "fp16", args.steps[0], extra)
                long, _ = train_once(models, dataset, os.path.join(tmp, "b"), args.resolution, "fp16", args.steps[1], extra)
                best = min(best, (long - short) / (args.steps[1] - args.steps[0]))
            step_s[name] = best
            print(f"{name}: {best:.4f} s/step", flush=True)
        print(f"guard_overhead={step_s['stable'] / step_s['plain'] - 1:.3f}")


if __name__ == "__main__":
    main()
