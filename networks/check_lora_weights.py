"""Check a network file of any type: every value finite, and per-module norms.

    python networks/check_lora_weights.py FILE [--show_all_keys]

LoRA-format files (networks.lora / dylora / lora_fa: ``lora_down``/``lora_up``/``alpha``) give
one CSV line per module ``module,rank,alpha,down_norm,up_norm,delta_norm`` (Frobenius norms;
``delta_norm`` is that of ``up @ down * alpha / rank``, the change the module makes to the
model's weight). Other types (LoHa, LoKr, OFT, LyCORIS: the type from ``ss_network_module`` or
the tensor names) give ``module,tensors,alpha,weights_norm,delta_norm``: the module's tensor
names, the norm of all its tensors but alpha, and the weight change's norm where the type can
compute it from the file alone (``n/a`` otherwise, e.g. OFT: it rotates the base weight).
Then a summary line. Exit code 0 when all values are finite; 1 when a module holds NaN/Inf
(each such module is named on stderr); 2 for an unreadable file.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Mapping, Sequence  # noqa: E402

import torch  # noqa: E402

from library.errors import UserError, exit_on_user_error  # noqa: E402
from networks import network_base, registry  # noqa: E402
from networks.lora import is_plain_lora, lora_delta, lora_modules, module_scale, read_lora_file  # noqa: E402

COLUMNS = ("module", "rank", "alpha", "down_norm", "up_norm", "delta_norm")
OTHER_COLUMNS = ("module", "tensors", "alpha", "weights_norm", "delta_norm")


@dataclass(frozen=True)
class ModuleReport:
    name: str
    rank: int
    alpha: float
    down_norm: float
    up_norm: float
    delta_norm: float
    finite: bool


def check_weights(weights: Mapping[str, torch.Tensor]) -> tuple[list[ModuleReport], list[str]]:
    """Per-module reports, and the keys outside any LoRA module that hold NaN/Inf."""
    reports = []
    for name, parts in lora_modules(weights).items():
        finite = all(bool(torch.isfinite(value.float()).all()) for value in parts.values())
        rank = parts["down"].shape[0]
        reports.append(ModuleReport(
            name=name, rank=rank, alpha=module_scale(parts) * rank,
            down_norm=float(torch.linalg.vector_norm(parts["down"].float())),
            up_norm=float(torch.linalg.vector_norm(parts["up"].float())),
            delta_norm=float(torch.linalg.vector_norm(lora_delta(parts))), finite=finite))
    covered = {f"{report.name}.{suffix}" for report in reports for suffix in ("lora_down.weight", "lora_up.weight", "alpha")}
    other_bad = [key for key, value in weights.items() if key not in covered and value.is_floating_point()
                 and not bool(torch.isfinite(value.float()).all())]
    return reports, other_bad


def is_finite(value: torch.Tensor) -> bool:
    return not value.is_floating_point() or bool(torch.isfinite(value.float()).all())


def other_type_lines(weights: Mapping[str, torch.Tensor], type_module) -> tuple[list[str], list[str], str]:
    """CSV lines (``OTHER_COLUMNS``) of a non-LoRA file, the modules holding NaN/Inf, and a summary line.
    ``type_module.module_delta(parts)`` (optional) gives a module's weight change from its tensors."""
    module_delta = getattr(type_module, "module_delta", None)
    lines, bad = [], []
    largest = (-1.0, "")
    for name, parts in network_base.group_by_module(weights).items():
        tensors = {key: value for key, value in parts.items() if key != "alpha"}
        alpha = f"{float(parts['alpha']):g}" if "alpha" in parts else ""
        weights_norm = float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(value.float()) for value in tensors.values()]))) if tensors else 0.0
        delta_norm = "n/a"
        if not all(is_finite(value) for value in parts.values()):
            bad.append(name)
        elif module_delta is not None:
            norm = float(torch.linalg.vector_norm(module_delta(parts)))
            delta_norm = f"{norm:.6g}"
            largest = max(largest, (norm, name))
        lines.append(f"{name},{'+'.join(sorted(tensors))},{alpha},{weights_norm:.6g},{delta_norm}")
    summary = f"# {len(lines)} modules, {len(bad)} with NaN/Inf"
    if largest[1]:
        summary += f"; largest delta_norm {largest[0]:.6g} ({largest[1]})"
    return lines, bad, summary


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check_lora_weights.py",
                                     description="Check that a network file is finite and print per-module norms.")
    parser.add_argument("file", metavar="FILE", help="network .safetensors file to check (any type)")
    parser.add_argument("-s", "--show_all_keys", action="store_true",
                        help="also list keys that belong to no LoRA module (dtype and shape). Default: off")
    args = parser.parse_args(argv)
    weights = read_lora_file(args.file)
    if not is_plain_lora(weights):
        module_name = registry.file_network_module(weights, network_base.read_lora_metadata(args.file), args.file)
        lines, bad, summary = other_type_lines(weights, registry.network_type(module_name))
        print(f"# {module_name}")
        print(",".join(OTHER_COLUMNS))
        print("\n".join(lines))
        for name in bad:
            print(f"NaN/Inf in module {name}", file=sys.stderr)
        print(summary)
        return 1 if bad else 0
    reports, other_bad = check_weights(weights)
    if not reports:
        raise UserError(f"{args.file}: no LoRA modules (no *.lora_down.weight / *.lora_up.weight keys)")
    print(",".join(COLUMNS))
    for report in reports:
        print(f"{report.name},{report.rank},{report.alpha:g},{report.down_norm:.6g},{report.up_norm:.6g},"
              f"{report.delta_norm:.6g}")
    if args.show_all_keys:
        covered = {f"{report.name}.{suffix}" for report in reports
                   for suffix in ("lora_down.weight", "lora_up.weight", "alpha")}
        for key, value in weights.items():
            if key not in covered:
                print(f"# other key {key} {value.dtype} {tuple(value.shape)}")
    bad = [report.name for report in reports if not report.finite]
    for name in bad:
        print(f"NaN/Inf in LoRA module {name}", file=sys.stderr)
    for key in other_bad:
        print(f"NaN/Inf in {key}", file=sys.stderr)
    largest = max(reports, key=lambda report: report.delta_norm if report.finite else -1.0)
    print(f"# {len(reports)} modules, {len(bad) + len(other_bad)} with NaN/Inf; largest delta_norm "
          f"{largest.delta_norm:.6g} ({largest.name})")
    return 1 if bad or other_bad else 0


if __name__ == "__main__":
    exit_on_user_error(lambda: sys.exit(main()))
