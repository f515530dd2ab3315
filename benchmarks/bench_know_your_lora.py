"""Costs of knowing the LoRA (docs/know_your_lora.md) on the tiny SDXL, in the trainer itself:

* ``--debiased_loss``: the time per step with and without it (one extra no-grad UNet forward per
  micro-batch);
* the effect monitor costs nothing per step: one extra validation pass once (the base's) and the
  weight ratios at validations and at the "does nothing" check steps (timed by
  tests/benchmarks through ``EffectMonitor.weight_ratios``, see docs/know_your_lora.md);
* ``--find_lr``: its time in training steps.

Per-step times come from the difference of two run lengths (model loading cancels out).

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_know_your_lora.py
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_does_nothing import quickstart_argv, quickstart_inputs  # noqa: E402


def timed_run(argv: list[str]) -> float:
    from accelerate.state import AcceleratorState, GradientState

    import sdxl_train_network

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    started = time.perf_counter()
    sdxl_train_network.main(argv=argv)
    return time.perf_counter() - started


def per_step(make_argv, short: int, long: int, repeats: int) -> float:
    """Seconds per step: the best of ``repeats`` differences between a ``long`` and a ``short`` run."""
    best = float("inf")
    for _ in range(repeats):
        best = min(best, (timed_run(make_argv(long)) - timed_run(make_argv(short))) / (long - short))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench_does_nothing_work"))
    parser.add_argument("--short", type=int, default=4)
    parser.add_argument("--long", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--skip_finder", action="store_true", help="only the --debiased_loss cost")
    args = parser.parse_args()
    models, dataset = quickstart_inputs(args.work)

    def argv(name: str, *extra: str):
        return lambda steps: quickstart_argv(models, dataset, args.work / f"cost_{name}_{steps}", 0, "5e-3",
                                             steps) + list(extra)

    plain = per_step(argv("plain"), args.short, args.long, args.repeats)
    debiased = per_step(argv("debiased", "--debiased_loss"), args.short, args.long, args.repeats)
    print(f"RESULT step {plain * 1000:.1f} ms, with --debiased_loss {debiased * 1000:.1f} ms "
          f"({debiased / plain:.3f} x)")
    if args.skip_finder:
        return
    finder_steps = 20
    with_finder = timed_run(argv("finder", "--find_lr_only", "--find_lr_steps", str(finder_steps))(args.short))
    without = timed_run(argv("nofinder")(args.short))
    print(f"RESULT --find_lr ({finder_steps} steps): {with_finder - without:.1f} s = "
          f"{(with_finder - without) / plain:.0f} training steps")


if __name__ == "__main__":
    main()
