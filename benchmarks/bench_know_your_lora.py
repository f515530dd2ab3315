"""Costs of knowing the LoRA (docs/know_your_lora.md) on the tiny SDXL, in the trainer itself, on the
quick start's settings (no validation split, so the monitor measures on its training probe):

* ``--debiased_loss``: its extra no-grad UNet forward per step, relative to the rest of the step, two
  ways: inside the run (the forward's own time), and run against run (the median step with the option
  over the median step without it);
* the effect monitor: the time of one check (the training probe's pass, the weight ratios, the
  warning) and of its call on the other steps, as a share of a step at the default cadence of a long
  run (``lora_effect.is_check``: in runs of 200 steps or more the check at step 50, then one every
  ``LATER_CHECK_EVERY`` = 100 steps); the first check's one-time base pass apart;
* ``--find_lr``: its time in training steps.

The machine these run on is shared, so the parts are timed inside each run (the trainer's own
functions wrapped with a timer: a step, the debiased forward, a check, the finder's ramp), where the
load affects them alike; the variants run interleaved (plain, --debiased_loss, --find_lr_only; again
...), and every time is taken twice: wall clock and the process's CPU time (``time.process_time``;
with OMP_NUM_THREADS=1 the CPU time does not grow when other processes share the cores). The spread
over repeats is printed. ``--mixed_precision`` defaults to ``no``: the quick start's fp16 autocast
runs emulated on a CPU (a step ~10x slower) and is no picture of a GPU's ratios.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_know_your_lora.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_does_nothing import quickstart_argv, quickstart_inputs  # noqa: E402


class Seconds(NamedTuple):
    wall: float
    cpu: float


@contextlib.contextmanager
def timed(owner: object, name: str, times: list[Seconds]) -> Iterator[None]:
    """Within: every call of ``owner.name`` appends its (wall, CPU) seconds to ``times``."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            times.append(Seconds(time.perf_counter() - wall, time.process_time() - cpu))

    setattr(owner, name, wrapper)
    try:
        yield
    finally:
        setattr(owner, name, original)


def run(argv: list[str], wrapped: dict[str, tuple[object, str]]) -> dict[str, list[Seconds]]:
    """Train with ``argv`` in this process; the seconds of every call of each wrapped function."""
    from accelerate.state import AcceleratorState, GradientState

    import sdxl_train_network

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    times: dict[str, list[Seconds]] = {name: [] for name in wrapped}
    with contextlib.ExitStack() as stack:
        for key, (owner, name) in wrapped.items():
            stack.enter_context(timed(owner, name, times[key]))
        sdxl_train_network.main(argv=argv)
    return times


def spread(values: list[float], format_value: Callable[[float], str]) -> str:
    return (f"median {format_value(statistics.median(values))} (min {format_value(min(values))}, "
            f"max {format_value(max(values))}, {len(values)} runs)")


def median_of(times: list[Seconds], clock: str, skip_first: bool = True) -> float:
    """The median of one clock over the calls (the first step, the warm-up, left out)."""
    return statistics.median(getattr(seconds, clock) for seconds in times[1 if skip_first and len(times) > 1 else 0:])


CLOCKS = ("cpu", "wall")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench_does_nothing_work"))
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (checks every steps/4, "
                                                              "at most 50)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--finder_steps", type=int, default=20)
    parser.add_argument("--mixed_precision", default="no", help="no (default: see the docstring) or fp16")
    parser.add_argument("--skip_finder", action="store_true")
    args = parser.parse_args()
    models, dataset = quickstart_inputs(args.work)

    from library import lora_effect, lr_finder
    from library.training import diffusion_loss, trainer

    cadence = lora_effect.LATER_CHECK_EVERY  # the default cadence of a long run (after the check at step 50)
    every = lora_effect.check_step(args.steps)  # check() is called every step and works at its multiples
    wrapped = {"step": (trainer.Trainer, "train_step"), "debiased": (diffusion_loss, "add_base_loss"),
               "check": (lora_effect.EffectMonitor, "check")}
    shares: dict[str, dict[str, list[float]]] = {name: {clock: [] for clock in CLOCKS} for name in
                                                 ("debiased inside", "debiased run/run", "monitor", "base pass",
                                                  "finder")}
    for repeat in range(args.repeats):
        base_argv = quickstart_argv(models, dataset, args.work / f"cost_plain_{repeat}", 0, "5e-3", args.steps)
        plain_times = run(base_argv + ["--mixed_precision", args.mixed_precision], wrapped)
        debiased_times = run(quickstart_argv(models, dataset, args.work / f"cost_debiased_{repeat}", 0, "5e-3",
                                             args.steps) + ["--mixed_precision", args.mixed_precision,
                                                            "--debiased_loss"], wrapped)
        ramp_times: list[Seconds] = []
        if not args.skip_finder:
            ramp_times = run(quickstart_argv(models, dataset, args.work / f"cost_finder_{repeat}", 0, "5e-3",
                                             args.steps) + ["--mixed_precision", args.mixed_precision,
                                                            "--find_lr_only", "--find_lr_steps",
                                                            str(args.finder_steps)],
                             {"ramp": (lr_finder, "ramp")})["ramp"]
        line = []
        for clock in CLOCKS:
            plain = median_of(plain_times["step"], clock)
            with_debiased = median_of(debiased_times["step"], clock)
            debiased = statistics.median(getattr(seconds, clock) for seconds in debiased_times["debiased"])
            checks = [getattr(seconds, clock) for seconds in plain_times["check"]]
            done = [seconds for index, seconds in enumerate(checks) if (index + 1) % every == 0]
            idle = [seconds for index, seconds in enumerate(checks) if (index + 1) % every]
            check = statistics.median(done[1:]) if len(done) > 1 else done[0]
            per_step = check / cadence + (statistics.mean(idle) if idle else 0.0)  # one check per 50 + the calls
            shares["debiased inside"][clock].append(debiased / (with_debiased - debiased))
            shares["debiased run/run"][clock].append(with_debiased / plain - 1)
            shares["monitor"][clock].append(per_step / plain)
            shares["base pass"][clock].append((done[0] - check) / plain)
            line.append(f"{clock}: step {plain * 1000:.0f} ms, with --debiased_loss {with_debiased * 1000:.0f} ms "
                        f"(its forward {debiased * 1000:.0f} ms); a check {check * 1000:.0f} ms ({len(done)} checks)")
            if ramp_times:
                shares["finder"][clock].append(getattr(ramp_times[0], clock) / plain)
                line.append(f"{clock}: --find_lr ({args.finder_steps} steps) {getattr(ramp_times[0], clock):.1f} s")
        print(f"RESULT run {repeat}: " + "; ".join(line), flush=True)
    for clock in CLOCKS:
        print(f"RESULT {clock} time, --debiased_loss: its forward {spread(shares['debiased inside'][clock], '{:.1%}'.format)}"
              f" of the rest of a step; run against run {spread(shares['debiased run/run'][clock], '{:+.1%}'.format)}")
        print(f"RESULT {clock} time, effect monitor at one check per {cadence} steps: "
              f"{spread(shares['monitor'][clock], '{:.2%}'.format)} of a step; its base pass once: "
              f"{spread(shares['base pass'][clock], '{:.1f} steps'.format)}")
        if shares["finder"][clock]:
            print(f"RESULT {clock} time, --find_lr ({args.finder_steps} steps): "
                  f"{spread(shares['finder'][clock], '{:.0f} training steps'.format)}")

if __name__ == "__main__":
    main()
