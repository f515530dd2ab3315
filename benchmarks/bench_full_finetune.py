"""Full-size SDXL UNet full fine-tune: step time and peak RSS, ours (``sdxl_train.py``) vs kohya's own.

    python benchmarks/bench_full_finetune.py --kohya_dir /path/to/kohya/sd-scripts
        --kohya_python /path/to/kohya_venv/bin/python [--work_dir /tmp/bench_full_sdxl] [--steps 3]
        [--rounds 2] [--resolution 256] [--fused_backward_pass] [--precision bf16|fp32] [--only ours|kohya]
        [--ours_args "--fused_backward_kept_gradient_gib 0"]

The model, tokenizers and 4-image dataset are ``benchmarks/bench_full_sdxl.py``'s (built once into
``--work_dir``, shared with it): a full-size SDXL base single file with random weights (fp16).
Both trainers get the same command line, kohya's memory flags for a full fine-tune on a small machine:
``--mixed_precision bf16 --full_bf16 --optimizer_type adafactor`` (``relative_step=False``, constant
learning rate) ``--gradient_checkpointing --cache_latents --cache_text_encoder_outputs --sdpa``, batch 1 at
``--resolution``, ``--max_train_steps --steps``, ``--save_precision bf16`` (the final checkpoint is written
and then deleted), plus ``--fused_backward_pass`` with that flag (kohya's Adafactor-only option). kohya's
``sdxl_train.py`` runs from ``--kohya_dir`` with ``--kohya_python`` (a venv with kohya's own pins).
``--precision fp32`` replaces ``--mixed_precision bf16 --full_bf16`` by ``--mixed_precision no`` (float32
weights and compute, ``--save_precision`` still bf16): for CPUs without bfloat16 kernels (an AMD EPYC with
AVX2 only runs a bf16 matmul at ~0.3 GFLOP/s against ~40 in float32, so a bf16 step takes hours there).

Measured from outside each trainer, the same way for both: the process is started through a small
wrapper that only records ``(wall time, CPU time)`` each time the learning-rate scheduler steps (once per
optimizer step in both trainers, fused or not); the step time is the median interval between those
marks over the last ``--steps - 1`` steps (the first step is warm-up). Peak RSS is the kernel's
(``ru_maxrss`` from ``wait4``: the whole run, model load included), plus the largest ``VmRSS`` sampled
every 0.2 s while the timed steps run. The runs go one after the other (never two at once: each needs
most of a 24 GiB machine), kohya's then ours, ``--rounds`` times (A B A B), and the load average is
printed beside each run: other processes on a shared machine slow the wall time (CPU seconds per step,
also printed, are less disturbed). The last line is the ratios of the medians over the rounds:
``step_ratio=<ours / kohya's> rss_ratio=<ours / kohya's> train_rss_ratio=..`` (targets <= 1.0).
Not run in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

# Runs the trainer script as __main__ after hooking the LR scheduler's step: one mark per optimizer step
# (the constructor's own first step() is the first mark), with the scheduler's id. Either venv (torch only).
WRAPPER = r"""
import json, os, runpy, sys, time
import torch
marks_path = os.environ["BENCH_MARKS"]
original_step = torch.optim.lr_scheduler.LRScheduler.step

def step(self, *args, **kwargs):
    with open(marks_path, "a") as file:
        file.write(json.dumps([time.time(), time.process_time(), id(self)]) + "\n")
    return original_step(self, *args, **kwargs)

torch.optim.lr_scheduler.LRScheduler.step = step
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
"""


def trainer_argv(paths: dict[str, Path], out_dir: Path, steps: int, resolution: int, fused: bool,
                 precision: str = "bf16") -> list[str]:
    return [
        "--pretrained_model_name_or_path", str(paths["model"]), "--tokenizer_cache_dir", str(paths["tokenizers"]),
        "--train_data_dir", str(paths["dataset"]), "--caption_extension", ".txt",
        "--resolution", str(resolution), "--train_batch_size", "1",
        "--output_dir", str(out_dir), "--output_name", "bench_full", "--save_model_as", "safetensors",
        "--save_precision", "bf16",
        *(["--mixed_precision", "bf16", "--full_bf16"] if precision == "bf16" else ["--mixed_precision", "no"]),
        "--optimizer_type", "adafactor", "--optimizer_args", "scale_parameter=False", "relative_step=False",
        "warmup_init=False", "--learning_rate", "1e-6", "--lr_scheduler", "constant",
        "--gradient_checkpointing", "--cache_latents", "--cache_text_encoder_outputs", "--sdpa",
        "--max_train_steps", str(steps), "--seed", "0", "--max_data_loader_n_workers", "0",
        *(["--fused_backward_pass"] if fused else []),
    ]


def run_one(name: str, python: str, script: Path, argv: list[str], steps: int, pythonpath: str = "") -> dict:
    """Run ``script`` under the wrapper (``pythonpath``: its PYTHONPATH); return its step times, peak RSS
    and load average."""
    with tempfile.TemporaryDirectory() as scratch:
        marks_path = Path(scratch) / "marks.jsonl"
        log_path = Path(argv[argv.index("--output_dir") + 1]).parent / f"log_{name}.txt"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "BENCH_MARKS": str(marks_path), "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": str(os.cpu_count()), "PYTHONPATH": pythonpath}
        load_before = os.getloadavg()[0]
        start = time.time()
        with open(log_path, "w") as log:
            process = subprocess.Popen([python, "-c", WRAPPER, str(script), *argv], cwd=script.parent, env=env,
                                       stdout=log, stderr=subprocess.STDOUT)
            samples: list[tuple[float, int]] = []
            done = threading.Event()

            def sample() -> None:
                status = Path(f"/proc/{process.pid}/status")
                while not done.wait(0.2):
                    try:
                        text = status.read_text()
                    except OSError:
                        return
                    for line in text.splitlines():
                        if line.startswith("VmRSS:"):
                            samples.append((time.time(), int(line.split()[1]) * 1024))

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            _, status_code, usage = os.wait4(process.pid, 0)
            process.returncode = os.waitstatus_to_exitcode(status_code)
            done.set()
            sampler.join()
        total_s = time.time() - start
        marks = [json.loads(line) for line in marks_path.read_text().splitlines()] if marks_path.exists() else []
        # kohya's sdxl_train.py at full size is killed by the kernel's OOM killer while it writes the checkpoint on
        # a 24 GiB machine (its save copies the UNet and text encoders): its steps are measured all the same
        last_schedule = [mark for mark in marks if mark[2] == marks[-1][2]]
        if process.returncode != 0 and len(last_schedule) != steps + 1:
            sys.exit(f"{name} failed with exit code {process.returncode}; log: {log_path}\n"
                     + log_path.read_text()[-3000:])
    # The training schedule is the one that stepped last (a trainer may build and drop a probe one first).
    marks = [mark for mark in marks if mark[2] == marks[-1][2]]
    # marks[0]: the scheduler's construction; marks[i]: after optimizer step i.
    if len(marks) != steps + 1:
        sys.exit(f"{name}: {len(marks)} scheduler marks for {steps} steps; log: {log_path}")
    walls = [marks[i][0] - marks[i - 1][0] for i in range(2, len(marks))]
    cpus = [marks[i][1] - marks[i - 1][1] for i in range(2, len(marks))]
    train_rss = max((rss for when, rss in samples if marks[1][0] <= when <= marks[-1][0]), default=0)
    return {"name": name, "step_s": statistics.median(walls), "steps_s": walls,
            "cpu_step_s": statistics.median(cpus), "first_step_s": marks[1][0] - marks[0][0],
            "peak_rss_gib": usage.ru_maxrss * 1024 / 2**30, "train_rss_gib": train_rss / 2**30,
            "exit_code": process.returncode,
            "total_s": total_s, "load_before": load_before, "load_after": os.getloadavg()[0], "log": str(log_path)}


def main() -> None:
    from bench_full_sdxl import prepare

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kohya_dir", required=True, help="kohya-ss sd-scripts tree (its sdxl_train.py)")
    parser.add_argument("--kohya_python", required=True, help="python of a venv with kohya's requirements")
    parser.add_argument("--kohya_pythonpath", default="", help="more folders on kohya's PYTHONPATH (e.g. a "
                        "torchvision stand-in: kohya imports torchvision.transforms, no CPU wheel for torch 2.13)")
    parser.add_argument("--work_dir", default="/tmp/bench_full_sdxl", help="model, tokenizers, dataset, logs")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (default 3; the last "
                        "steps - 1 are timed)")
    parser.add_argument("--rounds", type=int, default=2, help="ours, kohya's pairs, back to back (default 2)")
    parser.add_argument("--resolution", type=int, default=256, help="training resolution (default 256)")
    parser.add_argument("--fused_backward_pass", action="store_true", help="both trainers with it")
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16", help="bf16: kohya's memory flags "
                        "(--mixed_precision bf16 --full_bf16, default); fp32: --mixed_precision no, for a CPU "
                        "without bfloat16 kernels")
    parser.add_argument("--only", choices=["ours", "kohya"], help="run one side only")
    parser.add_argument("--ours_args", default="", help="more options for our trainer only, one string (e.g. "
                        "'--fused_backward_kept_gradient_gib 0': kohya's memory, every gradient computed twice)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps: at least 2 (the first step is not timed)")
    work_dir = Path(args.work_dir)
    paths = prepare(work_dir)
    kohya_dir = Path(args.kohya_dir).resolve()
    # kohya's first: a flag its parser refuses shows before ours has spent its run
    sides = {"kohya": (args.kohya_python, kohya_dir / "sdxl_train.py",
                       os.pathsep.join([str(kohya_dir), *filter(None, [args.kohya_pythonpath])])),
             "ours": (sys.executable, REPO / "sdxl_train.py", "")}
    variant = ("fused" if args.fused_backward_pass else "unfused") + ("" if args.precision == "bf16" else "_fp32")
    results: dict[str, list[dict]] = {"ours": [], "kohya": []}
    for round_index in range(args.rounds):
        for side, (python, script, pythonpath) in sides.items():
            if args.only and side != args.only:
                continue
            out_dir = work_dir / f"out_{side}_{variant}"
            shutil.rmtree(out_dir, ignore_errors=True)
            argv = trainer_argv(paths, out_dir, args.steps, args.resolution, args.fused_backward_pass, args.precision)
            if side == "ours":
                argv += args.ours_args.split()
            result = run_one(f"{side}_{variant}_{round_index}", python, script, argv, args.steps, pythonpath)
            saved = out_dir / "bench_full.safetensors"
            if result["exit_code"] == 0 and not saved.is_file():
                sys.exit(f"{side}: no final checkpoint {saved}; log: {result['log']}")
            shutil.rmtree(out_dir, ignore_errors=True)  # 7 GB a run
            results[side].append(result)
            print(f"{result['name']}: step_s {result['step_s']:.1f} (timed {[round(s, 1) for s in result['steps_s']]}"
                  f", first {result['first_step_s']:.1f}) cpu_step_s {result['cpu_step_s']:.1f} peak_rss_gib "
                  f"{result['peak_rss_gib']:.2f} train_rss_gib {result['train_rss_gib']:.2f} total_s "
                  f"{result['total_s']:.0f} loadavg {result['load_before']:.1f}->{result['load_after']:.1f}"
                  + ("" if result["exit_code"] == 0 else f" EXIT {result['exit_code']} after its last step "
                     f"(-9: the OOM killer; its peak RSS is where it was killed)"),
                  flush=True)
    (work_dir / f"result_full_finetune_{variant}.json").write_text(json.dumps(results, indent=1))
    if args.only:
        return
    median = {side: {key: statistics.median(r[key] for r in runs) for key in
                     ("step_s", "cpu_step_s", "peak_rss_gib", "train_rss_gib")} for side, runs in results.items()}
    print(" ".join(f"{side}_{key}={value:.2f}" for side, values in median.items() for key, value in values.items()))
    print(f"step_ratio={median['ours']['step_s'] / median['kohya']['step_s']:.3f} "
          f"cpu_step_ratio={median['ours']['cpu_step_s'] / median['kohya']['cpu_step_s']:.3f} "
          f"rss_ratio={median['ours']['peak_rss_gib'] / median['kohya']['peak_rss_gib']:.3f} "
          f"train_rss_ratio={median['ours']['train_rss_gib'] / median['kohya']['train_rss_gib']:.3f} "
          f"({variant}; targets <= 1.0)")


if __name__ == "__main__":
    main()
