"""Every network type the kohya_ss GUI offers (16) on the tiny SDXL: seconds per training step relative to
networks.lora, or (``--stable_preset``) whether each trains under ``--grad_guard_preset stable`` in fp16 and bf16.

    python benchmarks/bench_network_types.py [--rank 8] [--latent 8] [--rounds 5] [--steps 4]
    python benchmarks/bench_network_types.py --stable_preset [--steps 4]

Timing: one step = both text encoders and the UNet forward with the network applied (text encoder and
UNet modules, 3x3 convs where the type has them), MSE loss, backward, AdamW step, in float32 on one
thread. The types take turns (``--rounds`` rounds of ``--steps`` steps each, after a warm-up), so a busy
machine slows them alike; the median step is reported.

``--stable_preset``: the real trainer (``sdxl_train_network.py``, in this process) trains each type for
``--steps`` steps on one image with ``--grad_guard_preset stable``, in fp16 (loss scaler) and bf16. A type
trains when every step trained (none skipped by the guard or anything else) and its training loss went
down: the mean loss of the trained network over the N steps' inputs (a second run from its file with a
learning rate of 1e-30, which changes nothing) below that of the untrained network (such a run of the
untrained network: every type starts with no effect). The noise and timesteps are keyed by sample, so all
three runs see the same inputs. A few steps do not lower the loss on *new* inputs for every type on the
tiny random model (a rank-4 LoRA at 1e-2 does not), but they do on the inputs trained on.
Prints one line per type and precision and "N of 16 types train in fp16 and bf16".
No target, not run in CI (tests/test_stable_preset_types.py runs the same).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from library import checkpoint_keys  # noqa: E402
from networks import network_base, registry  # noqa: E402

TYPES = registry.EXAMPLE_NETWORKS
PRECISIONS = ("fp16", "bf16")
STABLE_LEARNING_RATE = 1e-2
CONTROL_LEARNING_RATE = 1e-30


@dataclass(frozen=True)
class StableRun:
    """One training under the stable preset: steps, steps trained (the trainer's last line), losses per step."""

    steps: int
    trained: int
    losses: list[float]
    last_line: str


def stable_preset_run(models: dict, dataset: Path, label: str, precision: str, output_dir: Path, steps: int,
                      learning_rate: float = STABLE_LEARNING_RATE, network_weights: Path | None = None) -> StableRun:
    """Train ``label`` (an ``EXAMPLE_NETWORKS`` type) with the stable preset (from ``network_weights`` if
    given), writing ``output_dir / "net.safetensors"``; ``models``: the paths
    ``tools.build_tiny_models.build_tiny_models`` returns."""
    from accelerate.state import AcceleratorState, GradientState

    import sdxl_train_network

    module, alpha, _ = TYPES[label]
    argv = ["--pretrained_model_name_or_path", str(models["sdxl_file"]), "--model_config_dir", str(models["sdxl_config"]),
            "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
            "--output_dir", str(output_dir), "--output_name", "net", "--seed", "3", "--max_data_loader_n_workers", "0",
            "--network_module", module, "--network_dim", "4", "--network_alpha", str(alpha),
            "--network_args", *registry.example_network_args(label, 4), "--learning_rate", str(learning_rate),
            "--max_train_steps", str(steps), "--mixed_precision", precision, "--grad_guard_preset", "stable",
            "--log_jsonl", str(output_dir / "log.jsonl")]
    if network_weights is not None:
        argv += ["--network_weights", str(network_weights)]
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        try:
            sdxl_train_network.main(argv=argv)
        except SystemExit:  # "failed: ..." exits 1; the last line says why
            pass
    last_line = [line for line in printed.getvalue().splitlines() if line.startswith(("done:", "failed:"))][-1]
    trained = int(re.search(r"(\d+) trained", last_line).group(1))
    rows = [json.loads(line) for line in (output_dir / "log.jsonl").read_text().splitlines()]
    return StableRun(steps, trained, [row["loss/current"] for row in rows if "loss/current" in row], last_line)


def trained_and_untrained_loss(models: dict, dataset: Path, label: str, precision: str, output_dir: Path,
                               steps: int, untrained: StableRun) -> tuple[StableRun, float, float]:
    """Train ``label``, then the mean loss over the same ``steps`` inputs of the trained network (a run from its
    file that changes nothing) and of the untrained one (``untrained``: such a run of any type's initial
    network)."""
    run = stable_preset_run(models, dataset, label, precision, output_dir / "train", steps)
    evaluated = stable_preset_run(models, dataset, label, precision, output_dir / "evaluate", steps,
                                  CONTROL_LEARNING_RATE, network_weights=output_dir / "train" / "net.safetensors")
    return run, statistics.mean(evaluated.losses), statistics.mean(untrained.losses)


def stable_preset_report(steps: int, precisions: tuple[str, ...] = PRECISIONS) -> None:
    from tools.build_tiny_models import build_tiny_models
    from tools.make_demo_dataset import make_demo_dataset

    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        models = build_tiny_models(root / "models")
        dataset = root / "data"
        make_demo_dataset(str(dataset), count=1, size=64, repeats=10)
        training = {precision: set(TYPES) for precision in precisions}
        for precision in precisions:
            control = stable_preset_run(models, dataset, "networks.lora (Standard)", precision,
                                        root / f"control_{precision}", steps, CONTROL_LEARNING_RATE)
            for index, label in enumerate(TYPES):
                start = time.perf_counter()
                run, trained_loss, untrained_loss = trained_and_untrained_loss(
                    models, dataset, label, precision, root / f"{index}_{precision}", steps, control)
                if run.trained < run.steps or not trained_loss < untrained_loss:
                    training[precision].discard(label)
                print(f"{label:26s} {precision}  {run.trained}/{run.steps} steps trained  mean loss on the inputs "
                      f"trained on: {trained_loss:.4f} trained, {untrained_loss:.4f} untrained "
                      f"({'down' if trained_loss < untrained_loss else 'NOT down'}, "
                      f"{time.perf_counter() - start:.0f} s)", flush=True)
        both = set.intersection(*training.values())
        print(f"{len(both)} of {len(TYPES)} types train under --grad_guard_preset stable in {' and '.join(precisions)}"
              + (f" (not: {', '.join(sorted(set(TYPES) - both))})" if len(both) < len(TYPES) else ""))


def build(label: str, models, rank: int) -> tuple[network_base.AdapterNetwork, torch.optim.Optimizer]:
    module, alpha, _ = TYPES[label]
    network_args = network_base.parse_network_args(registry.example_network_args(label, rank))
    names = checkpoint_keys.unet_module_name_map(models.unet.config)
    network = registry.network_type(module).create_network(1.0, rank, alpha, None, models.text_encoders, models.unet,
                                                           unet_module_names=names, **network_args)
    optimizer = torch.optim.AdamW(network.prepare_optimizer_params(None, None, 1e-4))
    return network, optimizer


def time_steps(network, optimizer, models, batch: dict, steps: int) -> list[float]:
    """Seconds of each of ``steps`` training steps with ``network`` applied."""
    network.apply_to()
    network.train()
    seconds = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            hidden = torch.cat([encoder(batch["ids"]).last_hidden_state for encoder in models.text_encoders], dim=-1)
            prediction = models.unet(batch["latents"], batch["timesteps"], hidden,
                                     added_cond_kwargs=batch["added"]).sample
            torch.nn.functional.mse_loss(prediction, batch["target"]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seconds.append(time.perf_counter() - start)
    finally:
        network.restore()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=8, help="--network_dim of every type (default 8)")
    parser.add_argument("--latent", type=int, default=8, help="latent size, pixels / 8 (default 8: 64 px)")
    parser.add_argument("--rounds", type=int, default=5, help="turns per type (default 5)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per turn; with --stable_preset, training "
                                                             "steps per type (default 4)")
    parser.add_argument("--stable_preset", action="store_true",
                        help="train each type with the real trainer under --grad_guard_preset stable (fp16, bf16)")
    parser.add_argument("--precision", choices=PRECISIONS, default=None,
                        help="with --stable_preset: only this --mixed_precision (default: both)")
    args = parser.parse_args()
    if args.stable_preset:
        stable_preset_report(args.steps, (args.precision,) if args.precision else PRECISIONS)
        return
    from tools.build_tiny_models import tiny_sdxl

    torch.set_num_threads(1)
    torch.manual_seed(0)
    models = tiny_sdxl()
    models.unet.requires_grad_(False)
    for encoder in models.text_encoders:
        encoder.requires_grad_(False)
    batch = {
        "ids": torch.randint(0, 500, (1, 77)),
        "latents": torch.randn(1, 4, args.latent, args.latent),
        "target": torch.randn(1, 4, args.latent, args.latent),
        "timesteps": torch.tensor([500]),
        "added": {"text_embeds": torch.randn(1, 64), "time_ids": torch.tensor([[64.0, 64, 0, 0, 64, 64]])},
    }
    built = {name: build(name, models, args.rank) for name in TYPES}
    for network, optimizer in built.values():  # warm-up
        time_steps(network, optimizer, models, batch, 1)
    seconds: dict[str, list[float]] = {name: [] for name in TYPES}
    for _ in range(args.rounds):
        for name, (network, optimizer) in built.items():
            seconds[name] += time_steps(network, optimizer, models, batch, args.steps)
    reference = statistics.median(seconds["networks.lora (Standard)"])
    for name, values in seconds.items():
        step_s = statistics.median(values)
        parameters = sum(p.numel() for group in built[name][1].param_groups for p in group["params"])
        print(f"{name:26s} {step_s * 1000:7.1f} ms/step  {step_s / reference:5.2f}x networks.lora  "
              f"{parameters:8d} trained parameters  (rank {args.rank}, latent {args.latent}x{args.latent})")


if __name__ == "__main__":
    main()
