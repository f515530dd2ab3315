"""Seconds per optimizer step and peak RSS of SDXL LoRA training on the tiny model.

    python benchmarks/bench_tiny_sdxl_step.py [--resolutions 64 128] [--steps 10 30]

For each resolution and precision (fp32, fp16 with GradScaler) it trains twice in a
fresh process, with the short and the long step count; the steady time per step is
(long - short) / (long - short steps), which cancels start-up and model loading.
A baseline for later work; not run in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# Runs one training and prints the child's peak RSS (ru_maxrss is in KiB on Linux).
CHILD = """
import resource, sys
sys.path.insert(0, {repo!r})
import sdxl_train_network
sdxl_train_network.main({argv!r})
print("PEAK_RSS_KIB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def train_once(
    models: dict, dataset: str, out: str, resolution: int, precision: str, steps: int, extra: tuple[str, ...] = ()
) -> tuple[float, float]:
    """Train in a fresh process; returns (wall seconds, peak RSS GiB)."""
    argv = [
        "--pretrained_model_name_or_path", str(models["sdxl_file"]), "--model_config_dir", str(models["sdxl_config"]),
        "--train_data_dir", dataset, "--caption_extension", ".txt", "--resolution", str(resolution),
        "--output_dir", out, "--max_train_steps", str(steps), "--mixed_precision", precision,
        "--network_dim", "8", "--seed", "0", "--max_data_loader_n_workers", "0", *extra,
    ]
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", CHILD.format(repo=REPO, argv=argv)],
        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=True,
    )
    elapsed = time.perf_counter() - start
    peak_kib = int(result.stdout.split("PEAK_RSS_KIB")[-1].split()[0])
    return elapsed, peak_kib / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resolutions", type=int, nargs="+", default=[64, 128], help="pixels (default 64 128)")
    parser.add_argument("--steps", type=int, nargs=2, default=[10, 30], help="short and long runs (default 10 30)")
    args = parser.parse_args()
    from tools.build_tiny_models import build_tiny_models
    from tools.make_demo_dataset import make_demo_dataset

    with tempfile.TemporaryDirectory() as tmp:
        models = build_tiny_models(os.path.join(tmp, "models"))
        dataset = os.path.join(tmp, "dataset")
        make_demo_dataset(dataset, count=8, size=max(args.resolutions))
        results = []
        for resolution in args.resolutions:
            for precision in ("no", "fp16"):
                short_s, _ = train_once(models, dataset, os.path.join(tmp, "a"), resolution, precision, args.steps[0])
                long_s, peak_gib = train_once(models, dataset, os.path.join(tmp, "b"), resolution, precision, args.steps[1])
                step_s = (long_s - short_s) / (args.steps[1] - args.steps[0])
                results.append({"resolution": resolution, "precision": precision, "step_s": round(step_s, 4),
                                "peak_rss_gib": round(peak_gib, 3)})
                print(json.dumps(results[-1]), flush=True)
        fp16_vs_fp32 = [
            next(r["step_s"] for r in results if r["resolution"] == res and r["precision"] == "fp16")
            / next(r["step_s"] for r in results if r["resolution"] == res and r["precision"] == "no")
            for res in args.resolutions
        ]
        print(" ".join(f"fp16_over_fp32_{res}px={ratio:.2f}" for res, ratio in zip(args.resolutions, fp16_vs_fp32)))


if __name__ == "__main__":
    main()
