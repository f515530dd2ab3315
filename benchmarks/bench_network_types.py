"""Seconds per training step of each network type on the tiny SDXL, relative to networks.lora at the same rank.

    python benchmarks/bench_network_types.py [--rank 8] [--latent 8] [--rounds 5] [--steps 4]

One step: both text encoders and the UNet forward with the network applied (text encoder and
UNet modules, 3x3 convs where the type has them), MSE loss, backward, AdamW step, in float32
on one thread. The types take turns (``--rounds`` rounds of ``--steps`` steps each, after a
warm-up), so a busy machine slows them alike; the median step is reported. No target, not run in CI.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from library import checkpoint_keys  # noqa: E402
from networks import network_base, registry  # noqa: E402

# label -> (--network_module, --network_alpha, --network_args); lycoris.kohya as the GUI's LyCORIS types write it
TYPES = {
    "networks.lora": ("networks.lora", 1.0, ["conv_dim=RANK", "conv_alpha=1"]),
    "networks.dylora": ("networks.dylora", 1.0, ["conv_dim=RANK", "unit=1"]),
    "networks.lora_fa": ("networks.lora_fa", 1.0, ["conv_dim=RANK", "conv_alpha=1"]),
    "networks.loha": ("networks.loha", 1.0, ["conv_dim=RANK", "conv_alpha=1"]),
    "networks.lokr": ("networks.lokr", 1.0, ["conv_dim=RANK", "conv_alpha=1"]),
    "networks.oft": ("networks.oft", 0.01, ["enable_conv=True"]),
    **{f"lycoris {algo}": ("lycoris.kohya", 1.0, [f"algo={algo}", "conv_dim=RANK", "conv_alpha=1", *extra])
       for algo, extra in (("locon", []), ("loha", []), ("lokr", ["factor=-1"]), ("ia3", []), ("glora", []),
                           ("dylora", ["block_size=1"]), ("diag-oft", []), ("boft", []), ("full", []))},
}


def build(label: str, models, rank: int) -> tuple[network_base.AdapterNetwork, torch.optim.Optimizer]:
    module, alpha, args = TYPES[label]
    network_args = network_base.parse_network_args([arg.replace("RANK", str(rank)) for arg in args])
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
    parser.add_argument("--steps", type=int, default=4, help="timed steps per turn (default 4)")
    args = parser.parse_args()
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
    reference = statistics.median(seconds["networks.lora"])
    for name, values in seconds.items():
        step_s = statistics.median(values)
        parameters = sum(p.numel() for group in built[name][1].param_groups for p in group["params"])
        print(f"{name:18s} {step_s * 1000:7.1f} ms/step  {step_s / reference:5.2f}x networks.lora  "
              f"{parameters:8d} trained parameters  (rank {args.rank}, latent {args.latent}x{args.latent})")


if __name__ == "__main__":
    main()
