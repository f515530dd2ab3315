"""What a healthy point on disk costs a full fine-tune (``--healthy_point_location``): time and bytes of
one write, against keeping it in memory.

    python benchmarks/bench_healthy_point.py [--params_m 64] [--repeats 3] [--work_dir /tmp]

1. The tiny SDXL, a full fine-tune (``sdxl_train.py``, fp16, AdamW, ``--grad_guard_preset stable``) in
   this process with a healthy point at every step, once in memory and once on disk: the median time
   of one capture (``RunStates.capture``), its bytes, and the median step time (the overhead at the
   default cadence is ``capture / (50 * step)``).
2. Full-size SDXL: the UNet built on the meta device from ``library/model_configs/sdxl_base`` gives every
   parameter's shape; the first ``--params_m`` million parameters of its ``down_blocks.2`` (SDXL's
   1280-wide transformer blocks) are made real, trained one step with AdamW (float32, kohya's default
   dtypes) and with Adafactor (``--full_bf16``: bf16 weights; kohya's recommended
   ``scale_parameter=False relative_step=False warmup_init=False``), and their healthy point is
   written to disk (``RunStates.capture``, the trainer's own path) and copied in memory. The write's
   throughput on those bytes is extrapolated to the whole UNet's bytes, computed from its shapes with
   each optimizer's state rule (checked against the real optimizer's state on the measured blocks).
   Peak memory stays under ~2 GiB at the default 64 M parameters.

The last line: ``tiny_disk_ms=.. tiny_memory_ms=.. tiny_mib=.. full_adamw_gib=.. full_adamw_write_s=..
full_adafactor_bf16_gib=.. full_adafactor_bf16_write_s=..``. Not run in CI.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent


def tiny_full_fine_tune(steps: int, location: str, work_dir: str) -> dict[str, float]:
    """``steps`` steps of a tiny SDXL full fine-tune with a healthy point at every step at ``location``:
    ``bench_healing.timed_run``'s step and capture times and bytes."""
    import sdxl_train
    from bench_healing import timed_run
    from library.training.trainer import Trainer
    from tools.build_tiny_models import build_tiny_models
    from tools.make_demo_dataset import make_demo_dataset

    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        models = build_tiny_models(Path(tmp) / "models")
        make_demo_dataset(str(Path(tmp) / "dataset"), count=4, size=64, repeats=1)
        argv = ["--pretrained_model_name_or_path", str(models["sdxl_file"]), "--model_config_dir",
                str(models["sdxl_config"]), "--train_data_dir", str(Path(tmp) / "dataset"), "--caption_extension",
                ".txt", "--resolution", "64", "--output_dir", str(Path(tmp) / "out"), "--learning_rate", "1e-4",
                "--optimizer_type", "AdamW", "--mixed_precision", "fp16", "--max_train_steps", str(steps),
                "--seed", "42", "--max_data_loader_n_workers", "0", "--grad_guard_preset", "stable",
                "--rewind_every_n_steps", "1", "--healthy_point_location", location, "--save_model_as", "safetensors"]

        def train() -> None:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                sdxl_train.main(argv)
        return timed_run(Trainer, train)


def sdxl_unet_shapes() -> dict[str, torch.Size]:
    """Every parameter of the full-size SDXL UNet (built on the meta device: no memory)."""
    from diffusers import UNet2DConditionModel

    config = json.loads((REPO / "library/model_configs/sdxl_base/unet/config.json").read_text())
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
    return {name: parameter.shape for name, parameter in unet.named_parameters()}


def state_bytes(optimizer_name: str, shape: torch.Size) -> int:
    """Bytes of one parameter's optimizer state (float32 tensors, as both optimizers keep them)."""
    numel = shape.numel()
    if optimizer_name == "adamw":  # exp_avg, exp_avg_sq (+ a 0-d step)
        return 4 * (2 * numel + 1)
    if len(shape) >= 2:  # Adafactor without a first moment: factored second moment (+ a 0-d RMS)
        return 4 * (shape[:-1].numel() + (shape[:-2] + shape[-1:]).numel() + 1)
    return 4 * (numel + 1)


def measured_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for value in state.values() if torch.is_tensor(value))


class Blocks(torch.nn.Module):
    """The measured parameters under the interface ``RunStates`` uses (as ``FullModel``)."""

    def __init__(self, parameters: dict[str, torch.nn.Parameter]) -> None:
        super().__init__()
        self.trained = parameters

    def training_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: parameter.detach() for name, parameter in self.trained.items()}

    def load_training_state_dict(self, state) -> None:
        with torch.no_grad():
            for name, value in state.items():
                self.trained[name].copy_(value)


def full_size(shapes: dict[str, torch.Size], optimizer_name: str, params_m: float, repeats: int,
              work_dir: str) -> dict[str, float]:
    """One healthy-point write of real SDXL blocks, and the whole UNet's bytes by the same rule."""
    from library import healthy_point
    from library.train_state import RunStates, StateStore
    from transformers.optimization import Adafactor

    dtype = torch.float32 if optimizer_name == "adamw" else torch.bfloat16
    chosen, total = {}, 0
    for name, shape in shapes.items():
        if name.startswith("down_blocks.2.") and total < params_m * 1e6:
            chosen[name] = shape
            total += shape.numel()
    generator = torch.Generator().manual_seed(0)
    parameters = {name: torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.02).to(dtype))
                  for name, shape in chosen.items()}
    if optimizer_name == "adamw":
        optimizer = torch.optim.AdamW(parameters.values(), lr=1e-5)
    else:
        optimizer = Adafactor(parameters.values(), lr=1e-5, scale_parameter=False, relative_step=False,
                              warmup_init=False)
    for parameter in parameters.values():
        parameter.grad = torch.randn_like(parameter) * 1e-3
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # the rule the whole UNet's bytes are computed with is the real optimizer's
    assert measured_state_bytes(optimizer) == sum(state_bytes(optimizer_name, s) for s in chosen.values())
    weight_bytes = sum(p.numel() * p.element_size() for p in parameters.values())
    measured_bytes = weight_bytes + measured_state_bytes(optimizer)
    full_bytes = sum(shape.numel() * torch.tensor([], dtype=dtype).element_size() + state_bytes(optimizer_name, shape)
                     for shape in shapes.values())
    writes, copies = [], []
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        disk = healthy_point.HealthyPointPlace("disk", Path(tmp) / "bench-healthy" / "healthy_point.pt")
        states = RunStates(StateStore(tmp, "bench", {}), Blocks(parameters), {"optimizer": optimizer}, place=disk)
        with contextlib.redirect_stdout(io.StringIO()):
            for _ in range(repeats):
                start = time.perf_counter()
                states.capture(1, (1, 1))
                writes.append(time.perf_counter() - start)
            file_bytes = states.healthy_point_bytes()
            start = time.perf_counter()
            states.restore(torch.device("cpu"))
            read_s = time.perf_counter() - start
        states.close()
        states.place = healthy_point.HealthyPointPlace("memory")
        for _ in range(repeats):
            start = time.perf_counter()
            states.capture(1, (1, 1))
            copies.append(time.perf_counter() - start)
            states.healthy_point = None
    write_s, copy_s = statistics.median(writes), statistics.median(copies)
    scale = full_bytes / measured_bytes
    return {"params": total, "measured_bytes": measured_bytes, "file_bytes": file_bytes, "write_s": write_s,
            "read_s": read_s, "copy_s": copy_s, "write_gib_s": file_bytes / write_s / 2**30,
            "full_params": sum(s.numel() for s in shapes.values()), "full_bytes": full_bytes,
            "full_write_s": write_s * scale, "full_read_s": read_s * scale, "full_copy_s": copy_s * scale}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params_m", type=float, default=64, help="full-size parameters measured, millions (64)")
    parser.add_argument("--steps", type=int, default=8, help="tiny SDXL optimizer steps (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="writes timed per case (default 3)")
    parser.add_argument("--work_dir", default=tempfile.gettempdir(), help="where the files are written (its disk)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tiny = {location: tiny_full_fine_tune(args.steps, location, args.work_dir) for location in ("memory", "disk")}
    for location, result in tiny.items():
        print(f"tiny SDXL full fine-tune, healthy point in {location}: capture {result['snapshot_s'] * 1000:.1f} ms, "
              f"{result['snapshot_bytes'] / 2**20:.2f} MiB; step {result['step_s'] * 1000:.0f} ms; overhead at "
              f"every 50 "
              f"steps {100 * result['snapshot_s'] / (50 * result['step_s']):.2f}%")
    shapes = sdxl_unet_shapes()
    full = {}
    for name in ("adamw", "adafactor_bf16"):
        result = full[name] = full_size(shapes, name.split("_")[0], args.params_m, args.repeats, args.work_dir)
        print(f"full-size SDXL UNet blocks, {name}: {result['params'] / 1e6:.1f} M parameters, healthy point "
              f"{result['file_bytes'] / 2**30:.3f} GiB written in {result['write_s']:.2f} s "
              f"({result['write_gib_s']:.2f} GiB/s), read back in {result['read_s']:.2f} s, memory copy "
              f"{result['copy_s']:.2f} s -> whole UNet ({result['full_params'] / 1e9:.3f} G parameters): "
              f"{result['full_bytes'] / 2**30:.1f} GiB, write ~{result['full_write_s']:.0f} s, rewind read "
              f"~{result['full_read_s']:.0f} s, memory copy ~{result['full_copy_s']:.0f} s")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"peak RSS {peak:.2f} GiB")
    disk, memory = tiny["disk"], tiny["memory"]
    print(f"tiny_disk_ms={disk['snapshot_s'] * 1000:.1f} tiny_memory_ms={memory['snapshot_s'] * 1000:.1f} "
          f"tiny_mib={disk['snapshot_bytes'] / 2**20:.2f} full_adamw_gib={full['adamw']['full_bytes'] / 2**30:.1f} "
          f"full_adamw_write_s={full['adamw']['full_write_s']:.0f} "
          f"full_adafactor_bf16_gib={full['adafactor_bf16']['full_bytes'] / 2**30:.1f} "
          f"full_adafactor_bf16_write_s={full['adafactor_bf16']['full_write_s']:.0f}")


if __name__ == "__main__":
    main()
