"""The trainable parameters' gradients in one flat buffer, with "no gradient" kept apart from "zero".

After the backward passes of an optimizer step, :meth:`FlatGradients.gather` copies every
gradient autograd produced into one flat buffer (one multi-tensor copy) and makes each such
parameter's ``.grad`` a view of it. Whatever reads all gradients at once then reads one tensor,
one kernel instead of one per parameter: the guard's norm and cosine, the all-reduce of several
processes; the loss scaler, clipping and the optimizer work on the views in place.

Autograd itself still allocates each gradient (and ``optimizer.zero_grad(set_to_none=True)``
still drops them): a gradient preset to a view would make every parameter's gradient
accumulation an extra in-place add, one kernel launch per parameter per backward, which is what
the buffer is meant to save on a host-bound GPU. That holds every gradient twice at the gather,
which a whole model cannot afford (a full-size SDXL UNet's bf16 gradients are 4.8 GiB): with
``accumulate_in_place`` (the full fine-tune's) :meth:`attach` presets each ``.grad`` to its zeroed
view before the step's first backward, autograd adds into it (``0 + g`` is ``g`` exactly, so the
values are the same), and :meth:`gather` has nothing to copy; every parameter then counts as having a
gradient (zero where none was computed), which is what a whole model's parameters all receive.

A parameter that received no gradient (DyLoRA's rank slices not drawn, a module skipped by module
dropout, a text encoder layer after the one whose output is used) keeps ``.grad`` None, as
without the buffer: optimizers skip such a parameter, while a zero gradient would still move
AdamW's moments and apply weight decay. Its slice of the buffer is zero, so sums and norms are
those of the gradients that exist.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch


def views_into(flat: torch.Tensor, parameters: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Consecutive slices of ``flat``, each shaped like its parameter."""
    views, offset = [], 0
    for parameter in parameters:
        views.append(flat[offset:offset + parameter.numel()].view(parameter.shape))
        offset += parameter.numel()
    return views


class FlatGradients:
    """A flat buffer for the gradients of ``parameters`` (those with ``requires_grad``, all of one device
    and dtype); :attr:`views` are its slices shaped like each parameter."""

    def __init__(self, parameters: Iterable[torch.Tensor], *, accumulate_in_place: bool = False) -> None:
        self.parameters = [p for p in dict.fromkeys(parameters) if p.requires_grad]
        self.accumulate_in_place = accumulate_in_place
        kinds = {(p.device, p.dtype) for p in self.parameters}
        if len(kinds) > 1:
            raise ValueError(f"FlatGradients needs the parameters on one device in one dtype, "
                             f"got {sorted(map(str, kinds))}")
        device, dtype = kinds.pop() if kinds else (torch.device("cpu"), torch.float32)
        self.numel = sum(p.numel() for p in self.parameters)
        # One slot per parameter after the gradients: "has a gradient" flags that an all-reduce sums
        # together with them (library.sharding).
        self._storage = torch.zeros(self.numel + len(self.parameters), dtype=dtype, device=device)
        self.flat = self._storage[:self.numel]
        self.views = views_into(self.flat, self.parameters)
        self._present = [False] * len(self.parameters)

    def attach(self) -> None:
        """With ``accumulate_in_place``: zero the buffer and make each ``.grad`` its view, so the step's
        backward passes accumulate into it (call before the step's first backward); otherwise nothing."""
        if not self.accumulate_in_place:
            return
        self.flat.zero_()
        for parameter, view in zip(self.parameters, self.views):
            parameter.grad = view

    def gather(self) -> None:
        """Copy the gradients into the buffer and point each ``.grad`` at its view; parameters without a
        gradient keep None and a zero slice. Call once per optimizer step, after the last backward."""
        if self.accumulate_in_place:  # frozen during the step (--stop_text_encoder_training): no gradient
            for parameter in self.parameters:
                if not parameter.requires_grad:
                    parameter.grad = None  # its slice stays the zero attach() wrote
        grads = [parameter.grad for parameter in self.parameters]
        self._present = [grad is not None for grad in grads]
        if not all(self._present):
            self.flat.zero_()
        pairs = [(view, grad) for view, grad in zip(self.views, grads) if grad is not None and grad is not view]
        if pairs:
            torch._foreach_copy_([view for view, _ in pairs], [grad for _, grad in pairs])
        for parameter, view, present in zip(self.parameters, self.views, self._present):
            if present:
                parameter.grad = view

    def all_have_gradients(self) -> bool:
        """Whether every parameter had a gradient at the last :meth:`gather`."""
        return all(self._present)

    def gradient_flags(self) -> torch.Tensor:
        """The flag slots after the gradients: 1 for each parameter that had a gradient at the last
        :meth:`gather`, 0 for the others (a view: summed over processes with :meth:`flat_with_flags`
        it counts the processes that computed each gradient)."""
        flags = self._storage[self.numel:]
        if self.all_have_gradients():
            flags.fill_(1)
        else:
            flags.copy_(torch.tensor(self._present, dtype=flags.dtype))
        return flags

    def flat_with_flags(self) -> torch.Tensor:
        """The gradients followed by the flag slots, one tensor (for one all-reduce)."""
        return self._storage

    def attach_received(self, counts: list[float]) -> None:
        """After summing over processes: give a view to each parameter without a gradient here that
        another process computed one for (``counts``: the summed :meth:`gradient_flags`)."""
        for index, count in enumerate(counts):
            if count and not self._present[index]:
                self.parameters[index].grad = self.views[index]
                self._present[index] = True
