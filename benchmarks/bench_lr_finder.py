"""Does ``--find_lr`` earn its place? (issue 32, docs/know_your_lora.md). On the tiny SDXL with a base
pre-trained on one synthetic image set and LoRAs trained on another:

1. the base: the tiny SDXL with a rank-16 LoRA trained on set A (``make_demo_dataset`` seed 1000) merged in
   (``networks/sdxl_merge_lora.py``), so the base has learnt something before the LoRAs start;
2. per data seed d (set B_d: ``make_demo_dataset`` seed d, a third of it held out by ``--validation_split``):
   a grid of constant learning rates (``--low`` .. ``--high``, a third of a decade apart), each trained
   ``--steps`` steps from the same start for ``--seeds`` training seeds (noise and timesteps drawn per seed),
   scored by the held-out gain (1 - validation loss / the base's). The **good band**: the rates whose mean
   gain is at least 80% of the best rate's and that did not diverge (no non-finite loss, held-out loss not
   above the base's) in any seed;
3. the finder (``--find_lr``'s ramp on the same run) gives its suggestion; the classic rules on the ramp's
   smoothed training loss (torch-lr-finder's smoothing and cut, ``classic_rules``) give theirs: the steepest descent
   (the most negative slope over log rate) and the minimum / 10.

It prints, per data seed, the band and each rule's rate (in band or not), then per rule: in band for N of
the data seeds, and the max/min spread of its rates. Issue 32 asks for the finder's suggestion in band for
>= 4 of 5 data seeds with a spread <= 3x, and at least as often as the classic rules. ``--alpha_check``
trains the first data seed also with ``--network_alpha`` = the rank: the grid's best rate and the
suggestion should move by the same ratio (within 2x).

Every grid point starts from the state captured after the build and is put back with the self-healing's
``RunStates.capture/restore`` (as the finder is), so one model load serves a data seed's whole grid.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_lr_finder.py [--data_seeds 5] [--quick]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

RANK = 4
BAND_FRACTION = 0.8  # the good band: mean held-out gain >= 80% of the best rate's
GRID_EPOCH = -2_000_000  # keyed-draw slots of the grid's steps (no training, validation or finder draw uses them)
SMOOTHING = 0.05  # the classic rules' smoothing of the training loss (torch-lr-finder's smooth_f)
SKIP_START, SKIP_END = 10, 5  # torch-lr-finder's default cut of the curve before it suggests


@dataclass
class GridPoint:
    rate: float
    gains: list[float]  # held-out gain per training seed
    diverged: bool


def grid_rates(low: float, high: float) -> list[float]:
    """``low`` .. ``high``, a third of a decade apart."""
    count = round(3 * math.log10(high / low))
    return [low * 10 ** (index / 3) for index in range(count + 1)]


def build_inputs(work: Path, base_steps: int) -> tuple[Path, Path]:
    """(the tiny models folder, the pre-trained base file), built once in ``work``."""
    from benchmarks.bench_does_nothing import quickstart_argv
    from networks import merge_lora
    from tools.build_tiny_models import build_tiny_models
    from tools.make_demo_dataset import make_demo_dataset

    models, base = work / "models", work / "base_pretrained_on_A.safetensors"
    if not (models / "sdxl.safetensors").exists():
        build_tiny_models(models)
    if not base.exists():
        set_a = work / "set_A"
        make_demo_dataset(str(set_a), count=8, size=64, repeats=1, seed=1000)
        # fp32: the quick start's fp16 autocast is several times slower on a CPU and changes nothing here
        argv = quickstart_argv(models, set_a, work / "pretrain", 0, "1e-3", base_steps) + ["--mixed_precision", "no"]
        train(argv)
        merge_lora.main(["--sd_model", str(models / "sdxl.safetensors"), "--model_config_dir",
                         str(models / "sdxl_config"), "--save_to", str(base), "--models",
                         str(work / "pretrain" / "quickstart_lora.safetensors")])
    return models, base


def train(argv: list[str]) -> None:
    from accelerate.state import AcceleratorState, GradientState

    import sdxl_train_network

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    sdxl_train_network.main(argv=argv)


def run_argv(models: Path, base: Path, dataset: Path, output: Path, alpha: float, finder_steps: int) -> list[str]:
    return ["--pretrained_model_name_or_path", str(base), "--model_config_dir", str(models / "sdxl_config"),
            "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
            "--output_dir", str(output), "--output_name", "lora", "--network_module", "networks.lora",
            "--network_dim", str(RANK), "--network_alpha", str(alpha), "--network_train_unet_only",
            "--optimizer_type", "AdamW", "--learning_rate", "1e-3", "--max_train_steps", "1", "--seed", "0",
            "--max_data_loader_n_workers", "0", "--validation_split", "0.34", "--validation_seed", "1",
            "--find_lr_steps", str(finder_steps)]


def build_run(argv: list[str]):
    """The trainer and its built run (models, data, network, optimizer, validation), as ``train`` builds them."""
    from accelerate.state import AcceleratorState, GradientState

    import sdxl_train_network
    from library import config_file

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    args, explicit = config_file.parse_args(sdxl_train_network.setup_parser(), argv)
    trainer = sdxl_train_network.SdxlNetworkTrainer()
    return trainer, trainer.build_run(args, explicit)


def grid(trainer, run, rates: list[float], seeds: int, steps: int) -> list[GridPoint]:
    """Each rate trained ``steps`` steps from the captured start per training seed; held-out gains."""
    import functools

    from library import lr_finder

    progress, states = run.progress, run.states
    batch_loss = functools.partial(trainer.validation_loss, run.loss)
    batches = lr_finder.probe_batches(run, len(run.data.dataset))
    states.capture(progress.global_step, position=(progress.epoch, progress.batches_done))
    multiplier = run.network.multiplier
    run.network.set_multiplier(0.0)
    base = run.validator.losses(run.network, batch_loss)[0]
    run.network.set_multiplier(multiplier)
    points = []
    for rate in rates:
        started, cpu_started = time.perf_counter(), time.process_time()
        gains, diverged = [], False
        for seed in range(seeds):
            states.restore(run.device)
            for group in run.optimization.optimizer.param_groups:
                group["lr"] = rate
            for step in range(steps):
                loss = lr_finder.train_step(trainer, run, batches[step % len(batches)],
                                            GRID_EPOCH - 10_000 * seed - step)
                diverged |= not math.isfinite(loss)
            held_out = run.validator.losses(run.network, batch_loss)[0]
            diverged |= not math.isfinite(held_out) or held_out > base
            gains.append(1 - held_out / base if math.isfinite(held_out) else -math.inf)
        points.append(GridPoint(rate, gains, diverged))
        print(f"grid point {rate:.2e}: gains {', '.join(f'{gain:+.5f}' for gain in gains)}"
              f"{' (diverged)' if diverged else ''}; {time.perf_counter() - started:.1f} s wall, "
              f"{time.process_time() - cpu_started:.1f} s CPU", flush=True)
    states.restore(run.device)
    return points


def band(points: list[GridPoint]) -> tuple[list[float], float]:
    """(the good band's rates, the best rate)."""
    means = {point.rate: statistics.mean(point.gains) for point in points}
    best = max((point for point in points if not point.diverged), key=lambda point: means[point.rate])
    return [point.rate for point in points if not point.diverged
            and means[point.rate] >= BAND_FRACTION * means[best.rate]], best.rate


def classic_rules(rows) -> dict[str, Optional[float]]:
    """Steepest descent and min/10 on the ramp's smoothed training loss, as torch-lr-finder suggests them:
    its smoothing (``smoothed = SMOOTHING * loss + (1 - SMOOTHING) * previous``, from the first loss) and its
    default cut of the curve (the first ``SKIP_START`` and last ``SKIP_END`` points left out: the start is
    the smoothing's warm-up, the end the blow-up); steepest = the most negative slope over the (evenly
    log-spaced) steps, min/10 = fastai's minimum of the smoothed loss / 10. Finite rows only."""
    finite = [row for row in rows if math.isfinite(row.train_loss)]
    smoothed: list[float] = []
    for row in finite:
        smoothed.append(row.train_loss if not smoothed else SMOOTHING * row.train_loss + (1 - SMOOTHING) * smoothed[-1])
    cut = slice(SKIP_START, len(finite) - SKIP_END) if len(finite) - SKIP_START - SKIP_END >= 3 else slice(None)
    finite, smoothed = finite[cut], smoothed[cut]
    if len(smoothed) < 3:
        return {"steepest": None, "min/10": None}
    slopes = [smoothed[1] - smoothed[0]] + [(smoothed[index + 1] - smoothed[index - 1]) / 2
                                            for index in range(1, len(smoothed) - 1)] + [smoothed[-1] - smoothed[-2]]
    steepest = finite[min(range(len(slopes)), key=slopes.__getitem__)].learning_rate
    lowest = finite[min(range(len(smoothed)), key=smoothed.__getitem__)].learning_rate
    return {"steepest": steepest, "min/10": lowest / 10}


def finder_rule(found) -> Optional[float]:
    """The suggestion ``--find_lr`` printed until this experiment: a decade below the unstable edge, not below
    the lowest rate with a measurable effect (none without one)."""
    return None if found.low is None else max(found.low, found.unstable / 10)


def finder(trainer, run) -> tuple[dict[str, Optional[float]], dict]:
    """The rules' rates (the finder's former suggestion, the classic rules) and the ramp (its window and rows),
    from one ramp (everything put back)."""
    from library import lr_finder

    progress, states = run.progress, run.states
    states.capture(progress.global_step, position=(progress.epoch, progress.batches_done))
    try:
        rows, base = lr_finder.ramp(trainer, run)
    finally:
        states.restore(run.device)
    found = lr_finder.window(rows, base, run.args.find_lr_max)
    ramp = {"low": found.low, "unstable": found.unstable, "diverged": found.diverged,
            "rows": [(row.learning_rate, row.train_loss, row.probe_loss / base) for row in rows]}
    return {"finder": finder_rule(found), **classic_rules(rows)}, ramp


def data_seed_result(models: Path, base: Path, work: Path, data_seed: int, alpha: float, args) -> Optional[dict]:
    """One data seed's band and rules; kept in ``work`` (``result_B<seed>_a<alpha>.json``, with the settings
    it was made with), so data seeds can run as separate processes and a last run prints the summary."""
    from tools.make_demo_dataset import make_demo_dataset

    settings = {key: getattr(args, key) for key in ("seeds", "steps", "low", "high", "finder_steps", "base_steps")}
    if alpha != 1.0:
        settings["seeds"] = args.alpha_seeds or args.seeds
    kept = work / f"result_B{data_seed}_a{alpha:g}.json"
    if kept.exists():
        result = json.loads(kept.read_text())
        if result["settings"] == settings:
            print(result["line"], flush=True)
            return result
    if args.summary_only:
        return None
    dataset = work / f"set_B{data_seed}"
    if not dataset.exists():
        make_demo_dataset(str(dataset), count=6, size=64, repeats=1, seed=data_seed)
    trainer, run = build_run(run_argv(models, base, dataset, work / f"out_B{data_seed}_a{alpha:g}", alpha,
                                      args.finder_steps))
    started, cpu_started = time.perf_counter(), time.process_time()
    with run.outputs:
        rules, ramp = finder(trainer, run)
        print(f"finder: {time.perf_counter() - started:.1f} s wall, {time.process_time() - cpu_started:.1f} s CPU",
              flush=True)
        points = grid(trainer, run, grid_rates(args.low, args.high), settings["seeds"], args.steps)
    rates, best = band(points)
    line = (f"RESULT data seed {data_seed} alpha {alpha:g}: good band {min(rates):.2g} .. {max(rates):.2g} "
          f"(best {best:.2g}; gains " + ", ".join(f"{point.rate:.1e}:{statistics.mean(point.gains):+.4f}"
                                                  f"{'!' if point.diverged else ''}" for point in points) + f"); finder window "
            + (f"{ramp['low']:.2g}" if ramp["low"] is not None else "none") + f" .. {ramp['unstable']:.2g}; "
          + ", ".join(f"{name} {rate:.2g} {'IN' if in_band(rate, (min(rates), max(rates))) else 'out'}"
                      if rate is not None else f"{name} none" for name, rate in rules.items())
          + f" ({time.perf_counter() - started:.0f} s wall, {time.process_time() - cpu_started:.0f} s CPU)")
    print(line, flush=True)
    result = {"band": (min(rates), max(rates)), "best": best, "rules": rules, "line": line, "settings": settings,
              "ramp": ramp,
              "gains": {f"{point.rate:.3e}": point.gains for point in points},
              "diverged": [f"{point.rate:.3e}" for point in points if point.diverged]}
    kept.write_text(json.dumps(result, indent=1))
    return result


HALF_STEP = 10 ** (1 / 6)  # half the grid's step: a rate within it of a band rate rounds to it


def in_band(rate: Optional[float], limits: tuple[float, float]) -> bool:
    """Whether ``rate`` rounds (on the log grid) to a rate of the band ``limits`` (its lowest .. highest rate):
    the grid cannot tell rates apart more finely, and a one-rate band would take no rate between grid points."""
    return rate is not None and limits[0] / HALF_STEP <= rate <= limits[1] * HALF_STEP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("bench_lr_finder_work"))
    parser.add_argument("--data_seeds", type=int, default=5)
    parser.add_argument("--only_data_seeds", type=int, nargs="*", default=None,
                        help="run (and keep in --work) only these data seeds, no summary: to split the experiment "
                             "over processes; a later run without it prints the summary from the kept results")
    parser.add_argument("--seeds", type=int, default=3, help="training seeds per grid point")
    parser.add_argument("--steps", type=int, default=30, help="steps per grid point")
    parser.add_argument("--low", type=float, default=1e-5)
    parser.add_argument("--high", type=float, default=1e-1)
    parser.add_argument("--finder_steps", type=int, default=40)
    parser.add_argument("--base_steps", type=int, default=60, help="steps of the base's pre-training on set A")
    parser.add_argument("--summary_only", action="store_true", help="the summary of the results kept in --work "
                                                                     "(the data seeds not run are left out)")
    parser.add_argument("--alpha_check", action="store_true", help="also data seed 0 with --network_alpha = rank")
    parser.add_argument("--alpha_seeds", type=int, default=None, help="training seeds per grid point of the "
                                                                      "--alpha_check run (default --seeds)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 data seed, 1 seed, 4 steps, "
                                                             "rates 1e-4 .. 1e-2")
    args = parser.parse_args()
    if args.quick:
        args.data_seeds, args.seeds, args.steps, args.low, args.high, args.finder_steps, args.base_steps = \
            1, 1, 4, 1e-4, 1e-2, 10, 4
    models, base = build_inputs(args.work, args.base_steps)
    if args.only_data_seeds is not None:
        for seed in args.only_data_seeds:
            data_seed_result(models, base, args.work, seed, 1.0, args)
        if args.alpha_check:
            data_seed_result(models, base, args.work, 0, float(RANK), args)
        return
    kept = {seed: data_seed_result(models, base, args.work, seed, 1.0, args) for seed in range(args.data_seeds)}
    seeds = [seed for seed, result in kept.items() if result is not None]
    results = [kept[seed] for seed in seeds]
    for result, seed in zip(results, seeds):
        print(f"RESULT data seed {seed}: band {result['band'][0]:.2g} .. {result['band'][1]:.2g}; " + ", ".join(
            f"{rule} " + (f"{rate:.2g} {'in' if in_band(rate, result['band']) else 'out'}" if rate else "none")
            for rule, rate in result["rules"].items()))
    for rule in results[0]["rules"]:
        rates = [result["rules"][rule] for result in results]
        hits = sum(in_band(rate, result["band"]) for rate, result in zip(rates, results))
        found = [rate for rate in rates if rate is not None]
        print(f"RESULT {rule}: in the good band for {hits} of {len(results)} data seeds; spread "
              + (f"{max(found) / min(found):.2f}x" if found else "none"))
    if args.alpha_check and 0 in seeds:
        scaled = data_seed_result(models, base, args.work, 0, float(RANK), args)
    if args.alpha_check and 0 in seeds and scaled is not None:
        best_ratio = results[0]["best"] / scaled["best"]
        finder_ratio = (results[0]["rules"]["finder"] / scaled["rules"]["finder"]
                        if results[0]["rules"]["finder"] and scaled["rules"]["finder"] else math.nan)
        print(f"RESULT --network_alpha 1 -> {RANK}: the grid's best rate moves {best_ratio:.2f}x down, the finder's "
              f"suggestion {finder_ratio:.2f}x (within 2x: {0.5 <= finder_ratio / best_ratio <= 2})")
        for edge in ("low", "unstable"):
            if "ramp" in results[0] and "ramp" in scaled and results[0]["ramp"][edge] and scaled["ramp"][edge]:
                print(f"RESULT --network_alpha 1 -> {RANK}: the finder window's {edge} edge moves "
                      f"{results[0]['ramp'][edge] / scaled['ramp'][edge]:.2f}x down")


if __name__ == "__main__":
    main()
