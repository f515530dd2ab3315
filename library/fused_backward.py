"""Fused backward: each parameter's update applied inside the backward pass, so no full gradient is held.

kohya's ``--fused_backward_pass`` (Adafactor, one parameter at a time) and ``--fused_optimizer_groups N``
(N optimizers, each stepped as soon as its parameters' gradients are ready), with this project's
gradient guard, fp16 loss scaler and ``--max_grad_norm`` still deciding from the **whole step's**
gradient. Design and measured cost: ``docs/fused_backward.md``. In short, two backward passes over one
retained graph:

1. :meth:`FusedBackward.measure` runs ``backward(retain_graph=True)``. A hook on every trainable
   parameter, called as soon as its gradient is complete, reads from it what the step's decisions need
   and drops it: its L2 norm as the guard measures it, its dot product with the previous step's
   gradient (``--grad_cosine_log``), whether it is finite once unscaled (the scaler's overflow check)
   and its unscaled norm as ``clip_grad_norm_`` takes it. One host sync then gives the step's
   :class:`library.grad_guard.GradientMeasurement`. The gradients that complete last (the blocks
   nearest the input, the time embedding) are kept instead of dropped, up to a memory budget
   (``--fused_backward_kept_gradient_gib``; default half of the memory available).
2. The loop decides exactly as without fusing (guard, healing), then calls :meth:`FusedBackward.apply`:
   the scaler is told the overflow bit (:meth:`library.loss_scaling.LossScaler.record_step`); on an
   overflow, or when the loop calls :meth:`FusedBackward.discard` instead, the kept gradients and the
   graph are dropped (nothing changes). Otherwise a second backward over the other parameters only
   (``inputs=``: autograd skips the part of the graph only the kept ones need, e.g. the down blocks'
   recomputation and backward) whose hooks unscale each gradient, multiply it by the whole step's clip
   coefficient, step the optimizer for that parameter (or for its group once the group is complete) and
   drop it; then the kept gradients are applied the same way. When every gradient was kept there is no
   second backward.

The same gradients reach the optimizer, through the same operations, as in an unfused step (unscale,
``clip_grad_norm_``, ``optimizer.step()``), so the weights are the unfused run's to float32 rounding
(bit-identical in the tests; a kept gradient is the tensor the second pass would compute again). The
global RNG state is restored before the second pass, so the state after the step is a single backward's. Needs ``--gradient_accumulation_steps 1`` and one process (as
kohya's); see :class:`FusedOptions`.

The loop, per optimizer step::

    fused = FusedBackward(optimizers, per_parameter=options.fused_backward_pass,
                          max_grad_norm=args.max_grad_norm, scaler=scaler, cosine=..., unscaled=...)
    ...
    measured = fused.measure(scaler.scale(loss) if scaler else loss, loss_value=loss.detach(), riders=...)
    decision = guard.decide(step, measured.norm)
    if decision.skip:
        fused.discard()                       # no optimizer, scheduler or scaler step
    else:
        stepped = fused.apply()               # False: the scaler found inf/NaN; nothing updated
        if scaler is not None:
            scaler.update()
        if stepped:
            for scheduler in lr_schedulers:   # one per optimizer with --fused_optimizer_groups
                optimizers.step_schedule(scheduler, measured.loss)
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import math
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy
import psutil
import torch

from library.errors import UserError
from library.grad_guard import GradientMeasurement, GradientMonitor, _flat_norm

logger = logging.getLogger(__name__)

Backward = Callable[[torch.Tensor, bool, Optional[Sequence[torch.Tensor]]], None]
"""``backward(tensor, retain_graph, inputs)``: how the loop runs a backward (e.g. through accelerate);
``inputs`` as ``torch.Tensor.backward`` takes it (None: every leaf)."""

KEPT_GRADIENT_MEMORY_SHARE = 0.5
"""The automatic budget for the gradients the measuring pass keeps is at most this share of the memory
available (on the device) when a step's measuring pass starts: its activations are then alive, so what
is left is what the backward can use. Kept gradients only live until the step's update (the next
forward allocates after they are freed), so the other half is a margin for the backward's own
temporaries (a recomputed block, the optimizer's float32 copy of one parameter) and for other
processes; the budget is taken again at every step, so a larger batch later gets less."""

KEPT_GRADIENT_SHARE = 0.2
"""... and at most this share of the trainable parameters' gradient bytes. The gradients that complete
last are the input side's (a UNet's high-resolution levels: few parameters, the largest activations),
so a small share of the bytes skips most of what the applying pass would recompute, and keeping more
buys little time for its memory. Measured on a full-size SDXL UNet, --full_bf16, checkpointing, 256 px
(docs/full_fine_tuning.md): 1 GiB of 4.78 kept (21%) gave the step 0.86x kohya's at 0.98x its RSS while
training; every gradient kept (4.78 GiB) was no faster and held 1.3x kohya's; none kept, 1.16x its
step time."""


# --------------------------------------------------------------------------- options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register ``--fused_backward_pass`` and ``--fused_optimizer_groups`` (kohya's names and defaults)."""
    group = parser.add_argument_group(
        "fused backward", "Apply the optimizer during the backward pass so that no full gradient is held.")
    group.add_argument(
        "--fused_backward_pass", action="store_true",
        help="apply Adafactor's update to each parameter as soon as its gradient is ready, then free the gradient: "
             "no full gradient in memory (bf16 weights: stochastic rounding, as kohya). The gradient guard, the fp16 "
             "loss scaler and --max_grad_norm still see the whole step's gradient: a first backward measures it, a "
             "second one (same graph, pruned to the gradients the first did not keep: "
             "--fused_backward_kept_gradient_gib) applies the update (a full-size SDXL UNet's step: 0.9x kohya's "
             "fused one on a CPU; docs/fused_backward.md). Needs --optimizer_type Adafactor and "
             "--gradient_accumulation_steps 1. Default: off")
    group.add_argument(
        "--fused_optimizer_groups", type=int, default=None, metavar="N",
        help="split the trainable parameters into N groups (kohya's split), each stepped as an optimizer of its own "
             "as soon as its parameters' gradients are ready, then freed: 1/N to about 2/N of the gradient in memory "
             "(a group waits for its last gradient), any optimizer. Same "
             "two-pass guard as --fused_backward_pass, which wins when both are given. Needs "
             "--gradient_accumulation_steps 1. Default: off (0 too)")
    group.add_argument(
        "--fused_backward_kept_gradient_gib", type=float, default=None, metavar="GIB",
        help="with --fused_backward_pass / --fused_optimizer_groups: the most gradient memory (GiB) the measuring "
             "backward may keep for the update instead of dropping it: the gradients that complete last (the "
             "layers nearest the input, the time embedding), so the applying backward skips their part of the "
             "graph (a full-size SDXL UNet's down blocks: ~1.5 GiB in bf16, about a third of that backward). The "
             "same weights either way. 0: keep none (kohya's memory: no gradient held). Default: auto, the smaller of "
             f"{KEPT_GRADIENT_SHARE * 100:.0f}%% of the trainable gradients' size and "
             f"{KEPT_GRADIENT_MEMORY_SHARE * 100:.0f}%% of "
             "the memory available when each step's backward starts")


@dataclasses.dataclass(frozen=True)
class FusedOptions:
    """``--fused_backward_pass`` / ``--fused_optimizer_groups``, checked. ``groups`` is None unless the
    optimizer-groups mode is in force (``--fused_backward_pass`` wins over it, as in kohya)."""

    fused_backward_pass: bool = False
    groups: int | None = None
    kept_gradient_gib: float | None = None
    """``--fused_backward_kept_gradient_gib``: None is the automatic budget (:func:`kept_gradient_budget`)."""

    @property
    def enabled(self) -> bool:
        return self.fused_backward_pass or self.groups is not None

    @property
    def flag(self) -> str:
        """The option in force, as the user wrote it (for messages)."""
        return "--fused_backward_pass" if self.fused_backward_pass else f"--fused_optimizer_groups {self.groups}"

    @classmethod
    def from_args(cls, args: argparse.Namespace, optimizer_type: str,
                  announce: Callable[[str], None] = logger.warning) -> FusedOptions:
        """Read and check the options; ``optimizer_type`` as ``library.optimizers.effective_optimizer_type``
        gives it. Raises ``UserError`` (before any model loads) for a combination that cannot work."""
        per_parameter = bool(getattr(args, "fused_backward_pass", False))
        groups = getattr(args, "fused_optimizer_groups", None)
        if groups is not None and (isinstance(groups, bool) or not isinstance(groups, int) or groups < 0):
            raise UserError(f"--fused_optimizer_groups must be a whole number >= 1 (0: off), got {groups!r}")
        groups = groups or None
        if per_parameter and groups is not None:
            announce(f"--fused_optimizer_groups {groups} is ignored: --fused_backward_pass is given (as in kohya)")
            groups = None
        kept = getattr(args, "fused_backward_kept_gradient_gib", None)
        if kept is not None and not (math.isfinite(kept) and kept >= 0):
            raise UserError(f"--fused_backward_kept_gradient_gib must be a size in GiB >= 0 (0: keep none), got {kept}")
        options = cls(per_parameter, groups, kept)
        if kept is not None and not options.enabled:
            announce("--fused_backward_kept_gradient_gib: no effect without --fused_backward_pass or "
                     "--fused_optimizer_groups")
        if per_parameter and optimizer_type.rsplit(".", 1)[-1].lower() != "adafactor":
            raise UserError(f"--fused_backward_pass needs --optimizer_type Adafactor (got {optimizer_type}); "
                            f"for another optimizer use --fused_optimizer_groups N")
        if options.enabled and int(getattr(args, "gradient_accumulation_steps", 1) or 1) != 1:
            raise UserError(f"{options.flag} needs --gradient_accumulation_steps 1 (got "
                            f"{args.gradient_accumulation_steps}): accumulating would hold the full gradient")
        if options.enabled and getattr(args, "debug_inject_grad", None):
            raise UserError(f"--debug_inject_grad with {options.flag}: the gradients are applied during the "
                            f"backward, there is no moment to write into them; inject into the loss instead")
        return options


def split_into_groups(param_groups: Sequence[Mapping[str, Any]], count: int) -> list[dict[str, Any]]:
    """kohya's ``--fused_optimizer_groups`` split: the parameter tensors, in order, in runs of at most
    ``ceil(total / count)``; a change of learning rate also starts a new run (so there may be more than
    ``count``). Each run becomes ``{"params": [...], "lr": lr}``, the param groups of one optimizer (kohya
    keeps only ``lr`` of each group's settings)."""
    total = sum(len(group["params"]) for group in param_groups)
    per_run = max(1, math.ceil(total / count))
    runs: list[dict[str, Any]] = []
    current: list[torch.Tensor] = []
    current_lr: Any = None
    for group in param_groups:
        for parameter in group["params"]:
            if current and group["lr"] != current_lr:
                runs.append({"params": current, "lr": current_lr})
                current = []
            current_lr = group["lr"]
            current.append(parameter)
            if len(current) == per_run:
                runs.append({"params": current, "lr": current_lr})
                current = []
    if current:
        runs.append({"params": current, "lr": current_lr})
    return runs


# --------------------------------------------------------------------------- stepping one parameter


def step_one_parameter(optimizer: torch.optim.Optimizer, group: dict[str, Any], parameter: torch.Tensor) -> None:
    """``optimizer.step()`` for ``parameter`` alone (its ``.grad`` set), with ``group``'s settings: the
    optimizer's own step code on a one-parameter view of its groups, so the result and the state (keyed
    by the parameter, as usual) are an ordinary step's. Right for optimizers whose update of a
    parameter depends only on that parameter (Adafactor, AdamW, SGD, Lion), not for those that pool
    statistics over all of them (Prodigy, D-Adaptation)."""
    saved_params = group["params"]
    group["params"] = [parameter]
    try:
        step_groups(optimizer, [group])
    finally:
        group["params"] = saved_params


def step_groups(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """``optimizer.step()`` seeing only ``groups`` (some of its own): the state stays the optimizer's."""
    saved_groups = optimizer.param_groups
    optimizer.param_groups = groups
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = saved_groups


class GroupStep:
    """Param group ``index`` of ``optimizer`` stepped as an optimizer of its own: ``--fused_optimizer_groups``
    with one optimizer holding kohya's split (:func:`split_into_groups`) instead of N optimizers. Each group
    keeps its settings and state in the one optimizer, so one LR schedule, one state and the healing's
    learning-rate changes cover them all; the update is that of an optimizer holding this group alone
    (kohya's N optimizers), for any optimizer whose statistics live in its param groups and per-parameter
    state. The group is looked up at each step (``load_state_dict`` replaces the group dicts)."""

    def __init__(self, optimizer: torch.optim.Optimizer, index: int) -> None:
        self.optimizer = optimizer
        self.index = index

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [self.optimizer.param_groups[self.index]]

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self) -> None:
        step_groups(self.optimizer, self.param_groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for parameter in self.param_groups[0]["params"]:
            parameter.grad = None


def group_steps(optimizer: torch.optim.Optimizer) -> list[GroupStep]:
    """One :class:`GroupStep` per param group of ``optimizer`` (what :class:`FusedBackward` steps as optimizers)."""
    return [GroupStep(optimizer, index) for index in range(len(optimizer.param_groups))]


def stochastic_round_to_bfloat16_(target: torch.Tensor, source: torch.Tensor, seed: int) -> None:
    """Write float32 ``source`` into bfloat16 ``target``, rounding up with probability equal to the
    dropped fraction (unbiased: E[target] = source), as kohya's fused Adafactor does for bf16 weights.
    A bfloat16 is a float32's upper 16 bits: add a uniform 16-bit integer to the lower bits, keep the
    upper ones. The draws are keyed by ``seed`` alone (the global RNG is not touched).

    On the CPU the 16-bit draws are the raw output of numpy's PCG64, four per 64-bit word: torch's CPU
    ``randint`` (kohya's ``copy_stochastic_``) draws them one at a time, through a modulo, on one core:
    about 18 ns each, 38% of a full-size SDXL step (`--full_bf16 --fused_backward_pass`) on a 2-core CPU;
    the whole rounding is now about 4x faster (benchmarks/bench_stochastic_rounding.py). PCG64 is integer
    arithmetic only, so a seed gives the same bits on any CPU. Elsewhere (CUDA) a torch generator on the
    device draws them (a parallel generator there)."""
    count = source.numel()
    if source.device.type == "cpu":
        words = numpy.random.PCG64(seed).random_raw((count + 3) // 4)
        bits = torch.from_numpy(words.view(numpy.uint16)[:count]).to(torch.int32)
    else:
        generator = torch.Generator(device=source.device).manual_seed(seed)
        bits = torch.randint(0, 1 << 16, (count,), dtype=torch.int32, device=source.device, generator=generator)
    bits.add_(source.contiguous().view(-1).view(torch.int32))
    bits.bitwise_right_shift_(16)  # arithmetic: the upper 16 bits, sign included, each fits an int16
    target.view(torch.int16).copy_(bits.view(target.shape))


def available_memory_bytes(device: torch.device) -> int:
    """Memory a new tensor on ``device`` can take now: the CUDA device's free memory plus what torch's
    caching allocator holds unused; elsewhere the system's available memory (``psutil``)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return psutil.virtual_memory().available


def kept_gradient_budget(kept_gradient_gib: float | None, device: torch.device) -> Callable[[int], int]:
    """The measuring pass's budget for kept gradients, in bytes, asked for at each step with the trainable
    parameters' gradient bytes: ``kept_gradient_gib`` GiB, or (None: automatic) the smaller of
    :data:`KEPT_GRADIENT_SHARE` of those bytes and :data:`KEPT_GRADIENT_MEMORY_SHARE` of the memory
    available on ``device`` at that moment."""
    if kept_gradient_gib is not None:
        fixed = int(kept_gradient_gib * 2**30)
        return lambda gradient_bytes: fixed
    return lambda gradient_bytes: int(min(KEPT_GRADIENT_SHARE * gradient_bytes,
                                          KEPT_GRADIENT_MEMORY_SHARE * available_memory_bytes(device)))


def _is_adafactor(optimizer: torch.optim.Optimizer) -> bool:
    return type(optimizer).__name__ == "Adafactor" and type(optimizer).__module__.startswith("transformers")


def _rounding_seed(seed: int, index: int, step: int) -> int:
    """One generator seed per (run seed, parameter, step of that parameter): the same draws on a resumed
    run, whatever order the backward visits the parameters in."""
    return (seed * 1_000_003 + index * 7_919 + step * 104_729) % (2**63 - 1)


# --------------------------------------------------------------------------- the fused backward


class FusedBackward:
    """Hooks on the trainable parameters of ``optimizers`` that measure, then apply, one step's gradient
    without ever holding all of it (see the module docstring for the call order).

    * ``per_parameter=True`` (``--fused_backward_pass``): each parameter is stepped alone as its gradient
      completes (:func:`step_one_parameter`); with transformers' Adafactor, bfloat16 weights are updated
      in float32 and stochastically rounded (as kohya), with draws keyed by ``rounding_seed``, the
      parameter and its step. At most one parameter's gradient is held.
    * ``per_parameter=False`` (``--fused_optimizer_groups``): each optimizer steps (``step()`` then
      ``zero_grad(set_to_none=True)``) once every one of its parameters has its gradient; at most about a
      group's gradient is held. A group some of whose parameters got no gradient steps at the end of
      the pass, without them (as an unfused optimizer skips a parameter whose ``.grad`` is None).
    * ``max_grad_norm``: ``clip_grad_norm_`` over all trainable parameters with the whole step's norm
      (kohya's fused paths clip each tensor on its own; this is the unfused semantics).
    * ``kept_gradient_bytes``: the budget (bytes, or a function of the trainable parameters' gradient
      bytes giving it at each step) for gradients the measuring pass keeps for :meth:`apply` instead of
      dropping them: the ones that complete last, as many as fit (a gradient completing beyond the
      budget pushes out the earliest kept). The second pass then computes only the other parameters'
      gradients (``backward(inputs=...)``) and the kept ones are applied after it (a block it
      recomputes may read a kept parameter's weights). 0: the second pass computes every gradient again. Pruning the graph
      needs non-reentrant checkpointing (diffusers' and transformers' default) where checkpointing is on.
    * ``scaler``: a :class:`library.loss_scaling.LossScaler`; the loss given to :meth:`measure` is then
      the scaled one. ``cosine``: keep the previous step's gradient for the cosine log (a flat float32
      buffer as large as the trainable parameters: the memory of one full gradient). ``unscaled``:
      ``--grad_norm_unscaled``. ``backward``: how to run a backward (default ``tensor.backward``).

    Outside :meth:`measure`/:meth:`apply`/:meth:`discard` the hooks do nothing (a backward elsewhere
    accumulates gradients as usual). Single process only: all-reducing gradients that are dropped as
    they appear is not supported.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer], *, per_parameter: bool,
                 max_grad_norm: float | None = None, scaler: Any = None, cosine: bool = False,
                 unscaled: bool = False, rounding_seed: int = 0, backward: Backward | None = None,
                 kept_gradient_bytes: int | Callable[[int], int] = 0) -> None:
        distributed = torch.distributed
        if distributed.is_available() and distributed.is_initialized() and distributed.get_world_size() > 1:
            raise UserError("--fused_backward_pass / --fused_optimizer_groups work with one process only "
                            f"(this run has {distributed.get_world_size()})")
        if per_parameter and len(optimizers) != 1:
            raise ValueError("per_parameter fusing takes one optimizer")
        self.optimizers = list(optimizers)
        self.per_parameter = per_parameter
        self.max_grad_norm = float(max_grad_norm) if max_grad_norm else None
        self.scaler = scaler
        self.cosine = cosine
        self.unscaled = unscaled
        self.rounding_seed = int(rounding_seed)
        self._backward = backward or (lambda tensor, retain, inputs: tensor.backward(retain_graph=retain,
                                                                                     inputs=inputs))
        self._kept_budget = kept_gradient_bytes if callable(kept_gradient_bytes) else (lambda _: kept_gradient_bytes)

        # (parameter, its optimizer index, its group's index) in optimizer/group order: the order
        # clip_grad_norm_ and the guard see the parameters in an unfused step. The group dict itself is
        # looked up at each step: an optimizer's load_state_dict (resume, rewind) replaces it.
        self._entries: list[tuple[torch.Tensor, int, int]] = []
        seen: set[int] = set()
        for optimizer_index, optimizer in enumerate(self.optimizers):
            for group_index, group in enumerate(optimizer.param_groups):
                for parameter in group["params"]:
                    if parameter.requires_grad and id(parameter) not in seen:
                        seen.add(id(parameter))
                        self._entries.append((parameter, optimizer_index, group_index))
        devices = {parameter.device for parameter, _, _ in self._entries}
        if len(devices) > 1:
            raise ValueError(f"FusedBackward needs the trainable parameters on one device, got {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        self.parameters = [parameter for parameter, _, _ in self._entries]
        self.numel = sum(parameter.numel() for parameter in self.parameters)
        self._gradient_bytes = sum(parameter.numel() * parameter.element_size() for parameter in self.parameters)
        self._group_sizes = [0] * len(self.optimizers)
        for _, optimizer_index, _ in self._entries:
            self._group_sizes[optimizer_index] += 1
        self._stochastic_rounding = per_parameter and _is_adafactor(self.optimizers[0])
        if self._stochastic_rounding:
            _keep_state_dtypes(self.optimizers[0])

        # The guard's bookkeeping (previous gradient for the cosine, one-sync conclusion, state) is the
        # unfused monitor's; only the per-gradient reads happen here, in the hooks.
        self._monitor = GradientMonitor(self.parameters, cosine=cosine, unscaled=unscaled)
        self._previous_views = self._monitor.previous_views() if cosine else []
        self._guard_norms = torch.zeros(len(self._entries), dtype=torch.float32, device=self.device)
        self._dots = torch.zeros(len(self._entries), dtype=torch.float32, device=self.device) if cosine else None
        self._found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._apply_found_inf = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._inverse_scale: torch.Tensor | None = None
        self._clip_norms: dict[int, torch.Tensor] = {}
        self._clip_coefficient: torch.Tensor | None = None
        self._received = [False] * len(self._entries)
        self._pending_counts = [0] * len(self.optimizers)
        self._pending: tuple[torch.Tensor, Any] | None = None  # (loss tensor, RNG state) between the passes
        self._mode: str | None = None
        self.overflow = False
        """Whether the last :meth:`measure` found an inf/NaN unscaled gradient (always False without a scaler)."""
        self.peak_gradient_bytes = 0
        """The most gradient bytes the hooks held at once in the last :meth:`apply` (groups awaiting their step)."""
        self._held_bytes = 0
        self._keep_limit = 0
        self._kept: collections.deque[tuple[int, torch.Tensor]] = collections.deque()
        self._kept_bytes = 0
        self.kept_gradient_bytes = 0
        """The gradient bytes the last :meth:`measure` kept for the update (at most its budget)."""
        self.recomputed_gradients = 0
        """How many gradients the last :meth:`apply`'s second pass computed (the rest were kept)."""
        self._retained = True  # whether the last measuring pass retained the graph for a second one
        self._outer_task: int | None = None  # the measuring backward's autograd graph task
        self._reentrant = False  # a nested backward (reentrant checkpointing) ran during the measuring pass
        self._apply_computed: list[bool] = []  # per parameter: its gradient comes from the second pass
        self._handles = [parameter.register_post_accumulate_grad_hook(self._hook(index))
                         for index, parameter in enumerate(self.parameters)]

    # -- the step
    def measure(self, loss: torch.Tensor, *, loss_value: torch.Tensor | None = None,
                riders: torch.Tensor | None = None) -> GradientMeasurement:
        """First pass: ``backward(loss, retain_graph=True)`` measuring each gradient and dropping it (or
        keeping it, within the budget; when every gradient fits, the graph is not retained: there will be
        no second pass).
        ``loss``: what the unfused step would backward (the scaled loss with a scaler). ``loss_value``
        (0-dim) and ``riders`` (1-D) are read in the same single host sync, as
        :meth:`library.grad_guard.GradientMonitor.measure` does; the result has its meaning. Follow it
        with exactly one of :meth:`apply` or :meth:`discard`."""
        if self._pending is not None:
            raise RuntimeError("FusedBackward.measure() called twice without apply() or discard() in between")
        if any(parameter.grad is not None for parameter in self.parameters):
            raise RuntimeError("FusedBackward.measure() needs the gradients cleared (a backward outside it "
                               "accumulated into them)")
        self._guard_norms.zero_()
        if self._dots is not None:
            self._dots.zero_()
        self._found_inf.zero_()
        self._clip_norms.clear()
        self._received = [False] * len(self._entries)
        self._kept.clear()
        self._kept_bytes = 0
        self._keep_limit = max(0, int(self._kept_budget(self._gradient_bytes)))
        scale = self.scaler.get_scale_tensor() if self.scaler is not None else None
        if scale is not None:
            self._inverse_scale = scale.double().reciprocal().float().to(self.device)  # as LossScaler.unscale_
        rng_state = _rng_state()
        # Reentrant checkpointing runs a nested backward per block, which refuses backward(inputs=...): the
        # root node's graph task, against the hooks' own, tells whether the second pass may be pruned.
        self._reentrant = False
        self._outer_task = None
        root = loss.grad_fn.register_prehook(self._note_outer_task) if loss.grad_fn is not None else None
        # every gradient fits: no second pass, so the backward frees the graph as it goes (as an unfused one)
        self._retained = self._gradient_bytes > self._keep_limit
        try:
            self._run("measure", loss, retain=self._retained)
        finally:
            if root is not None:
                root.remove()
        self._pending = (loss, rng_state)
        self.kept_gradient_bytes = self._kept_bytes
        if self.cosine:
            for index, received in enumerate(self._received):
                if not received:  # no gradient counts as zero, as in GradientMonitor
                    self._previous_views[index].zero_()
        self._clip_coefficient = self._whole_step_clip_coefficient()

        guard_norm = torch.linalg.vector_norm(self._guard_norms)
        dot = self._dots.sum() if self._dots is not None and self._monitor.has_previous else None
        # the overflow flag rides first among the riders: the same single host sync
        flags = self._found_inf.reshape(1)
        if riders is not None:
            flags = torch.cat([flags, riders.detach().reshape(-1).to(self.device, torch.float32)])
        measured = self._monitor.conclude(guard_norm, dot, scale, loss_value, flags)
        self.overflow = measured.riders[0] > 0
        return dataclasses.replace(measured, riders=measured.riders[1:])

    def apply(self) -> bool:
        """The update: clip with the whole step's coefficient, step and drop each gradient: the ones a
        second pass over the graph computes as they appear (unscaled there), then the kept ones (unscaled
        by the measuring pass). With a scaler, first tells it the step's overflow bit
        (``record_step``); on an overflow nothing is updated (the graph is dropped) and False is returned.
        Call ``scaler.update()`` after."""
        if self._pending is None:
            raise RuntimeError("FusedBackward.apply() needs measure() first")
        if self.scaler is not None and not self.scaler.record_step(self.overflow):
            self.discard()
            return False
        loss, rng_state = self._pending
        self._pending = None
        kept, self._kept = self._kept, collections.deque()
        self._kept_bytes = 0
        underlying = list({id(o): o for o in (getattr(o, "optimizer", o) for o in self.optimizers)}.values())
        state_sizes = [len(optimizer.state) for optimizer in underlying]
        self._pending_counts = [0] * len(self.optimizers)
        self._held_bytes = self.peak_gradient_bytes = 0
        computed = list(self._received)
        for index, _ in kept:
            computed[index] = False
        inputs = [parameter for parameter, needed in zip(self.parameters, computed) if needed]
        self.recomputed_gradients = 0
        self._apply_computed = computed
        _set_rng_state(rng_state)
        if inputs:  # else every gradient was kept: no second pass (the graph goes with the loss)
            if not self._retained:  # cannot happen: the budget held every trainable parameter's gradient
                raise RuntimeError("fused backward: a gradient was dropped from a graph that was not retained")
            # pruned to the gradients still needed, unless nothing was kept (every leaf, as an unfused
            # backward) or a reentrant checkpoint forbids it (then the hooks drop the kept ones' again)
            pruned = len(inputs) < sum(self._received) and not self._reentrant
            self._run("apply", loss, retain=False, inputs=inputs if pruned else None)
        del loss
        # The kept ones last: the second pass may recompute a checkpointed block with their weights, which
        # must still be the step's (a parameter stepped in its hook is one whose every use is behind).
        while kept:
            index, grad = kept.popleft()
            parameter = self.parameters[index]
            parameter.grad = grad
            del grad
            self._apply_one(index, parameter, unscaled=True)
        for optimizer_index, count in enumerate(self._pending_counts):
            if count:  # a group some of whose parameters got no gradient
                self._step_group(optimizer_index)
        for optimizer, size in zip(underlying, state_sizes):
            if len(optimizer.state) != size:  # first steps: the backward's order, put back in parameter order
                _order_state(optimizer, self.parameters)
        return True

    def discard(self) -> None:
        """Drop the kept gradients and the retained graph (no second pass), changing nothing: a step the
        guard or the healing policy skips (the scaler is not told), or a scaler overflow."""
        if self._pending is None:
            raise RuntimeError("FusedBackward.discard() needs measure() first")
        _, rng_state = self._pending
        self._pending = None  # the graph's saved tensors go with the loss, the caller's last reference
        self._kept.clear()
        self._kept_bytes = 0
        self.recomputed_gradients = 0
        _set_rng_state(rng_state)

    def remove(self) -> None:
        """Remove the hooks (the parameters then train unfused)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def monitor(self) -> GradientMonitor:
        """The guard's bookkeeping (what ``GradientMonitor.measure`` would return is built by it): its
        ``unscaled`` setting and state are the run's ``grad_monitor``."""
        return self._monitor

    # -- state (the cosine log's previous gradient; optimizers save their own)
    def state_dict(self) -> dict[str, Any]:
        """:meth:`library.grad_guard.GradientMonitor.state_dict`'s (the cosine log's previous gradient): a
        state saved by either loads in either."""
        return self._monitor.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._monitor.load_state_dict(state)

    # -- internals
    def _run(self, mode: str, loss: torch.Tensor, retain: bool,
             inputs: Optional[Sequence[torch.Tensor]] = None) -> None:
        self._mode = mode
        try:
            self._backward(loss, retain, inputs)
        finally:
            self._mode = None

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(parameter: torch.Tensor) -> None:
            if self._mode == "measure":
                self._measure_one(index, parameter)
            elif self._mode == "apply":
                self.recomputed_gradients += 1
                if self._apply_computed[index]:
                    self._apply_one(index, parameter, unscaled=False)
                else:  # kept (applied after this pass): an unpruned second pass computed it again
                    parameter.grad = None
        return hook

    def _note_outer_task(self, _: Any) -> None:
        self._outer_task = torch._C._current_graph_task_id()

    @torch.no_grad()
    def _measure_one(self, index: int, parameter: torch.Tensor) -> None:
        grad = parameter.grad
        if grad.is_sparse:
            raise RuntimeError("fused backward does not support sparse gradients")
        self._received[index] = True
        if torch._C._current_graph_task_id() != self._outer_task:
            self._reentrant = True
        flat = grad.reshape(-1)
        self._guard_norms[index] = _flat_norm(flat)  # the guard's norm: the scaled gradient
        if self._dots is not None:
            previous = self._previous_views[index]
            if self._monitor.has_previous:
                self._dots[index] = torch.dot(flat.float(), previous)
            previous.copy_(flat)
        if self.scaler is not None:  # the scaler's check, on a gradient that is dropped next anyway
            torch._amp_foreach_non_finite_check_and_unscale_([grad], self._found_inf, self._inverse_scale)
        if self.max_grad_norm is not None:
            self._clip_norms[index] = torch._foreach_norm([grad], 2.0)[0]  # as clip_grad_norm_, unscaled
        parameter.grad = None
        if self._keep_limit:  # the latest gradients, as many as fit: the ones the second pass can then skip
            self._kept.append((index, grad))
            self._kept_bytes += grad.numel() * grad.element_size()
            while self._kept_bytes > self._keep_limit:
                _, dropped = self._kept.popleft()
                self._kept_bytes -= dropped.numel() * dropped.element_size()

    @torch.no_grad()
    def _apply_one(self, index: int, parameter: torch.Tensor, unscaled: bool) -> None:
        """Clip, step and drop ``parameter``'s gradient; ``unscaled``: the measuring pass unscaled it (kept)."""
        grad = parameter.grad
        if self.scaler is not None and not unscaled:
            torch._amp_foreach_non_finite_check_and_unscale_([grad], self._apply_found_inf, self._inverse_scale)
        if self._clip_coefficient is not None:
            torch._foreach_mul_([grad], self._clip_coefficient)
        _, optimizer_index, group_index = self._entries[index]
        if self.per_parameter:
            group = self.optimizers[0].param_groups[group_index]
            self._held_bytes = grad.numel() * grad.element_size()
            self.peak_gradient_bytes = max(self.peak_gradient_bytes, self._held_bytes)
            self._step_parameter(index, parameter, group)
            parameter.grad = None
            return
        self._held_bytes += grad.numel() * grad.element_size()
        self.peak_gradient_bytes = max(self.peak_gradient_bytes, self._held_bytes)
        self._pending_counts[optimizer_index] += 1
        if self._pending_counts[optimizer_index] == self._group_sizes[optimizer_index]:
            self._step_group(optimizer_index)

    def _step_group(self, optimizer_index: int) -> None:
        optimizer = self.optimizers[optimizer_index]
        optimizer.step()
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if parameter.grad is not None:
                    self._held_bytes -= parameter.grad.numel() * parameter.grad.element_size()
        optimizer.zero_grad(set_to_none=True)
        self._pending_counts[optimizer_index] = 0

    def _step_parameter(self, index: int, parameter: torch.Tensor, group: dict[str, Any]) -> None:
        optimizer = self.optimizers[0]
        if not (self._stochastic_rounding and parameter.dtype == torch.bfloat16):
            step_one_parameter(optimizer, group, parameter)
            return
        # bf16 weight: Adafactor updates a float32 copy (the copy it makes anyway), which is then rounded
        # stochastically instead of to nearest. The state stays keyed by the parameter.
        working = parameter.detach().float()
        working.grad = parameter.grad.float()  # exact; Adafactor makes this copy itself otherwise
        state = optimizer.state[parameter]
        optimizer.state[working] = state
        try:
            step_one_parameter(optimizer, group, working)
        finally:
            del optimizer.state[working]
            working.grad = None
        stochastic_round_to_bfloat16_(parameter.data, working,
                                      _rounding_seed(self.rounding_seed, index, int(state.get("step", 0))))

    def _whole_step_clip_coefficient(self) -> torch.Tensor | None:
        """``clip_grad_norm_``'s coefficient from the per-parameter norms, combined as it combines them
        (grouped by dtype in first-seen order, parameter order within a group)."""
        if self.max_grad_norm is None or not self._clip_norms:
            return None
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for index in sorted(self._clip_norms):
            norm = self._clip_norms[index]
            by_dtype.setdefault(self.parameters[index].dtype, []).append(norm)
        norms = [norm for group in by_dtype.values() for norm in group]
        total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
        return torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)


def _keep_state_dtypes(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.load_state_dict`` keep each floating state tensor's saved dtype. torch casts them to
    their parameter's dtype; the fused Adafactor keeps a bfloat16 weight's statistics in float32 (it steps a
    float32 copy), so a resumed or rewound run would go on from statistics rounded to bfloat16, and differ
    from the uninterrupted one."""
    saved: dict[Any, dict[str, torch.Tensor]] = {}

    def before(_: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        saved.clear()
        for index, values in state_dict["state"].items():
            saved[index] = {key: value for key, value in values.items()
                            if isinstance(value, torch.Tensor) and value.is_floating_point()}

    def after(loaded: torch.optim.Optimizer) -> None:
        parameters = [parameter for group in loaded.param_groups for parameter in group["params"]]
        for index, values in saved.items():
            state = loaded.state[parameters[index]]
            for key, value in values.items():
                if state[key].dtype != value.dtype:  # a copy: the source may be a healthy point kept in memory
                    state[key] = value.to(device=state[key].device, copy=True)
        saved.clear()

    optimizer.register_load_state_dict_pre_hook(before)
    optimizer.register_load_state_dict_post_hook(after)


def _order_state(optimizer: torch.optim.Optimizer, parameters: Iterable[torch.Tensor]) -> None:
    """Put the optimizer's per-parameter states in parameter order (the backward creates them in its own
    order), so that ``state_dict()`` lists them as an unfused optimizer's does."""
    state = optimizer.state
    ordered = [(parameter, state[parameter]) for parameter in parameters if parameter in state]
    placed = {id(parameter) for parameter, _ in ordered}
    others = [(key, value) for key, value in state.items() if id(key) not in placed]
    state.clear()
    state.update(ordered)
    state.update(others)


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
