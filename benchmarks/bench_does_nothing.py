"""The "this LoRA does nothing" check (library/lora_effect.py) on the quick start's settings: the
median weight change ||delta W|| / ||W|| at the check step over several seeds (it must stay silent),
and at learning rate 1e-9 (it must fire). Prints one row per run and the margin to the floor.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_does_nothing.py --seeds 20

Runs the trainer in this process (the quick start's tiny SDXL and demo dataset, built in --work).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from library import lora_effect  # noqa: E402


def quickstart_argv(models: Path, dataset: Path, output: Path, seed: int, learning_rate: str, steps: int) -> list[str]:
    """scripts/quickstart.sh's training flags (without its sample logging)."""
    return [
        "--pretrained_model_name_or_path", str(models / "sdxl.safetensors"),
        "--model_config_dir", str(models / "sdxl_config"),
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output), "--output_name", "quickstart_lora",
        "--network_dim", "16", "--network_alpha", "16", "--network_args", "conv_dim=16", "conv_alpha=16",
        "--learning_rate", learning_rate, "--optimizer_type", "AdamW",
        "--mixed_precision", "fp16", "--max_train_steps", str(steps), "--seed", str(seed),
        "--max_data_loader_n_workers", "0", "--grad_guard_preset", "stable", "--log_jsonl", str(output / "log.jsonl"),
    ]


def quickstart_inputs(work: Path) -> tuple[Path, Path]:
    """The quick start's tiny models and demo dataset in ``work`` (built once)."""
    from tools.build_tiny_models import build_tiny_models
    from tools.make_demo_dataset import make_demo_dataset

    models, dataset = work / "models", work / "dataset"
    if not (models / "sdxl.safetensors").exists():
        build_tiny_models(models)
    if not dataset.exists():
        make_demo_dataset(str(dataset))
    return models, dataset


def run_once(argv: list[str], output: Path) -> tuple[float, bool]:
    """(median weight change at the check step, whether the warning fired)."""
    from accelerate.state import AcceleratorState, GradientState

    import sdxl_train_network

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    sdxl_train_network.main(argv=argv)
    rows = [json.loads(line) for line in (output / "log.jsonl").read_text().splitlines()]
    medians = [row["effect/weight_rel_median"] for row in rows if "effect/weight_rel_median" in row]
    return medians[0], medians[0] < lora_effect.DOES_NOTHING_FLOOR


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--first_seed", type=int, default=0, help="seeds first_seed .. first_seed + seeds - 1")
    parser.add_argument("--skip_low_rate", action="store_true", help="leave out the lr 1e-9 run")
    parser.add_argument("--steps", type=int, default=40, help="the quick start's 40 (the check is at step 10)")
    parser.add_argument("--work", type=Path, default=Path("bench_does_nothing_work"))
    args = parser.parse_args()
    models, dataset = quickstart_inputs(args.work)
    print(f"check step {lora_effect.check_step(args.steps)}, floor {lora_effect.DOES_NOTHING_FLOOR:g}")
    results = []
    low = () if args.skip_low_rate else (("1e-9", range(1)),)
    for learning_rate, seeds in (*low, ("5e-3", range(args.first_seed, args.first_seed + args.seeds))):
        for seed in seeds:
            output = args.work / f"run_{learning_rate}_{seed}"
            started = time.perf_counter()
            median, fired = run_once(quickstart_argv(models, dataset, output, seed, learning_rate, args.steps), output)
            results.append((learning_rate, seed, median, fired))
            print(f"RESULT lr {learning_rate} seed {seed}: median weight change {median:.3g}, warning "
                  f"{'fired' if fired else 'silent'} ({time.perf_counter() - started:.0f} s)", flush=True)
    quickstart = [median for lr, _, median, _ in results if lr == "5e-3"]
    print(f"quick start: {sum(not fired for lr, _, _, fired in results if lr == '5e-3')} of {len(quickstart)} silent; "
          f"smallest median {min(quickstart):.3g} = {min(quickstart) / lora_effect.DOES_NOTHING_FLOOR:.3g} x the floor")


if __name__ == "__main__":
    main()
