"""Full-size SDXL LoRA at 1024 px on a CUDA GPU: our trainer against a bare diffusers + peft loop and kohya's trainer.

    python benchmarks/bench_gpu_sdxl.py [--work_dir /tmp/bench_gpu_sdxl] [--steps 20] [--warmup 3]
                                        [--cases fp16_b1_gc,bf16_b4,...] [--compiled] [--json results.json]
                                        [--kohya_dir sd-scripts [--kohya_site DIR]] [--profile]
    python benchmarks/bench_gpu_sdxl.py --summary r1.json r2.json ... [--guard_json g.json] [--junit cuda.xml]

Builds once into ``--work_dir``: a full-size SDXL base single file with seeded random weights
(``bench_full_sdxl.build_model_file``, generated on the GPU), the CLIP tokenizers and a dataset of
eight 1024 px images. Every case is rank 16 / alpha 16, UNet-only LoRA (kohya's 722 modules),
cached latents and text-encoder outputs, AdamW at 1e-4, batch 1 or 4, with or without
``--gradient_checkpointing``. Each case runs up to three sides, each in a fresh process:

- ``ours``: ``sdxl_train_network.py`` (fp16 with ``--grad_guard_preset stable``, bf16, bf16 with
  ``--fp8_base``; ``fp16_noguard`` is fp16 without the guard, for the guard's overhead and the
  kohya comparison with the same flags; ``adamw8bit`` is bitsandbytes' AdamW8bit). ``--compiled``
  adds ``<case>_compiled`` for each case: ours with ``--torch_compile`` (the first steps, which
  compile, are among the warm-up steps);
- ``bare``: ``benchmarks/bare_loop.py`` (diffusers UNet + peft LoRA + autocast/GradScaler + AdamW,
  nothing else) on the same weights, for the cases that have such a twin;
- ``kohya`` (with ``--kohya_dir``): kohya-ss/sd-scripts' own ``sdxl_train_network.py`` from that
  folder, on the same file, dataset and tokenizers with the same flags (``--sdpa``: our default
  attention; kohya's default is its slow plain attention), for the cases without our guard. kohya's
  code is not part of this project: fetch it into an ignored folder (e.g. ``.gpu_assets/sd-scripts``).
  Its pinned packages that differ from ours (transformers 4.54.1, diffusers 0.32.1, ... see
  docs/gpu.md) go into ``--kohya_site``, which leads the kohya process's ``PYTHONPATH`` only.
  ``--kohya_prelude FILE`` runs a Python file in that process first (a CPU check's stand-ins).

Step time: median over ``--steps`` steps after ``--warmup`` steps, each step measured from one
step's start to the next (``torch.cuda.synchronize`` at both ends), so everything the loop does
between steps counts; a step starts when ours enters ``backward_window``, when the bare loop starts
an iteration, when kohya's UNet forward is called. VRAM: ``torch.cuda.max_memory_allocated`` during
the training steps (``train_gib``) and over the whole process (``run_gib``: loading, caching,
training). The last line is the machine-readable summary of docs/gpu.md; ``--summary`` prints it
from the JSON files of several calls (later files win per case and side), with the guard's figures
(``bench_grad_guard.py --json``) and the CUDA test count (``pytest --junitxml``). Needs a CUDA GPU;
``--allow_cpu`` runs the plumbing on a CPU at a small ``--resolution`` (figures meaningless). Not
run in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

RANK = 16
LEARNING_RATE = 1e-4
KOHYA_UNET_MODULES = 722
COMPILED = "_compiled"
STABLE = ("--grad_guard_preset", "stable")


@dataclass(frozen=True)
class Case:
    precision: str
    batch: int
    checkpointing: bool
    extra: tuple[str, ...] = ()  # our trainer's flags beyond the shared ones
    bare: bool = True  # has a bare-loop twin
    kohya: tuple[str, ...] | None = None  # kohya's flags beyond the shared ones; None: no kohya twin


CASES = {
    "fp16_b1_gc": Case("fp16", 1, True, STABLE),
    "fp16_noguard_b1_gc": Case("fp16", 1, True, bare=False, kohya=()),
    "fp8_b1_gc": Case("bf16", 1, True, ("--fp8_base",), bare=False, kohya=("--fp8_base",)),
    "bf16_b1_gc": Case("bf16", 1, True, kohya=()),
    "fp16_b4_gc": Case("fp16", 4, True, STABLE),
    "bf16_b4_gc": Case("bf16", 4, True, kohya=()),
    "fp16_b1": Case("fp16", 1, False, STABLE),
    "bf16_b1": Case("bf16", 1, False, kohya=()),
    "fp16_b4": Case("fp16", 4, False, STABLE),
    "bf16_b4": Case("bf16", 4, False, kohya=()),
    "fp8_b4_gc": Case("bf16", 4, True, ("--fp8_base",), bare=False, kohya=("--fp8_base",)),
    "adamw8bit_b1_gc": Case("fp16", 1, True, (*STABLE, "--optimizer_type", "AdamW8bit"), bare=False,
                            kohya=("--optimizer_type", "AdamW8bit")),
}


def case(name: str) -> Case:
    """A case of ``CASES``, or ``<case>_compiled``: ours only, with ``--torch_compile``."""
    if name.endswith(COMPILED) and name[:-len(COMPILED)] in CASES:
        base = CASES[name[:-len(COMPILED)]]
        return Case(base.precision, base.batch, base.checkpointing, (*base.extra, "--torch_compile"), False, None)
    return CASES[name]


# Step marks and memory in a child process: mark_step() at each step's start, report() at the end.
STEP_RECORDER = r"""
import json, time, torch
_cuda = torch.cuda.is_available()
_starts, _cpu_starts, _before_training = [], [], []

def mark_step():
    if _cuda:
        torch.cuda.synchronize()
        if not _starts:  # loading and caching are over: from here on the peak is the training's
            _before_training.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()
    _starts.append(time.perf_counter())
    _cpu_starts.append(time.process_time())

def report(**extra):
    mark_step()  # the end of the last step
    train_peak = torch.cuda.max_memory_allocated() if _cuda else 0
    print("BENCH_RESULT " + json.dumps(dict(  # no braces: the children's code is a str.format template
        step_s=[b - a for a, b in zip(_starts, _starts[1:])],
        cpu_s=[b - a for a, b in zip(_cpu_starts, _cpu_starts[1:])],
        train_bytes=train_peak, run_bytes=max([train_peak, *_before_training]), **extra)), flush=True)
"""

# Our trainer: step starts and the optional profile through the trainer's hooks.
OURS_CHILD = STEP_RECORDER + r"""
import sys
sys.path.insert(0, {repo!r})
import sdxl_train_network
trainer_class = sdxl_train_network.SdxlNetworkTrainer
losses, steps_started = [], [0]
original_window = trainer_class.backward_window
profile_step, profiler = {profile_step!r}, None

def backward_window(self, *args, **kwargs):
    global profiler
    mark_step()
    if profiler is not None:  # one whole step (start to next start) was recorded
        profiler.stop()
        print(profiler.key_averages().table(sort_by="self_cuda_time_total", row_limit=25), flush=True)
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        profiler = None
    if profile_step is not None and steps_started[0] == profile_step:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
        profiler.start()
    steps_started[0] += 1
    loss = original_window(self, *args, **kwargs)
    losses.append(loss)
    return loss

trainer_class.backward_window = backward_window
sdxl_train_network.main({argv!r})
report(first_loss=float(losses[0]))
"""

# The bare loop on our loader's weights.
BARE_CHILD = STEP_RECORDER + r"""
import sys
sys.path[:0] = [{repo!r}, {benchmarks!r}]
from bare_loop import BareLoop
from library.model_loading import load_models
device = torch.device("cuda" if _cuda else "cpu")
unet = load_models({model!r}, sdxl=True, device=device, tokenizer_cache_dir={tokenizers!r}).unet
loop = BareLoop(unet, {precision!r}, {batch}, {checkpointing}, {rank}, {learning_rate}, {resolution}, device)
assert loop.lora_modules == {modules}, loop.lora_modules
losses = []
for index in range({steps}):
    mark_step()
    losses.append(loop.step(index))
report(first_loss=float(losses[0]))
"""

# kohya's own script, run as __main__ with its folder first on the path (its `library` and
# `networks` packages shadow ours, which are not on the path); a step starts at its UNet's forward.
KOHYA_CHILD = STEP_RECORDER + r"""
import os, runpy, sys
sys.path.insert(0, {kohya_dir!r})
{prelude}
from library import sdxl_original_unet
unet_class = sdxl_original_unet.SdxlUNet2DConditionModel
original_forward = unet_class.forward

def forward(self, *args, **kwargs):
    mark_step()
    return original_forward(self, *args, **kwargs)

unet_class.forward = forward
script = os.path.join({kohya_dir!r}, "sdxl_train_network.py")
sys.argv = [script, *{argv!r}]
runpy.run_path(script, run_name="__main__")
report(first_loss=None)
"""


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
        build_model_file(paths["model"], device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        print(f"model file built in {time.perf_counter() - start:.0f} s", flush=True)
    if not (paths["tokenizers"] / "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k").is_dir():
        build_clip_tokenizers(paths["tokenizers"])
    if not paths["dataset"].is_dir():
        # 8 images x 40 repeats: no epoch boundary within a run at batch 4
        make_demo_dataset(str(paths["dataset"]), count=8, size=1024, repeats=40)
    return paths


def shared_flags(paths: dict[str, Path], output_dir: Path, settings: Case, resolution: int, steps: int) -> list[str]:
    """The flags ours and kohya's trainer share for a case."""
    return [
        "--pretrained_model_name_or_path", str(paths["model"]), "--tokenizer_cache_dir", str(paths["tokenizers"]),
        "--train_data_dir", str(paths["dataset"]), "--caption_extension", ".txt",
        "--resolution", str(resolution), "--train_batch_size", str(settings.batch),
        "--output_dir", str(output_dir), "--output_name", "bench_lora",
        "--mixed_precision", settings.precision, "--network_dim", str(RANK), "--network_alpha", str(RANK),
        "--network_train_unet_only", "--cache_latents", "--cache_text_encoder_outputs",
        "--optimizer_type", "AdamW", "--learning_rate", str(LEARNING_RATE), "--max_train_steps", str(steps),
        "--seed", "0", "--max_data_loader_n_workers", "0",
        *(["--gradient_checkpointing"] if settings.checkpointing else []),
    ]


def run_case(name: str, side: str, paths: dict[str, Path], options: argparse.Namespace, steps: int,
             profile_step: int | None = None) -> dict:
    """One side (ours, bare, kohya) of one case in a fresh process; its BENCH_RESULT figures."""
    settings = case(name)
    output_dir = Path(options.work_dir) / "out" / f"{name}_{side}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cwd = None
    if side == "bare":
        code = BARE_CHILD.format(repo=str(REPO), benchmarks=str(REPO / "benchmarks"), model=str(paths["model"]),
                                 tokenizers=str(paths["tokenizers"]), precision=settings.precision,
                                 batch=settings.batch, checkpointing=settings.checkpointing, rank=RANK,
                                 learning_rate=LEARNING_RATE, resolution=options.resolution,
                                 modules=KOHYA_UNET_MODULES, steps=steps)
    elif side == "kohya":
        argv = [*shared_flags(paths, output_dir, settings, options.resolution, steps), "--sdpa",
                "--network_module", "networks.lora", "--save_precision", "fp16", *settings.kohya]
        prelude = Path(options.kohya_prelude).read_text() if options.kohya_prelude else ""
        code = KOHYA_CHILD.format(kohya_dir=str(Path(options.kohya_dir).resolve()), prelude=prelude, argv=argv)
        if options.kohya_site:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(options.kohya_site).resolve()),
                                                              env.get("PYTHONPATH")]))
        cwd = options.kohya_dir
    else:
        argv = [*shared_flags(paths, output_dir, settings, options.resolution, steps), *settings.extra]
        code = OURS_CHILD.format(repo=str(REPO), argv=argv, profile_step=profile_step)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=cwd)
    if profile_step is not None:
        print("\n".join(line for line in result.stdout.splitlines() if not line.startswith("BENCH_RESULT")),
              flush=True)
    lines = [line for line in result.stdout.splitlines() if line.startswith("BENCH_RESULT ")]
    if result.returncode != 0 or not lines:
        print(result.stdout[-4000:], flush=True)
        return {"error": f"exit code {result.returncode}"}
    measured = json.loads(lines[-1].partition(" ")[2])
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


SIDES = ("ours", "bare", "kohya")


def print_row(name: str, results: dict) -> None:
    """One table line: each side's s/step and training GiB, the others' ratios to ours."""
    entries = results[name]
    cells = []
    for side in SIDES:
        entry = entries.get(side)
        if entry is None:
            cells.append(f"{'-':>9} {'-':>6}")
        elif "error" in entry:
            cells.append(f"{'failed':>9} {'-':>6}")
        else:
            cells.append(f"{entry['step_s']:>9.4f} {entry['train_gib']:>6.2f}")
    ours = entries.get("ours") or {}
    ratios = []
    for side in ("bare", "kohya"):
        other = entries.get(side) or {}
        ok = "step_s" in ours and "step_s" in other
        ratios.append(f"{ours['step_s'] / other['step_s']:>6.3f} {ours['train_gib'] / other['train_gib']:>6.3f}"
                      if ok and other["train_gib"] else f"{'-':>6} {'-':>6}")
    print(f"{name:<26} {' '.join(cells)}   {'   '.join(ratios)}", flush=True)


def summary_line(results: dict, guard: dict | None = None, cuda_tests: str | None = None) -> str:
    """docs/gpu.md's machine-readable last line from the cases' figures ('none' where one is missing)."""
    def figure(name: str, key: str, side: str = "ours") -> float | None:
        entry = results.get(name, {}).get(side)
        return entry.get(key) if entry and "error" not in entry else None

    def ratio(a: float | None, b: float | None) -> str:
        return f"{a / b:.3f}" if a is not None and b else "none"

    def value(x: float | None) -> str:
        return "none" if x is None else f"{x:.2f}"

    guarded, unguarded = figure("fp16_b1_gc", "step_s"), figure("fp16_noguard_b1_gc", "step_s")
    overhead = f"{(guarded / unguarded - 1) * 100:.2f}" if guarded and unguarded else "none"
    guard = guard or {}
    fields = {
        "gpu": str(results.get("device", "none")).replace(" ", "_"),
        "fp16_step_ratio": ratio(guarded, figure("fp16_b1_gc", "step_s", "bare")),
        "compiled_step_ratio": ratio(figure("fp16_b1_gc" + COMPILED, "step_s"), figure("fp16_b1_gc", "step_s", "bare")),
        "kohya_step_ratio": ratio(unguarded, figure("fp16_noguard_b1_gc", "step_s", "kohya")),
        "kohya_vram_ratio": ratio(figure("fp16_noguard_b1_gc", "train_gib"),
                                  figure("fp16_noguard_b1_gc", "train_gib", "kohya")),
        "fp16_vram_ratio": ratio(figure("fp16_b1_gc", "train_gib"), figure("fp16_b1_gc", "train_gib", "bare")),
        "fp16_vram_gib": value(figure("fp16_b1_gc", "run_gib")),
        "fp8_vram_gib": value(figure("fp8_b1_gc", "run_gib")),
        "norm_ratio": value(guard.get("norm_ratio")),
        "cosine_ratio": value(guard.get("cosine_ratio")),
        "loop_speedup": value(guard.get("loop_speedup")),
        "guard_overhead_pct": overhead,
        "cuda_tests": cuda_tests or "none",
        "fp8_step_ratio": ratio(figure("fp8_b1_gc", "step_s"), figure("bf16_b1_gc", "step_s")),
    }
    return " ".join(f"{key}={text}" for key, text in fields.items())


def merged_results(paths: list[str]) -> dict:
    """The case figures of several ``--json`` files, later files winning per case and side."""
    results: dict = {}
    for path in paths:
        for key, entry in json.loads(Path(path).read_text()).items():
            if isinstance(entry, dict):
                results.setdefault(key, {}).update({side: value for side, value in entry.items() if value is not None})
            else:
                results.setdefault(key, entry)
    return results


def junit_count(path: str) -> str:
    """``passed/total`` of a ``pytest --junitxml`` file, skipped tests left out (``--device cuda`` skips
    the tests that are not device-relevant)."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(suite.get(key, 0)) for suite in suites)
              for key in ("tests", "failures", "errors", "skipped")}
    total = counts["tests"] - counts["skipped"]
    return f"{total - counts['failures'] - counts['errors']}/{total}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work_dir", default="/tmp/bench_gpu_sdxl", help="cache of model, tokenizers, dataset")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per case (median). Default: 20")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first. Default: 3")
    parser.add_argument("--cases", default=",".join(CASES),
                        help=f"comma-separated, of: {', '.join(CASES)}, each also as <case>{COMPILED}")
    parser.add_argument("--compiled", action="store_true", help=f"also run <case>{COMPILED} for every case given")
    parser.add_argument("--json", help="also write every figure to this file (rewritten after each case)")
    parser.add_argument("--profile", action="store_true",
                        help="print torch.profiler tables (by CUDA and CPU time) of our first timed step")
    parser.add_argument("--tokenizers", type=Path,
                        help="a --tokenizer_cache_dir built by tools/build_clip_tokenizers.py (default: build one "
                             "into --work_dir, which downloads the open_clip wheel)")
    parser.add_argument("--kohya_dir", help="a kohya-ss/sd-scripts checkout: adds kohya's own trainer as a side")
    parser.add_argument("--kohya_site", help="folder of kohya's pinned packages, first on its PYTHONPATH")
    parser.add_argument("--kohya_prelude", help="Python file run in the kohya process before its script")
    parser.add_argument("--resolution", type=int, default=1024, help="training resolution (default 1024)")
    parser.add_argument("--allow_cpu", action="store_true", help="run without CUDA (a plumbing check)")
    parser.add_argument("--summary", nargs="+", metavar="JSON",
                        help="only print the summary line from these --json files of earlier calls")
    parser.add_argument("--guard_json", help="bench_grad_guard.py --json output, for the summary line")
    parser.add_argument("--junit", help="pytest --device cuda --junitxml output, for the summary line")
    args = parser.parse_args()
    guard = json.loads(Path(args.guard_json).read_text()) if args.guard_json else None
    cuda_tests = junit_count(args.junit) if args.junit else None
    if args.summary:
        print(summary_line(merged_results(args.summary), guard, cuda_tests))
        return
    import torch

    if not torch.cuda.is_available() and not args.allow_cpu:
        sys.exit("bench_gpu_sdxl.py needs a CUDA GPU")
    names = args.cases.split(",")
    unknown = [name for name in names if name.removesuffix(COMPILED) not in CASES]
    if unknown:
        parser.error(f"--cases: unknown {unknown}; valid: {', '.join(CASES)} (each also with {COMPILED})")
    if args.compiled:
        names += [name + COMPILED for name in names if not name.endswith(COMPILED)]
    paths = prepare(Path(args.work_dir), args.tokenizers)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    results: dict = {"device": device, "date": time.strftime("%Y-%m-%d")}
    total = args.warmup + args.steps
    print(f"{'case':<26} {'ours s/step GiB':>16} {'bare s/step GiB':>16} {'kohya s/step GiB':>16}   "
          f"{'ours/bare step vram':>20}   {'ours/kohya step vram':>20}", flush=True)
    for name in names:
        settings = case(name)
        sides = ["ours", *(["bare"] if settings.bare else []),
                 *(["kohya"] if settings.kohya is not None and args.kohya_dir else [])]
        results[name] = {}
        for side in sides:
            profile_step = args.warmup if args.profile and side == "ours" else None
            results[name][side] = summarise(run_case(name, side, paths, args, total, profile_step), args.warmup)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
        print_row(name, results)
    print(summary_line(results, guard, cuda_tests))


if __name__ == "__main__":
    main()
