"""Costs of knowing the LoRA (docs/know_your_lora.md) on the tiny SDXL, in the trainer itself, on the
quick start's settings (no validation split, so the monitor measures on its training probe):

* ``--debiased_loss``: the time of its extra no-grad UNet forward per step, relative to the rest of
  the step;
* the effect monitor: the time of one check (the training probe's pass, the weight ratios, the
  warning), and its share of a step at the default cadence (a check every ``lora_effect.check_step``
  steps: every 50 in runs of 200 steps or more); the first check's one-time base pass apart;
* ``--find_lr``: its time in training steps.

The machine these run on is shared, so the parts are timed inside one run (the trainer's own
methods wrapped with a timer: a step, the debiased forward, a check, the finder's ramp), where the
load affects them alike, and each run is repeated: the spread over repeats is printed.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_know_your_lora.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_does_nothing import quickstart_argv, quickstart_inputs  # noqa: E402


@contextlib.contextmanager
def timed(owner: object, name: str, times: list[float]) -> Iterator[None]:
    """Within: every call of ``owner.name`` appends its seconds to ``times``."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - started)

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def run(argv: list[str], wrapped: dict[str, tuple[object, str]]) -> dict[str, list[float]]:
    """Train with ``argv`` in this process; the seconds of every call of each wrapped method."""
    from accelerate.state import AcceleratorState, GradientState

    import sdxl_train_network

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    times: dict[str, list[float]] = {name: [] for name in wrapped}
    with contextlib.ExitStack() as stack:
        for key, (owner, name) in wrapped.items():
            stack.enter_context(timed(owner, name, times[key]))
        sdxl_train_network.main(argv=argv)
    return times


def spread(values: list[float], format_value: Callable[[float], str]) -> str:
    return (f"median {format_value(statistics.median(values))} (min {format_value(min(values))}, "
            f"max {format_value(max(values))}, {len(values)} runs)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench_does_nothing_work"))
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (checks every steps/4, "
                                                              "at most 50)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--finder_steps", type=int, default=20)
    parser.add_argument("--skip_finder", action="store_true")
    args = parser.parse_args()
    models, dataset = quickstart_inputs(args.work)

    import train_network
    from library import lora_effect, lr_finder

    trainer = train_network.NetworkTrainer
    cadence = lora_effect.CHECK_STEP_CAP
    debiased_shares, check_shares, base_steps, finder_steps = [], [], [], []
    for repeat in range(args.repeats):
        output = args.work / f"cost_{repeat}"
        argv = quickstart_argv(models, dataset, output, 0, "5e-3", args.steps) + ["--debiased_loss"]
        times = run(argv, {"step": (trainer, "train_step"), "debiased": (trainer, "add_base_loss"),
                           "check": (lora_effect.EffectMonitor, "check")})
        step = statistics.median(times["step"])
        debiased = sum(times["debiased"]) / len(times["step"])  # per step (every micro-batch's)
        plain = step - debiased
        every = lora_effect.check_step(args.steps)  # check() is called every step and works at its multiples
        done = [seconds for index, seconds in enumerate(times["check"]) if (index + 1) % every == 0]
        first, later = done[0], done[1:]
        check = statistics.median(later) if later else first
        debiased_shares.append(debiased / plain)
        check_shares.append(check / cadence / plain)
        base_steps.append((first - check) / plain)
        print(f"RESULT run {repeat}: step {plain * 1000:.0f} ms without the debiased forward, debiased forward "
              f"{debiased * 1000:.0f} ms ({debiased / plain:.1%}); a check {check * 1000:.0f} ms "
              f"({len(done)} checks; at one per {cadence} steps {check / cadence / plain:.2%} of a step); the first "
              f"check's base pass {(first - check) / plain:.1f} steps once", flush=True)
        if not args.skip_finder:
            ramp: list[float] = []
            run(quickstart_argv(models, dataset, args.work / f"finder_{repeat}", 0, "5e-3", args.steps)
                + ["--find_lr_only", "--find_lr_steps", str(args.finder_steps)], {"ramp": (lr_finder, "ramp")})
            finder_steps.append(ramp[0] / plain)
            print(f"RESULT run {repeat}: --find_lr ({args.finder_steps} finder steps) {ramp[0]:.1f} s = "
                  f"{ramp[0] / plain:.0f} training steps", flush=True)
    print(f"RESULT --debiased_loss: {spread(debiased_shares, '{:.1%}'.format)} of a step")
    print(f"RESULT effect monitor at one check per {cadence} steps: {spread(check_shares, '{:.2%}'.format)} of a "
          f"step; its base pass once: {spread(base_steps, '{:.1f} steps'.format)}")
    if finder_steps:
        print(f"RESULT --find_lr ({args.finder_steps} steps): {spread(finder_steps, '{:.0f} training steps'.format)}")


if __name__ == "__main__":
    main()
