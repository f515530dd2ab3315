"""Full-size SDXL LoRA training on this machine: model load, step time and peak memory.

    python benchmarks/bench_full_sdxl.py [--work_dir /tmp/bench_full_sdxl] [--steps 4] [--resolution 256]
                                         [--mixed_precision no|fp16|bf16] [--fp8_base]

Builds once into ``--work_dir`` (kept across runs): a full-size SDXL base single file with
random weights (fp16, original layout, architecture from ``library/model_configs/sdxl_base``,
init scaled so a forward pass is finite), the real CLIP tokenizers
(``tools/build_clip_tokenizers.py``) and a 4-image dataset (``tools/make_demo_dataset.py``).
Then trains with ``sdxl_train_network.py`` in a fresh process: batch 1, ``--mixed_precision no``
(default; ``bf16`` with ``--fp8_base``), rank 4 UNet-only LoRA, cached latents and text encoder
outputs, gradient checkpointing, AdamW.

The child samples ``RssAnon``/``RssFile`` of ``/proc/self/status`` in a background thread and
reads ``VmHWM`` (the kernel's peak of the total) at the end. The saved LoRA is checked against
kohya's module set (722 UNet modules, names and shapes) and for finite values. The last line is
``load_s=.. first_step_s=.. step_s=.. peak_rss_gib=.. first_loss=.. unet_modules=..``.

Each run's figures are kept in ``<work_dir>/result_<mixed precision>[_fp8].json``; a ``--fp8_base``
run then compares itself with the stored runs without it (same file, seed and data): peak RSS,
first-step loss (the loss before any update, so it compares the forward passes) and step time;
its last line adds ``fp8_step_ratio=<fp8 / the same --mixed_precision without fp8>`` (target
<= 1.5 on a CPU) and the same ratio of CPU seconds per step (``fp8_cpu_step_ratio``, which load
from other processes on a shared machine does not inflate). Run the variants one after the other,
never two at once (each needs most of a 24 GiB machine). Not run in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SEED = 20240
KOHYA_UNET_MODULES = 722  # UNet-only LoRA, default targets (Linear/1x1 of the transformer blocks)
# (module, lora_down shape) samples of kohya's SDXL LoRA at rank 4.
EXPECTED_SHAPES = {
    "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q": [4, 640],
    "lora_unet_input_blocks_4_1_proj_in": [4, 640],
    "lora_unet_input_blocks_7_1_transformer_blocks_9_ff_net_2": [4, 5120],
    "lora_unet_middle_block_1_transformer_blocks_0_attn2_to_k": [4, 2048],
    "lora_unet_output_blocks_0_1_transformer_blocks_9_attn2_to_out_0": [4, 1280],
    "lora_unet_output_blocks_5_1_proj_out": [4, 640],
}
# Layers whose output is added to a residual stream: damped so deep random stacks stay in range.
RESIDUAL_OUTPUTS = ("out_layers.3.weight", "to_out.0.weight", "ff.net.2.weight", "proj_out.weight",
                    "out_proj.weight", "mlp.c_proj.weight", "mlp.fc2.weight", "conv2.weight")

# The training process: phase timings via the trainer's hooks, memory sampled in a thread.
CHILD = r"""
import json, os, statistics, sys, threading, time
sys.path.insert(0, {repo!r})

def status():
    values = {{}}
    with open("/proc/self/status") as file:
        for line in file:
            key, _, rest = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmHWM", "VmRSS"):
                values[key] = int(rest.split()[0]) * 1024
    return values

peaks = {{"RssAnon": 0, "RssFile": 0, "anon_plus_file": 0}}
phase = ["start"]
phase_peaks = {{}}
stop = threading.Event()

def sample():
    while True:
        values = status()
        total = values["RssAnon"] + values["RssFile"]
        for key, value in (("RssAnon", values["RssAnon"]), ("RssFile", values["RssFile"]), ("anon_plus_file", total)):
            peaks[key] = max(peaks[key], value)
        phase_peaks[phase[0]] = max(phase_peaks.get(phase[0], 0), total)
        if stop.wait(0.05):
            return

threading.Thread(target=sample, daemon=True).start()
import sdxl_train_network
trainer_class = sdxl_train_network.SdxlNetworkTrainer
marks = {{"step_start": [], "step_end": [], "cpu_start": [], "cpu_end": [], "sys_start": [], "sys_end": [],
         "losses": []}}
original_load, original_window = trainer_class.load_models, trainer_class.backward_window
original_step, original_network = trainer_class.optimizer_step, trainer_class.create_network

def load_models(self, args):
    phase[0] = "load"
    start = time.perf_counter()
    models = original_load(self, args)
    marks["load_s"] = time.perf_counter() - start
    phase[0] = "network+cache"
    return models

def backward_window(self, *args, **kwargs):
    phase[0] = "train"
    if len(marks["step_start"]) == len(marks["step_end"]):
        marks["step_start"].append(time.perf_counter())
        marks["cpu_start"].append(time.process_time())
        marks["sys_start"].append(os.times().system)
    loss = original_window(self, *args, **kwargs)
    marks["losses"].append(float(loss))
    return loss

def optimizer_step(self, *args, **kwargs):
    result = original_step(self, *args, **kwargs)
    marks["step_end"].append(time.perf_counter())
    marks["cpu_end"].append(time.process_time())
    marks["sys_end"].append(os.times().system)
    return result

trainer_class.load_models, trainer_class.backward_window = load_models, backward_window
trainer_class.optimizer_step = optimizer_step
sdxl_train_network.main({argv!r})
stop.set()
final = status()
steps = [end - start for start, end in zip(marks["step_start"], marks["step_end"])]
cpu_steps = [end - start for start, end in zip(marks["cpu_start"], marks["cpu_end"])]
sys_steps = [end - start for start, end in zip(marks["sys_start"], marks["sys_end"])]
print("BENCH_RESULT " + json.dumps({{
    "load_s": marks["load_s"], "steps_s": steps, "losses": marks["losses"], "cpu_steps_s": cpu_steps,
    "sys_steps_s": sys_steps, "vm_hwm": final["VmHWM"], "peaks": peaks,
    "phase_peaks": phase_peaks,
}}), flush=True)
"""


def _init_std(key: str, shape: tuple[int, ...]) -> float | None:
    """Standard deviation of a random tensor, or None for norm weights (1) and biases (0)."""
    if len(shape) < 2:
        return None
    if "embedding" in key:  # token / position embeddings (CLIP init)
        return 0.02
    if key.endswith("text_projection"):  # OpenCLIP stores it [width, projection]
        return shape[0] ** -0.5
    fan_in = 1
    for size in shape[1:]:
        fan_in *= size
    std = fan_in ** -0.5
    return std * 0.3 if key.endswith(RESIDUAL_OUTPUTS) else std


def build_model_file(path: Path, device: torch.device | None = None, kind: str = "sdxl",
                     perturb: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> None:
    """Write a full-size base single file of ``kind`` (sdxl, sd1; fp16, original layout) with seeded random
    weights; ``perturb(key, weight)`` (float32) returns the weight to write instead (a "tuned" model).

    Streamed: the header comes from the meta models' shapes, then each tensor is generated and
    written in turn, so memory stays at one tensor. ``device``: where the random numbers are drawn
    (a GPU draws them in seconds; its stream differs from the CPU's, so the weights do too).
    """
    import torch

    from library import checkpoint_keys as ck
    from library.model_loading import build_empty_models, shipped_config_dir

    unet, vae, text_encoders, _ = build_empty_models(kind, shipped_config_dir(kind), with_vae=True)
    entries: list[tuple[str, tuple[int, ...]]] = []
    for model, key_map in ck.checkpoint_key_maps(kind, unet, vae, text_encoders).values():
        state = model.state_dict()
        for rule in key_map.rules:
            entries.append((rule.original, tuple(rule.to_original([state[n] for n in rule.diffusers]).shape)))
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, shape in entries:
        size = 2
        for dim in shape:
            size *= dim
        header[key] = {"dtype": "F16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    temporary = path.with_name(path.name + ".partial")
    device = device or torch.device("cpu")
    generator = torch.Generator(device).manual_seed(SEED)
    with open(temporary, "wb") as file:
        file.write(len(header_bytes).to_bytes(8, "little"))
        file.write(header_bytes)
        for key, shape in entries:
            std = _init_std(key, shape)
            if std is not None:
                tensor = torch.randn(shape, generator=generator, device=device).mul_(std)
            elif key.endswith("bias") or "logit_scale" in key:
                tensor = torch.zeros(shape)
            else:
                tensor = torch.ones(shape)
            if perturb is not None:
                tensor = perturb(key, tensor.cpu())
            file.write(tensor.to(torch.float16).cpu().contiguous().view(torch.uint8).numpy().tobytes())
    os.replace(temporary, path)
    print(f"built {path} ({len(entries)} tensors, {offset / 2**30:.2f} GiB)", flush=True)


def prepare(work_dir: Path) -> dict[str, Path]:
    from tools.build_clip_tokenizers import build_clip_tokenizers
    from tools.make_demo_dataset import make_demo_dataset

    work_dir.mkdir(parents=True, exist_ok=True)
    paths = {"model": work_dir / "sdxl_base_random_fp16.safetensors", "tokenizers": work_dir / "tokenizers",
             "dataset": work_dir / "dataset"}
    if not paths["model"].is_file():
        start = time.perf_counter()
        build_model_file(paths["model"])
        print(f"model file built in {time.perf_counter() - start:.0f} s", flush=True)
    if not (paths["tokenizers"] / "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k").is_dir():
        build_clip_tokenizers(paths["tokenizers"])
    if not paths["dataset"].is_dir():
        make_demo_dataset(str(paths["dataset"]), count=4, size=256)
    return paths


def check_lora(path: Path) -> int:
    """Assert the LoRA has kohya's UNet module set (count, sample names and shapes) and is finite."""
    import torch
    from safetensors.torch import load_file

    state = load_file(str(path))
    modules = {key.partition(".")[0] for key in state}
    unet_modules = sorted(m for m in modules if m.startswith("lora_unet_"))
    assert len(unet_modules) == len(modules), f"non-UNet modules in a UNet-only LoRA: {sorted(modules - set(unet_modules))[:3]}"
    assert len(unet_modules) == KOHYA_UNET_MODULES, f"{len(unet_modules)} UNet modules, kohya has {KOHYA_UNET_MODULES}"
    for name, down_shape in EXPECTED_SHAPES.items():
        assert list(state[f"{name}.lora_down.weight"].shape) == down_shape, (name, state[f"{name}.lora_down.weight"].shape)
        assert state[f"{name}.lora_up.weight"].shape[1] == 4, name
    for key, value in state.items():
        assert torch.isfinite(value.float()).all(), f"{key} is not finite"
    return len(unet_modules)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work_dir", default="/tmp/bench_full_sdxl", help="cache of model, tokenizers, dataset")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps (default 4; steady = median of 2..)")
    parser.add_argument("--resolution", type=int, default=256, help="training resolution in pixels (default 256)")
    parser.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default=None,
                        help="the trainer's --mixed_precision (default no; bf16 with --fp8_base)")
    parser.add_argument("--fp8_base", action="store_true",
                        help="train with --fp8_base (float8 UNet weights) and compare with the stored runs without it")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more trainer flags (after everything)")
    args = parser.parse_args()
    mixed_precision = args.mixed_precision or ("bf16" if args.fp8_base else "no")
    if args.fp8_base and mixed_precision == "no":
        parser.error("--fp8_base needs --mixed_precision fp16 or bf16")
    paths = prepare(Path(args.work_dir))
    out_dir = Path(args.work_dir) / "out"
    argv = [
        "--pretrained_model_name_or_path", str(paths["model"]), "--tokenizer_cache_dir", str(paths["tokenizers"]),
        "--train_data_dir", str(paths["dataset"]), "--caption_extension", ".txt",
        "--resolution", str(args.resolution), "--train_batch_size", "1",
        "--output_dir", str(out_dir), "--output_name", "bench_lora",
        "--mixed_precision", mixed_precision, *(["--fp8_base"] if args.fp8_base else []),
        "--network_dim", "4", "--network_alpha", "4", "--network_train_unet_only",
        "--cache_latents", "--cache_text_encoder_outputs", "--gradient_checkpointing",
        "--optimizer_type", "AdamW", "--learning_rate", "1e-4", "--max_train_steps", str(args.steps),
        "--seed", "0", "--max_data_loader_n_workers", "0", *args.extra,
    ]
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", CHILD.format(repo=str(REPO), argv=argv)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if result.returncode != 0:
        sys.exit(f"training failed with exit code {result.returncode}:\n{result.stdout[-3000:]}")
    total_s = time.perf_counter() - start
    line = next(l for l in result.stdout.splitlines() if l.startswith("BENCH_RESULT "))
    measured = json.loads(line.partition(" ")[2])
    steps = measured["steps_s"]
    gib = 2**30
    peaks = measured["peaks"]
    print(f"process total {total_s:.0f} s; per-step seconds {[round(s, 2) for s in steps]}; per-step CPU "
          f"seconds (all threads; other load on the machine does not inflate them) "
          f"{[round(s, 2) for s in measured['cpu_steps_s']]}, of which kernel (page faults, reclaim) "
          f"{[round(s, 2) for s in measured['sys_steps_s']]}")
    print(f"peak RssAnon {peaks['RssAnon'] / gib:.2f} GiB, peak RssFile {peaks['RssFile'] / gib:.2f} GiB, "
          f"peak sampled anon+file {peaks['anon_plus_file'] / gib:.2f} GiB, VmHWM {measured['vm_hwm'] / gib:.2f} GiB")
    print("peak anon+file by phase (GiB): "
          + ", ".join(f"{name} {value / gib:.2f}" for name, value in measured["phase_peaks"].items()))
    unet_modules = check_lora(out_dir / "bench_lora.safetensors")
    steady = statistics.median(steps[1:]) if len(steps) > 1 else float("nan")
    cpu_steady = statistics.median(measured["cpu_steps_s"][1:]) if len(steps) > 1 else float("nan")
    summary = {"load_s": measured["load_s"], "first_step_s": steps[0], "step_s": steady, "cpu_step_s": cpu_steady,
               "peak_rss_gib": measured["vm_hwm"] / gib, "first_loss": measured["losses"][0]}
    variant = mixed_precision + ("_fp8" if args.fp8_base else "")
    (Path(args.work_dir) / f"result_{variant}.json").write_text(json.dumps({**summary, "args": sys.argv[1:]}))
    ratio = ""
    if args.fp8_base:
        compare_with_runs_without_fp8(Path(args.work_dir), summary)
        plain_path = Path(args.work_dir) / f"result_{mixed_precision}.json"
        plain = json.loads(plain_path.read_text()) if plain_path.is_file() else {}
        for key, name in (("step_s", "fp8_step_ratio"), ("cpu_step_s", "fp8_cpu_step_ratio")):
            ratio += f" {name}={summary[key] / plain[key]:.3f}" if key in plain else f" {name}=none"
    print(f"load_s={summary['load_s']:.1f} first_step_s={steps[0]:.1f} step_s={steady:.2f} "
          f"peak_rss_gib={summary['peak_rss_gib']:.2f} first_loss={summary['first_loss']:.6f} "
          f"unet_modules={unet_modules}{ratio}")


def compare_with_runs_without_fp8(work_dir: Path, fp8: dict) -> None:
    """One line per stored run without --fp8_base: peak RSS saved and first-step loss difference."""
    stored = [(precision, work_dir / f"result_{precision}.json") for precision in ("no", "fp16", "bf16")]
    stored = [(precision, path) for precision, path in stored if path.is_file()]
    if not stored:
        print("no stored run without --fp8_base to compare with: run this script without it first")
    for precision, path in stored:
        plain = json.loads(path.read_text())
        relative = (fp8["first_loss"] - plain["first_loss"]) / plain["first_loss"]
        print(f"vs --mixed_precision {precision} without fp8: peak_rss_gib {plain['peak_rss_gib']:.2f} -> "
              f"{fp8['peak_rss_gib']:.2f} ({fp8['peak_rss_gib'] - plain['peak_rss_gib']:+.2f}); first_loss "
              f"{plain['first_loss']:.6f} -> {fp8['first_loss']:.6f} (rel diff {relative:+.3%}); step_s "
              f"{plain['step_s']:.2f} -> {fp8['step_s']:.2f} ({fp8['step_s'] / plain['step_s']:.3f}x)")


if __name__ == "__main__":
    main()
