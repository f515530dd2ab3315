"""The NaN report: what a user needs to know when a loss or gradient first becomes non-finite.

``--nan_report`` (on in the stable preset) writes ``<output_name>-nan_report.txt`` into
``--output_dir`` at the first non-finite loss and at the first non-finite gradient of a run:
the step, its samples (file, caption, timestep, loss), whether the UNet's inputs were finite,
the first module whose output became non-finite in a re-run of the step's forward with hooks
(name, dtype, largest magnitude), the loss scale, the recent gradient norms and the learning
rates. The re-run happens only on that path, with the training RNG put back afterwards.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

import torch

from library import atomic_files

REPORT_SUFFIX = "-nan_report.txt"


def report_path(output_dir: str, output_name: str) -> Path:
    return Path(output_dir) / f"{output_name}{REPORT_SUFFIX}"


@dataclass
class ModuleFinding:
    """The first module (in the order modules finished their forward) whose output held NaN/Inf."""

    name: str
    dtype: str
    largest_input: float  # largest finite |value| among its tensor inputs
    output: str  # "nan", "inf" or "nan and inf"


@dataclass
class ForwardProbe:
    """Hooks that watch a re-run of the forward: the first non-finite module output, and per sample
    the UNet's timestep and whether its noisy latents and text conditioning were finite."""

    finding: Optional[ModuleFinding] = None
    timesteps: list[int] = field(default_factory=list)
    latents_finite: list[bool] = field(default_factory=list)
    conditioning_finite: list[bool] = field(default_factory=list)


def _tensors(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value] if value.is_floating_point() else []
    if isinstance(value, dict):
        return [tensor for item in value.values() for tensor in _tensors(item)]
    if isinstance(value, (list, tuple)):
        return [tensor for item in value for tensor in _tensors(item)]
    if hasattr(value, "to_tuple"):  # diffusers / transformers outputs
        return _tensors(value.to_tuple())
    return []


def _largest_finite(tensors: list[torch.Tensor]) -> float:
    largest = 0.0
    for tensor in tensors:
        finite = tensor.detach()[torch.isfinite(tensor.detach())]
        if finite.numel():
            largest = max(largest, float(finite.abs().max()))
    return largest


def _per_sample_finite(value: Any, batch_size: int) -> list[bool]:
    finite = torch.ones(batch_size, dtype=torch.bool)
    for tensor in _tensors(value):
        if tensor.dim() >= 1 and tensor.shape[0] == batch_size:
            finite &= torch.isfinite(tensor.detach()).flatten(1).all(dim=1).cpu() if tensor.dim() > 1 \
                else torch.isfinite(tensor.detach()).cpu()
    return finite.tolist()


class probe_forward:  # noqa: N801 - used as a context manager
    """``with probe_forward(named_models, unet) as probe:`` run the forward; then read ``probe``."""

    def __init__(self, named_models: Iterable[tuple[str, torch.nn.Module]], unet: torch.nn.Module) -> None:
        self.probe = ForwardProbe()
        self._models = list(named_models)
        self._unet = unet
        self._handles: list[Any] = []

    def __enter__(self) -> ForwardProbe:
        probe = self.probe

        def on_output(name: str):
            def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
                if probe.finding is not None:
                    return
                tensors = _tensors(output)
                has_nan = any(bool(torch.isnan(tensor).any()) for tensor in tensors)
                has_inf = any(bool(torch.isinf(tensor).any()) for tensor in tensors)
                if has_nan or has_inf:
                    kind = "nan and inf" if has_nan and has_inf else ("nan" if has_nan else "inf")
                    dtype = str(tensors[0].dtype).replace("torch.", "")
                    probe.finding = ModuleFinding(name, dtype, _largest_finite(_tensors(inputs)), kind)
            return hook

        def on_unet_input(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            latents = args[0] if args else kwargs["sample"]
            timesteps = args[1] if len(args) > 1 else kwargs["timestep"]
            batch_size = latents.shape[0]
            probe.timesteps += [int(t) for t in torch.as_tensor(timesteps).reshape(-1).expand(batch_size).tolist()]
            probe.latents_finite += _per_sample_finite(latents, batch_size)
            conditioning = [args[2:], kwargs.get("encoder_hidden_states"), kwargs.get("added_cond_kwargs")]
            probe.conditioning_finite += _per_sample_finite(conditioning, batch_size)

        for prefix, model in self._models:
            for name, module in model.named_modules():
                if name:
                    self._handles.append(module.register_forward_hook(on_output(f"{prefix}.{name}")))
        self._handles.append(self._unet.register_forward_pre_hook(on_unet_input, with_kwargs=True))
        return probe

    def __exit__(self, *exc_info: Any) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class SampleLine:
    file: str
    caption: str
    loss: float
    quarantined: bool = False


def format_report(kind: str, step: int, epoch: int, samples: list[SampleLine], probe: Optional[ForwardProbe],
                  loss_scale: Optional[float], recent_norms: list[float], learning_rates: list[Optional[float]],
                  note: str) -> str:
    """The text of one report section (``kind``: "loss" or "gradient")."""
    lines = [f"== first non-finite {kind}: optimizer step {step} (epoch {epoch}) ==", note, "", "samples:"]
    for index, sample in enumerate(samples):
        parts = [f"  {sample.file}", f"caption {sample.caption!r}", f"loss {sample.loss:.6g}"]
        if probe is not None and index < len(probe.timesteps):
            parts.append(f"timestep {probe.timesteps[index]}")
            parts.append("noisy latents " + ("finite" if probe.latents_finite[index] else "NON-FINITE"))
            parts.append("text conditioning " + ("finite" if probe.conditioning_finite[index] else "NON-FINITE"))
        if sample.quarantined:
            parts.append("quarantined")
        lines.append(", ".join(parts))
    lines.append("")
    if probe is None:
        lines.append("forward re-run: not run (the forward was finite)")
    elif probe.finding is None:
        lines.append("forward re-run: every module output finite (the overflow is in the backward or the loss)")
    else:
        finding = probe.finding
        lines.append(f"first non-finite module output in a re-run of the forward: {finding.name} "
                     f"({finding.dtype}; output {finding.output}; largest finite input magnitude "
                     f"{finding.largest_input:.6g}"
                     + (", beyond float16's 65504" if finding.largest_input > 65504 else "") + ")")
    lines.append(f"loss scale: {loss_scale:g}" if loss_scale is not None else "loss scale: none (no fp16 scaler)")
    lines.append("gradient norms of the last steps (oldest first): "
                 + ", ".join(f"{norm:.6g}" if math.isfinite(norm) else str(norm) for norm in recent_norms))
    lines.append("learning rates: " + ", ".join("set by the optimizer" if lr is None else f"{lr:.6g}"
                                                 for lr in learning_rates))
    return "\n".join(lines) + "\n\n"


def write_report(path: Path, text: str, start_new: bool) -> None:
    """Atomically write ``text`` as the report (``start_new``: the run's first section, replacing an
    older run's report) or append it as a further section."""
    previous = "" if start_new or not path.exists() else path.read_text(encoding="utf-8")
    atomic_files.write_file(path, previous + text)
