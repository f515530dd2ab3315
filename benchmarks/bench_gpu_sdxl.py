"""Full-size SDXL LoRA at 1024 px on a CUDA GPU: our trainer against a bare diffusers + peft loop.

    python benchmarks/bench_gpu_sdxl.py [--work_dir /tmp/bench_gpu_sdxl] [--steps 20] [--warmup 3]
                                        [--cases fp16_b1_gc,bf16_b4,...] [--json results.json]

Builds once into ``--work_dir``: a full-size SDXL base single file with seeded random weights
(``bench_full_sdxl.build_model_file``, generated on the GPU), the CLIP tokenizers and a dataset of
eight 1024 px images. Every case is rank 16 / alpha 16, UNet-only LoRA (kohya's 722 modules),
cached latents and text-encoder outputs, AdamW at 1e-4, batch 1 or 4, with or without
``--gradient_checkpointing``:

- ``ours``: ``sdxl_train_network.py`` in a fresh process (fp16 with ``--grad_guard_preset
  stable``, bf16, bf16 with ``--fp8_base``; ``fp16_noguard`` is fp16 without the guard, for the
  guard's overhead);
- ``bare``: in the same kind of fresh process, the same diffusers UNet (same weights, read with
  our loader and then left alone), peft LoRA on the same 722 Linear/1x1 layers at the same rank,
  ``torch.autocast`` + ``torch.amp.GradScaler`` (fp16), AdamW, the same DDPM noising and MSE loss
  on random latents and text embeddings of the trainer's shapes, and nothing else.

Step time: median over ``--steps`` steps after ``--warmup`` steps, each step measured from one
step's start to the next (``torch.cuda.synchronize`` at both ends), so everything the loop does
between steps counts. VRAM: ``torch.cuda.max_memory_allocated`` during the training steps
(``train_gib``) and over the whole process (``run_gib``: loading, caching, training). The last
line: ``fp16_step_ratio=.. fp16_vram_ratio=.. fp16_vram_gib=.. fp8_vram_gib=.. guard_overhead_pct=..``
(fp16 = fp16 + checkpointing, batch 1). Needs a CUDA GPU; not run in CI.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

RANK = 16
LEARNING_RATE = 1e-4
RESOLUTION = 1024
# The Linear / 1x1 layers kohya's LoRA wraps inside SDXL's Transformer2DModels (722 of them).
LORA_TARGETS = (r".*attentions\.\d+\.(proj_in|proj_out|transformer_blocks\.\d+\."
                r"(attn1\.to_q|attn1\.to_k|attn1\.to_v|attn1\.to_out\.0|attn2\.to_q|attn2\.to_k|attn2\.to_v|"
                r"attn2\.to_out\.0|ff\.net\.0\.proj|ff\.net\.2))")
KOHYA_UNET_MODULES = 722

# case name -> (mixed precision, batch, gradient checkpointing, extra trainer flags, has a bare twin)
CASES = {
    "fp16_b1_gc": ("fp16", 1, True, ["--grad_guard_preset", "stable"], True),
    "fp16_noguard_b1_gc": ("fp16", 1, True, [], False),
    "fp8_b1_gc": ("bf16", 1, True, ["--fp8_base"], False),
    "bf16_b1_gc": ("bf16", 1, True, [], True),
    "fp16_b4_gc": ("fp16", 4, True, ["--grad_guard_preset", "stable"], True),
    "bf16_b4_gc": ("bf16", 4, True, [], True),
    "fp16_b1": ("fp16", 1, False, ["--grad_guard_preset", "stable"], True),
    "bf16_b1": ("bf16", 1, False, [], True),
    "fp16_b4": ("fp16", 4, False, ["--grad_guard_preset", "stable"], True),
    "bf16_b4": ("bf16", 4, False, [], True),
    "fp8_b4_gc": ("bf16", 4, True, ["--fp8_base"], False),
}

# Our trainer in a child process: step boundaries and memory read through the trainer's hooks.
OURS_CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, {repo!r})
import sdxl_train_network
trainer_class = sdxl_train_network.SdxlNetworkTrainer
starts, cpu_starts, losses, before_training = [], [], [], []
original_window = trainer_class.backward_window
profile_step, profiler = {profile_step!r}, None

def backward_window(self, *args, **kwargs):
    global profiler
    torch.cuda.synchronize()
    if not starts:  # loading and caching are over: from here on the peak is the training's
        before_training.append(torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
    if profiler is not None:  # one whole step (start to next start) was recorded
        profiler.stop()
        print(profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=25), flush=True)
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        profiler = None
    if profile_step is not None and len(starts) == profile_step:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
        profiler.start()
    starts.append(time.perf_counter())
    cpu_starts.append(time.process_time())
    loss = original_window(self, *args, **kwargs)
    losses.append(loss)
    return loss

trainer_class.backward_window = backward_window
sdxl_train_network.main({argv!r})
torch.cuda.synchronize()
starts.append(time.perf_counter())
cpu_starts.append(time.process_time())
train_peak = torch.cuda.max_memory_allocated()
print("BENCH_RESULT " + json.dumps({{
    "step_s": [b - a for a, b in zip(starts, starts[1:])], "first_loss": float(losses[0]),
    "cpu_s": [b - a for a, b in zip(cpu_starts, cpu_starts[1:])],
    "train_bytes": train_peak, "run_bytes": max(train_peak, before_training[0]),
}}), flush=True)
"""


def bare_loop(model_path: Path, tokenizers: Path, precision: str, batch: int, checkpointing: bool,
              steps: int) -> dict:
    """The reference: diffusers UNet + peft LoRA + autocast (+ GradScaler), AdamW, nothing else."""
    import torch
    from diffusers import DDPMScheduler
    from peft import LoraConfig

    from library.model_loading import load_models

    device = torch.device("cuda")
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    unet = load_models(model_path, sdxl=True, device=device, tokenizer_cache_dir=tokenizers).unet  # our runs' weights
    unet.requires_grad_(False)
    unet.to(dtype)
    unet.add_adapter(LoraConfig(r=RANK, lora_alpha=RANK, init_lora_weights="gaussian", target_modules=LORA_TARGETS))
    lora_modules = {name.rpartition(".lora_A")[0] for name, _ in unet.named_parameters() if ".lora_A" in name}
    assert len(lora_modules) == KOHYA_UNET_MODULES, len(lora_modules)
    parameters = [p for p in unet.parameters() if p.requires_grad]
    for parameter in parameters:  # trainable weights in float32, as kohya's (and ours) are
        parameter.data = parameter.data.float()
    if checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    optimizer = torch.optim.AdamW(parameters, lr=LEARNING_RATE)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    scheduler = DDPMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                              num_train_timesteps=1000, clip_sample=False)
    generator = torch.Generator(device).manual_seed(0)
    latent = RESOLUTION // 8
    latents = torch.randn(8, 4, latent, latent, device=device, generator=generator) * 0.13025
    context = torch.randn(8, 77, 2048, device=device, generator=generator)
    pooled = torch.randn(8, 1280, device=device, generator=generator)
    time_ids = torch.tensor([[RESOLUTION, RESOLUTION, 0, 0, RESOLUTION, RESOLUTION]] * batch, device=device,
                            dtype=torch.float32)
    torch.cuda.synchronize()
    before_training = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    starts, cpu_starts, first_loss = [], [], None
    for step in range(steps + 1):
        torch.cuda.synchronize()
        starts.append(time.perf_counter())
        cpu_starts.append(time.process_time())
        if step == steps:
            break
        index = torch.arange(step * batch, (step + 1) * batch, device=device) % 8
        clean = latents[index]
        noise = torch.randn_like(clean)
        timesteps = torch.randint(0, 1000, (batch,), device=device)
        noisy = scheduler.add_noise(clean, noise, timesteps)
        with torch.autocast("cuda", dtype=dtype):
            prediction = unet(noisy, timesteps, context[index],
                              added_cond_kwargs={"text_embeds": pooled[index], "time_ids": time_ids}).sample
        loss = torch.nn.functional.mse_loss(prediction.float(), noise.float())
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if first_loss is None:
            first_loss = loss.item()
    train_peak = torch.cuda.max_memory_allocated()
    return {"step_s": [b - a for a, b in zip(starts, starts[1:])], "first_loss": first_loss,
            "cpu_s": [b - a for a, b in zip(cpu_starts, cpu_starts[1:])],
            "train_bytes": train_peak, "run_bytes": max(train_peak, before_training)}


def prepare(work_dir: Path, tokenizers: Path | None) -> dict[str, Path]:
    import torch
    from bench_full_sdxl import build_model_file

    from tools.build_clip_tokenizers import build_clip_tokenizers
    from tools.make_demo_dataset import make_demo_dataset

    work_dir.mkdir(parents=True, exist_ok=True)
    paths = {"model": work_dir / "sdxl_base_random_fp16.safetensors",
             "tokenizers": tokenizers or work_dir / "tokenizers", "dataset": work_dir / "dataset"}
    if not paths["model"].is_file():
        start = time.perf_counter()
        build_model_file(paths["model"], device=torch.device("cuda"))
        print(f"model file built in {time.perf_counter() - start:.0f} s", flush=True)
    if not (paths["tokenizers"] / "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k").is_dir():
        build_clip_tokenizers(paths["tokenizers"])
    if not paths["dataset"].is_dir():
        # 8 images x 40 repeats: no epoch boundary within a run at batch 4
        make_demo_dataset(str(paths["dataset"]), count=8, size=RESOLUTION, repeats=40)
    return paths


def run_case(name: str, paths: dict[str, Path], work_dir: Path, steps: int, bare: bool,
             profile_step: int | None = None) -> dict:
    precision, batch, checkpointing, extra, _ = CASES[name]
    if bare:
        code = (f"import json, sys; sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'benchmarks')!r}]\n"
                f"from bench_gpu_sdxl import bare_loop\n"
                f"print('BENCH_RESULT ' + json.dumps(bare_loop({str(paths['model'])!r}, {str(paths['tokenizers'])!r}, "
                f"{precision!r}, {batch}, "
                f"{checkpointing}, {steps})), flush=True)\n")
    else:
        argv = [
            "--pretrained_model_name_or_path", str(paths["model"]), "--tokenizer_cache_dir", str(paths["tokenizers"]),
            "--train_data_dir", str(paths["dataset"]), "--caption_extension", ".txt",
            "--resolution", str(RESOLUTION), "--train_batch_size", str(batch),
            "--output_dir", str(work_dir / "out" / name), "--output_name", "bench_lora",
            "--mixed_precision", precision, "--network_dim", str(RANK), "--network_alpha", str(RANK),
            "--network_train_unet_only", "--cache_latents", "--cache_text_encoder_outputs",
            "--optimizer_type", "AdamW", "--learning_rate", str(LEARNING_RATE), "--max_train_steps", str(steps),
            "--seed", "0", "--max_data_loader_n_workers", "0",
            *(["--gradient_checkpointing"] if checkpointing else []), *extra,
        ]
        code = OURS_CHILD.format(repo=str(REPO), argv=argv, profile_step=profile_step)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if profile_step is not None:
        print("\n".join(line for line in result.stdout.splitlines() if not line.startswith("BENCH_RESULT")),
              flush=True)
    if result.returncode != 0:
        print(result.stdout[-4000:], flush=True)
        return {"error": f"exit code {result.returncode}"}
    line = next(line for line in result.stdout.splitlines() if line.startswith("BENCH_RESULT "))
    measured = json.loads(line.partition(" ")[2])
    measured["process_s"] = time.perf_counter() - start
    return measured


def summarise(measured: dict, warmup: int) -> dict:
    if "error" in measured:
        return measured
    steady = measured["step_s"][warmup:]
    gib = 2**30
    return {"step_s": statistics.median(steady), "cpu_s": statistics.median(measured["cpu_s"][warmup:]),
            "steps": len(steady), "train_gib": measured["train_bytes"] / gib,
            "run_gib": measured["run_bytes"] / gib, "first_loss": measured["first_loss"],
            "process_s": measured["process_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work_dir", default="/tmp/bench_gpu_sdxl", help="cache of model, tokenizers, dataset")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per case (median). Default: 20")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first. Default: 3")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--json", help="also write every figure to this file (rewritten after each case)")
    parser.add_argument("--profile", action="store_true",
                        help="print torch.profiler tables (by CUDA and CPU time) of our first timed step")
    parser.add_argument("--tokenizers", type=Path,
                        help="a --tokenizer_cache_dir built by tools/build_clip_tokenizers.py (default: build one "
                             "into --work_dir, which downloads the open_clip wheel)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_gpu_sdxl.py needs a CUDA GPU")
    names = args.cases.split(",")
    unknown = [name for name in names if name not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; valid: {', '.join(CASES)}")
    work_dir = Path(args.work_dir)
    paths = prepare(work_dir, args.tokenizers)
    results: dict[str, dict] = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
    total = args.warmup + args.steps
    print(f"{'case':<20} {'ours s/step':>11} {'bare s/step':>11} {'ratio':>6} {'ours GiB':>8} {'bare GiB':>8} "
          f"{'ratio':>6} {'ours run GiB':>12}", flush=True)
    for name in names:
        ours = summarise(run_case(name, paths, work_dir, total, bare=False,
                                  profile_step=args.warmup if args.profile else None), args.warmup)
        bare = summarise(run_case(name, paths, work_dir, total, bare=True), args.warmup) if CASES[name][4] else None
        results[name] = {"ours": ours, "bare": bare}
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        if "error" in ours or (bare and "error" in bare):
            print(f"{name:<20} failed: ours {ours.get('error', 'ok')}, bare {bare and bare.get('error', 'ok')}",
                  flush=True)
            continue
        if bare:
            print(f"{name:<20} {ours['step_s']:>11.4f} {bare['step_s']:>11.4f} {ours['step_s'] / bare['step_s']:>6.3f} "
                  f"{ours['train_gib']:>8.2f} {bare['train_gib']:>8.2f} {ours['train_gib'] / bare['train_gib']:>6.3f} "
                  f"{ours['run_gib']:>12.2f}", flush=True)
        else:
            print(f"{name:<20} {ours['step_s']:>11.4f} {'-':>11} {'-':>6} {ours['train_gib']:>8.2f} {'-':>8} {'-':>6} "
                  f"{ours['run_gib']:>12.2f}", flush=True)

    def figure(case: str, key: str, side: str = "ours") -> float | None:
        entry = results.get(case, {}).get(side)
        return entry.get(key) if entry and "error" not in entry else None

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.3f}" if a is not None and b else "none"

    guarded, unguarded = figure("fp16_b1_gc", "step_s"), figure("fp16_noguard_b1_gc", "step_s")
    overhead = f"{(guarded / unguarded - 1) * 100:.2f}" if guarded and unguarded else "none"
    fp16_gib, fp8_gib = figure("fp16_b1_gc", "run_gib"), figure("fp8_b1_gc", "run_gib")
    print(f"fp16_step_ratio={ratio(guarded, figure('fp16_b1_gc', 'step_s', 'bare'))} "
          f"fp16_vram_ratio={ratio(figure('fp16_b1_gc', 'train_gib'), figure('fp16_b1_gc', 'train_gib', 'bare'))} "
          f"fp16_vram_gib={'none' if fp16_gib is None else f'{fp16_gib:.2f}'} "
          f"fp8_vram_gib={'none' if fp8_gib is None else f'{fp8_gib:.2f}'} guard_overhead_pct={overhead}")


if __name__ == "__main__":
    main()
