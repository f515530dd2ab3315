"""Reduce the rank of a LoRA by SVD of each module's weight change (kohya's flag names).

    python networks/resize_lora.py --model IN.safetensors --save_to OUT.safetensors --new_rank 4
        [--new_conv_rank R] [--dynamic_method sv_ratio|sv_fro|sv_cumulative --dynamic_param X]
        [--save_precision float|fp16|bf16] [--svd_lowrank_niter 2] [--verbose]

Each module's delta ``D = up @ down * alpha / rank`` (3x3 conv kernels flattened) is
decomposed as ``U S V^T``; the new module keeps the first ``r`` singular triplets, so its
delta is the best rank-``r`` approximation of ``D`` (Eckart-Young): the Frobenius error is
``sqrt(sum of the discarded S^2)``. The new alpha keeps the old scale (``alpha/rank``), and
``sqrt(S)`` is split evenly between up and down. A rank at or above the module's own
reproduces its delta.

Rank per module: ``--new_rank`` (``--new_conv_rank`` for 3x3 convs, default ``--new_rank``),
or with ``--dynamic_method`` the smallest rank meeting ``--dynamic_param`` (capped at
``--new_rank``):

* ``sv_ratio X``: keep the singular values ``> S[0] / X``;
* ``sv_fro X``: retained Frobenius fraction ``sqrt(sum S_r^2 / sum S^2) >= X`` (0 < X <= 1);
* ``sv_cumulative X``: retained sum ``sum S_r / sum S >= X`` (0 < X <= 1).

(the ranks kohya v0.11.1 chooses, checked on the same files; kohya's v0.10.1 script kept one more value.)

``--svd_lowrank_niter N`` (kohya v0.10.2+, default 2; 0: always the full SVD): as kohya, a delta
whose both dimensions exceed 2048 (3x3 convs flattened) is decomposed by ``torch.svd_lowrank`` with
``q = min(2 * max rank, out, in)`` and N subspace iterations instead of the full SVD; the ranks
are then chosen among those ``q`` approximate singular values. No SDXL or SD 1.x module is that
large (the widest, 1280 x 10240, has 1280 rows), so there the flag changes nothing; it matters for
larger models' LoRAs. Unlike kohya's, the random start is seeded (``LOWRANK_SEED``), so the same
command writes the same bytes, and the error reported for such a module is measured: the written
factors' delta against the original delta (the discarded singular values of an approximate SVD do
not give it).

A line per module reports the new rank, the retained Frobenius fraction (energy) and the relative
error ``||delta - new delta||_F / ||delta||_F``.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Mapping, Optional, Sequence  # noqa: E402

import torch  # noqa: E402

from library.errors import UserError, exit_on_user_error  # noqa: E402
from library.lora_files import SAVE_DTYPES  # noqa: E402
from library.lora_metadata import addnet_hashes  # noqa: E402
from library.tool_paths import check_output_path  # noqa: E402
from networks import registry  # noqa: E402
from networks.lora import lora_delta, lora_modules, module_scale, read_lora_file, save_lora_file  # noqa: E402
from networks.network_base import read_lora_metadata  # noqa: E402

MIN_SINGULAR_VALUE = 1e-6
"""A module whose largest singular value is below this is all zeros: it is written at rank 1."""
LOWRANK_MIN_DIM = 2048
"""kohya's rule: ``torch.svd_lowrank`` only for a delta with both dimensions above this."""
LOWRANK_SEED = 0
"""The seed of ``torch.svd_lowrank``'s random start, for the same result on every run."""


@dataclass(frozen=True)
class ResizeResult:
    """One module's outcome: ranks before/after and the retained Frobenius fraction of its delta."""

    name: str
    old_rank: int
    new_rank: int
    fro_retained: float
    relative_error: float  # ||delta - new delta||_F / ||delta||_F


def choose_rank(singular_values: torch.Tensor, max_rank: int, method: Optional[str], param: Optional[float]) -> int:
    """The kept rank for descending ``singular_values`` (at least 1, at most ``max_rank`` and their count)."""
    values = singular_values.double()
    available = len(values)
    if method is None or float(values[0]) <= MIN_SINGULAR_VALUE:
        rank = max_rank if float(values[0]) > MIN_SINGULAR_VALUE else 1
    elif method == "sv_ratio":
        rank = int((values > values[0] / param).sum())
    else:
        weights = values.pow(2) if method == "sv_fro" else values
        target = param ** 2 if method == "sv_fro" else param
        fraction = torch.cumsum(weights, 0) / weights.sum()
        rank = int(torch.searchsorted(fraction, torch.tensor([target - 1e-12], dtype=torch.float64))[0]) + 1
    return max(1, min(rank, max_rank, available))


def decompose(matrix: torch.Tensor, max_rank: int, svd_lowrank_niter: int = 0,
              lowrank_min_dim: int = LOWRANK_MIN_DIM) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """``(U, S, Vh, approximate)`` of a 2-D ``matrix``: the full (thin) SVD, or with ``svd_lowrank_niter > 0``
    and both dimensions above ``lowrank_min_dim`` kohya's ``torch.svd_lowrank`` (``q = min(2 * max_rank, out,
    in)``, seeded with ``LOWRANK_SEED`` so the result repeats; the caller's random state is left as it was)."""
    if svd_lowrank_niter > 0 and min(matrix.shape) > lowrank_min_dim:
        q = min(2 * max_rank, *matrix.shape)
        devices = [matrix.device] if matrix.device.type != "cpu" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(LOWRANK_SEED)
            u, s, v = torch.svd_lowrank(matrix, q=q, niter=svd_lowrank_niter)
        return u, s, v.mT, True
    u, s, vh = torch.linalg.svd(matrix, full_matrices=False)
    return u, s, vh, False


def low_rank_module(delta: torch.Tensor, max_rank: int, method: Optional[str], param: Optional[float],
                    scale: float = 1.0, alpha: Optional[float] = None, svd_lowrank_niter: int = 0,
                    lowrank_min_dim: int = LOWRANK_MIN_DIM, *, fixed_rank: bool = False,
                    clamp_quantile: Optional[float] = None, compute_dtype: torch.dtype = torch.float64
                    ) -> tuple[dict[str, torch.Tensor], float, float]:
    """The best LoRA module of at most ``max_rank`` (rank chosen as :func:`choose_rank`) for a weight change
    ``delta`` in its weight's shape (Linear ``(out, in)``, Conv2d ``(out, in, kh, kw)``): ``({"down", "up",
    "alpha"}, fro_retained, relative_error)``, float32 factors with ``sqrt(S / scale)`` on each side and
    ``alpha = scale * rank`` (or ``alpha`` given, then ``scale = alpha / rank``); ``relative_error = ||delta -
    up @ down * scale|| / ||delta||`` (Frobenius; 0 for a zero delta), from the discarded singular values.
    After an approximate SVD (:func:`decompose`) both are measured on the written factors instead.

    For kohya's extract tool: ``fixed_rank`` keeps ``max_rank`` (capped at the matrix's size) even for an
    all-zero delta, so every module has the rank asked for; ``clamp_quantile`` puts the singular values on the
    up side (kohya's split) and clamps both factors as kohya does (see :func:`_clamped_factors`; the error is
    then measured on the clamped factors). The SVD runs in ``compute_dtype`` on ``delta``'s device (float32:
    kohya's precision, 2-3x faster on a CPU)."""
    matrix = delta.to(compute_dtype).reshape(delta.shape[0], -1)
    u, s, vh, approximate = decompose(matrix, max_rank, svd_lowrank_niter, lowrank_min_dim)
    rank = min(max_rank, len(s)) if fixed_rank else choose_rank(s, max_rank, method, param)
    if alpha is not None:
        scale = alpha / rank
    squared = s.double().pow(2)
    total = float(squared.sum())
    fro_retained = math.sqrt(float(squared[:rank].sum()) / total) if total > 0 else 1.0
    relative_error = math.sqrt(float(squared[rank:].sum()) / total) if total > 0 else 0.0
    if clamp_quantile is None:
        root = torch.sqrt(s[:rank] / scale)
        up = u[:, :rank] * root
        down = root[:, None] * vh[:rank]
        if approximate:  # the discarded values of an approximate SVD do not give the error
            fro_retained, relative_error = measured_fit(matrix.double(), up.float(), down.float(), scale)
    else:
        up, down, relative_error = _clamped_factors(matrix, u[:, :rank] * (s[:rank] / scale), vh[:rank], scale,
                                                    clamp_quantile)
    if delta.dim() == 4:
        down = down.reshape(rank, *delta.shape[1:])
        up = up.reshape(*up.shape, 1, 1)
    parts = {"down": down.float().contiguous(), "up": up.float().contiguous(),
             "alpha": torch.tensor(scale * rank, dtype=torch.float32)}
    return parts, fro_retained, relative_error


def _clamped_factors(matrix: torch.Tensor, up: torch.Tensor, down: torch.Tensor, scale: float, quantile: float
                     ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """kohya's clamp of the factors of ``matrix ~ up @ down * scale``: both to ``[-q, q]``, ``q`` the ``quantile``
    of their joined signed values (1: no clamping; kohya's ``-max`` lower bound would clip the negative tail).
    The result depends on the arbitrary signs of the singular vectors (the bound is not symmetric in them),
    so of the SVD's own signs and those putting each pair's heavier tail (third moment) on the positive side,
    the one with the smaller error is kept. Returns (up, down, ||matrix - up @ down * scale|| / ||matrix||)."""
    candidates = [(up, down)]
    if quantile < 1:
        joined = torch.cat([up, down.T])
        skew = torch.where(joined.pow(3).sum(0) < 0, -1.0, 1.0).to(up.dtype)
        candidates = []
        for signed_up, signed_down in ((up, down), (up * skew, down * skew[:, None])):
            limit = torch.quantile(torch.cat([signed_up.flatten(), signed_down.flatten()]), quantile)
            candidates.append((signed_up.clamp(-limit, limit), signed_down.clamp(-limit, limit)))
    norm = float(matrix.double().norm())
    scored = [(float((matrix.double() - (up_c.double() @ down_c.double()) * scale).norm()) / norm if norm > 0 else 0.0,
               index) for index, (up_c, down_c) in enumerate(candidates)]
    error, best = min(scored)
    return candidates[best][0], candidates[best][1], error


def measured_fit(matrix: torch.Tensor, up: torch.Tensor, down: torch.Tensor, scale: float) -> tuple[float, float]:
    """``(fro_retained, relative_error)`` of ``up @ down * scale`` for ``matrix``, measured in float64: the error
    ``||matrix - up @ down * scale|| / ||matrix||``; the kept part of a (randomised) SVD is an orthogonal
    projection of ``matrix``, so the retained Frobenius fraction is ``sqrt(1 - error^2)``."""
    total = float(matrix.norm())
    if total == 0:
        return 1.0, 0.0
    error = float((matrix - (up.double() @ down.double()) * scale).norm()) / total
    return math.sqrt(max(0.0, 1.0 - error ** 2)), error


def resize_module(parts: Mapping[str, torch.Tensor], max_rank: int, method: Optional[str], param: Optional[float],
                  svd_lowrank_niter: int = 0, lowrank_min_dim: int = LOWRANK_MIN_DIM
                  ) -> tuple[dict[str, torch.Tensor], float, float]:
    """``({"down", "up", "alpha"}, fro_retained, relative_error)`` of the resized module (float32; the scale
    alpha/rank is kept); see :func:`low_rank_module`."""
    return low_rank_module(lora_delta(parts, torch.float64), max_rank, method, param, module_scale(parts),
                           svd_lowrank_niter=svd_lowrank_niter, lowrank_min_dim=lowrank_min_dim)


def resize_weights(weights: Mapping[str, torch.Tensor], new_rank: int, *, new_conv_rank: Optional[int] = None,
                   dynamic_method: Optional[str] = None, dynamic_param: Optional[float] = None,
                   svd_lowrank_niter: int = 0, lowrank_min_dim: int = LOWRANK_MIN_DIM,
                   report=None) -> tuple[dict[str, torch.Tensor], list[ResizeResult]]:
    """Resize every module of a kohya LoRA state dict; keys other than LoRA modules are kept.
    ``svd_lowrank_niter``/``lowrank_min_dim``: see :func:`decompose`. ``report`` (optional) receives each
    :class:`ResizeResult` as it is computed."""
    resized: dict[str, torch.Tensor] = {}
    results = []
    modules = lora_modules(weights)
    for name, parts in modules.items():
        is_conv3x3 = parts["down"].dim() == 4 and tuple(parts["down"].shape[2:]) != (1, 1)
        max_rank = new_conv_rank if is_conv3x3 and new_conv_rank is not None else new_rank
        max_rank = min(max_rank, parts["down"].shape[0])  # the delta has no more than the old rank
        new_parts, fro_retained, error = resize_module(parts, max_rank, dynamic_method, dynamic_param,
                                                       svd_lowrank_niter, lowrank_min_dim)
        resized[f"{name}.lora_down.weight"] = new_parts["down"]
        resized[f"{name}.lora_up.weight"] = new_parts["up"]
        resized[f"{name}.alpha"] = new_parts["alpha"]
        result = ResizeResult(name, parts["down"].shape[0], new_parts["down"].shape[0], fro_retained, error)
        results.append(result)
        if report is not None:
            report(result)
    for key, value in weights.items():
        if key.partition(".")[0] not in modules:
            resized[key] = value
    return resized, results


def setup_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="resize_lora.py", description="Reduce a LoRA's rank by SVD.")
    parser.add_argument("--model", required=True, metavar="IN", help="LoRA .safetensors file to resize")
    parser.add_argument("--save_to", required=True, metavar="OUT", help="where to write the resized LoRA (.safetensors)")
    parser.add_argument("--new_rank", type=int, default=4, help="rank of the output LoRA (maximum rank with "
                        "--dynamic_method). Default: 4")
    parser.add_argument("--new_conv_rank", type=int, default=None,
                        help="rank for 3x3 conv modules. Default: --new_rank")
    parser.add_argument("--save_precision", default=None, choices=[None, "float", "fp16", "bf16"],
                        help="dtype of the saved weights. Default: float")
    parser.add_argument("--dynamic_method", default=None, choices=[None, "sv_ratio", "sv_fro", "sv_cumulative"],
                        help="choose each module's rank from its singular values (see the module docstring); "
                             "--new_rank is the upper limit. Default: fixed rank")
    parser.add_argument("--dynamic_param", type=float, default=None,
                        help="target of --dynamic_method: a ratio > 1 for sv_ratio, a fraction in (0, 1] for "
                             "sv_fro / sv_cumulative")
    parser.add_argument("--svd_lowrank_niter", type=int, default=2,
                        help="subspace iterations of torch.svd_lowrank for deltas with both dimensions above "
                             f"{LOWRANK_MIN_DIM} (none in SDXL or SD 1.x); 0: always the full SVD. Default: 2")
    parser.add_argument("--device", default=None, help="accepted for kohya compatibility; the SVD runs on the CPU")
    parser.add_argument("--verbose", action="store_true", help="accepted for kohya compatibility (per-module lines "
                        "are always printed)")
    return parser


def validate_ranks_and_output(args: argparse.Namespace, *rank_flags: str, input_flags: Sequence[str] = ()) -> None:
    """The rank options (dests) are >= 1 when given, and ``--save_to`` names a .safetensors file that is
    none of the inputs (``input_flags``: dests of the input paths; ``library.tool_paths.check_output_path``)."""
    for flag in rank_flags:
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise UserError(f"--{flag} must be a rank >= 1 (got {value})")
    check_output_path("--save_to", args.save_to, [(f"--{flag}", getattr(args, flag)) for flag in input_flags])


def validate(args: argparse.Namespace) -> None:
    validate_ranks_and_output(args, "new_rank", "new_conv_rank", input_flags=("model",))
    if args.dynamic_method is not None:
        param = args.dynamic_param
        if param is None:
            raise UserError(f"--dynamic_method {args.dynamic_method} needs --dynamic_param")
        if args.dynamic_method == "sv_ratio" and not param > 1:
            raise UserError(f"--dynamic_param {param}: sv_ratio needs a ratio > 1 (e.g. 8)")
        if args.dynamic_method != "sv_ratio" and not 0 < param <= 1:
            raise UserError(f"--dynamic_param {param}: {args.dynamic_method} needs a fraction in (0, 1] (e.g. 0.9)")
    elif args.dynamic_param is not None:
        raise UserError("--dynamic_param has no effect without --dynamic_method")
    if args.svd_lowrank_niter < 0:
        raise UserError(f"--svd_lowrank_niter {args.svd_lowrank_niter}: give 0 (full SVD) or more iterations, e.g. 2")


def main(argv: Sequence[str] | None = None) -> None:
    args = setup_parser().parse_args(argv)
    validate(args)
    weights = read_lora_file(args.model)
    registry.require_lora_format(weights, read_lora_metadata(args.model), f"--model {args.model}", "resizing")

    def report(result: ResizeResult) -> None:
        print(f"{result.name}: rank {result.old_rank} -> {result.new_rank}, "
              f"retained energy (Frobenius) {result.fro_retained:.4%}, relative error {result.relative_error:.3g}",
              flush=True)

    resized, results = resize_weights(weights, args.new_rank, new_conv_rank=args.new_conv_rank,
                                      dynamic_method=args.dynamic_method, dynamic_param=args.dynamic_param,
                                      svd_lowrank_niter=args.svd_lowrank_niter, report=report)
    dtype = SAVE_DTYPES[args.save_precision] or torch.float32
    resized = {key: value.to(dtype) if value.is_floating_point() else value for key, value in resized.items()}
    metadata = read_lora_metadata(args.model)
    comment = (f"dynamic resize with {args.dynamic_method}: {args.dynamic_param} from " if args.dynamic_method
               else f"resized to rank {args.new_rank} from ")
    old_dim = metadata.get("ss_network_dim", "?")
    metadata["ss_training_comment"] = f"{comment}{old_dim}; {metadata.get('ss_training_comment', '')}".rstrip("; ")
    metadata["ss_network_dim"] = "Dynamic" if args.dynamic_method else str(args.new_rank)
    metadata["ss_network_alpha"] = "Dynamic" if args.dynamic_method else str(float(resized[f"{results[0].name}.alpha"]))
    if any(key.startswith("sshs_") for key in metadata):
        metadata.update(addnet_hashes(resized, metadata))
    save_lora_file(resized, args.save_to, metadata)
    retained = [result.fro_retained for result in results]
    print(f"saved {args.save_to}: {len(results)} modules, mean retained energy {sum(retained) / len(retained):.4%}, "
          f"lowest {min(retained):.4%} ({min(results, key=lambda r: r.fro_retained).name}), largest relative "
          f"error {max(result.relative_error for result in results):.3g}; "
          f"ranks {json.dumps(sorted({r.new_rank for r in results}))}")


if __name__ == "__main__":
    exit_on_user_error(main)
