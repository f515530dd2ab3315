"""Peak memory and step time of a whole ``sdxl_train.py`` training step, fused backward against unfused.

    python benchmarks/bench_fused_training.py [--width 96] [--steps 3] [--resolution 64]
                                              [--variants unfused fused fused_kept0 fused_kept_third groups4]
                                              [--gradient_checkpointing]

Where ``benchmarks/bench_fused_backward.py`` times the fused backward alone on full-size SDXL transformer
layers, this runs the trainer itself (the loop's step path: backward, guard, scaler, healing, EMA hooks,
``library/training/gradient_step.py``) on an SDXL UNet of the real layout scaled down in width: levels
(W, 2W, 4W) channels with SDXL's depths (transformer layers 0 / 2 / 10 per level, 2 ResNet blocks, heads
of 64 channels) and the tiny text encoders and VAE (``tools/build_tiny_models.tiny_sdxl``). ``--width 96``:
about 230 M trained parameters, 0.86 GiB of fp32 weights. Adafactor (``relative_step=False``, lr 1e-5),
``--max_grad_norm 1``, batch 1, fp32, the minimal guard preset (the stable one adds the cosine log, which
keeps a whole previous gradient and which a fused backward turns off: not the same work). Variants, each in
its own process, one after the other:

* ``unfused``: the default step (gradients in ``.grad``, the flat buffer, clip, ``optimizer.step()``);
* ``fused``: ``--fused_backward_pass`` (a measuring backward, then one that steps each parameter), the
  measuring pass keeping what the automatic budget allows (half of the available memory: for these
  small models every gradient, so no second backward at all);
* ``fused_kept0``: the same with ``--fused_backward_kept_gradient_gib 0`` (kohya's memory: the second
  backward computes every gradient again);
* ``fused_kept_third``: the same keeping a third of the gradients' bytes (about the down blocks and the
  embeddings, which complete last: what a budget of a full-size SDXL UNet's ~1.5 GiB of them in bf16
  keeps): the second backward skips the down blocks;
* ``groups4``: ``--fused_optimizer_groups 4``.

Memory: the child resets the kernel's peak RSS (``/proc/self/clear_refs``) when the run is built (model
loaded, optimizer and state ready, before the first step) and reads ``VmHWM`` after each step:
``peak_rss_gib`` is the process's peak during the steps (the weights included; compare this one),
``step_add_gib`` what the steps add to the RSS at the start (the unfused run's flat gradient buffer is
allocated before, at the build, so it is in its ``start_rss_gib``, not in its ``step_add_gib``). Children run with ``MALLOC_MMAP_THRESHOLD_=131072`` so that freed
tensors leave the RSS. Time: the median CPU and wall seconds of the steps after the first. Prints one line
per variant and the ratios to ``unfused``. Not run in CI.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

VARIANT_FLAGS = {"unfused": [], "fused": ["--fused_backward_pass"],
                 "fused_kept0": ["--fused_backward_pass", "--fused_backward_kept_gradient_gib", "0"],
                 "fused_kept_third": ["--fused_backward_pass"],  # + the budget, from the model's size
                 "groups4": ["--fused_optimizer_groups", "4"]}


def status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def build_model(work_dir: Path, width: int) -> dict[str, Path]:
    """The scaled SDXL (single file + config folder) and a 4-image dataset, built once into ``work_dir``."""
    from tools.build_tiny_models import tiny_sdxl, write_model
    from tools.make_demo_dataset import make_demo_dataset

    name = f"sdxl_w{width}"
    paths = {"file": work_dir / f"{name}.safetensors", "config": work_dir / f"{name}_config",
             "data": work_dir / "data"}
    if not paths["file"].exists():
        models = tiny_sdxl(block_out_channels=(width, 2 * width, 4 * width), transformer_layers_per_block=(0, 2, 10),
                           attention_head_dim=(width // 64 or 1, 2 * width // 64, 4 * width // 64), sample_size=32)
        write_model(models, work_dir, name)
        del models
    if not paths["data"].exists():
        make_demo_dataset(str(paths["data"]), count=4, size=64, repeats=1)
    return paths


def child(argv: list[str]) -> None:
    """Train with ``argv`` in this process, measuring the steps; print one JSON line."""
    import gc
    import time

    import sdxl_train
    import train_network

    measured: dict = {"cpu_s": [], "wall_s": []}

    class MeasuredTrainer(sdxl_train.FullModelTrainer):
        def after_start(self, run) -> None:
            super().after_start(run)
            gc.collect()
            Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            measured["start_rss_kib"] = status_kib("VmRSS")
            measured["params_m"] = sum(p.numel() for p in run.optimization.trainable_params) / 1e6

        def train_step(self, run, window):
            cpu, wall = time.process_time(), time.perf_counter()
            result = super().train_step(run, window)
            measured["cpu_s"].append(time.process_time() - cpu)
            measured["wall_s"].append(time.perf_counter() - wall)
            measured["peak_kib"] = status_kib("VmHWM")  # the steps' peak (not the final file's write)
            return result

    train_network.main(MeasuredTrainer, sdxl_train.setup_parser, argv)
    print("RESULT " + json.dumps(measured), flush=True)


def run_variant(variant: str, paths: dict[str, Path], args: argparse.Namespace, output_dir: Path) -> dict:
    argv = ["--pretrained_model_name_or_path", str(paths["file"]), "--model_config_dir", str(paths["config"]),
            "--train_data_dir", str(paths["data"]), "--resolution", str(args.resolution), "--seed", "1",
            "--max_data_loader_n_workers", "0", "--output_dir", str(output_dir / variant), "--output_name", "bench",
            "--max_train_steps", str(args.steps), "--optimizer_type", "Adafactor", "--optimizer_args",
            "relative_step=False", "scale_parameter=False", "warmup_init=False", "--learning_rate", "1e-5",
            "--max_grad_norm", "1", "--grad_guard_preset", "minimal", "--save_model_as", "safetensors", "--cache_latents",
            *(["--gradient_checkpointing"] if args.gradient_checkpointing else []), *VARIANT_FLAGS[variant]]
    if variant == "fused_kept_third":  # a third of the fp32 gradients of the trained UNet
        from safetensors import safe_open
        with safe_open(paths["file"], "pt") as weights:
            unet_bytes = sum(4 * math.prod(weights.get_slice(key).get_shape())
                             for key in weights.keys() if key.startswith("model.diffusion_model."))
        argv += ["--fused_backward_kept_gradient_gib", f"{unet_bytes / 3 / 2**30:.6f}"]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    result = subprocess.run([sys.executable, __file__, "--child", *argv], cwd=REPO, env=env, capture_output=True,
                            text=True)
    line = next((line for line in result.stdout.splitlines() if line.startswith("RESULT ")), None)
    if result.returncode != 0 or line is None:
        raise SystemExit(f"{variant} failed:\n{(result.stdout + result.stderr)[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=96, help="channels of the UNet's first level (SDXL: 320)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--resolution", type=int, default=64)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--variants", nargs="+", default=list(VARIANT_FLAGS), choices=list(VARIANT_FLAGS))
    parser.add_argument("--work_dir", type=Path, default=Path(tempfile.gettempdir()) / "bench_fused_training")
    args = parser.parse_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    paths = build_model(args.work_dir, args.width)
    rows = {}
    with tempfile.TemporaryDirectory() as output_dir:
        for variant in args.variants:
            measured = run_variant(variant, paths, args, Path(output_dir))
            later_cpu, later_wall = measured["cpu_s"][1:] or measured["cpu_s"], measured["wall_s"][1:] or measured["wall_s"]
            rows[variant] = row = {
                "step_s": statistics.median(later_wall), "cpu_s": statistics.median(later_cpu),
                "peak_rss_gib": measured["peak_kib"] / 2**20,
                "step_add_gib": (measured["peak_kib"] - measured["start_rss_kib"]) / 2**20,
                "start_rss_gib": measured["start_rss_kib"] / 2**20, "params_m": measured["params_m"]}
            print(f"{variant:8s} " + " ".join(f"{key}={value:.3f}" for key, value in row.items()), flush=True)
    if "unfused" in rows:
        base = rows["unfused"]
        for variant, row in rows.items():
            if variant != "unfused":
                print(f"{variant}/unfused: peak_rss_ratio={row['peak_rss_gib'] / base['peak_rss_gib']:.3f} "
                      f"step_add_ratio={row['step_add_gib'] / base['step_add_gib']:.3f} "
                      f"cpu_time_ratio={row['cpu_s'] / base['cpu_s']:.3f} step_time_ratio={row['step_s'] / base['step_s']:.3f}")


if __name__ == "__main__":
    main()
