"""Fixed batches encoded once: the batches a run scores again and again with the same inputs.

Three things score the same batches many times: a validation pass (the validation set, at every
validation), the effect monitor's training probe (at every check step) and the learning-rate finder
(its probe, after every finder step), each at kohya's 4 fixed timesteps. What the frozen models make
of those batches never changes, so it is computed once, at the first pass, and kept:

* the VAE's latent distribution (mean and std, unscaled, float32) instead of the images: the VAE
  trains in no trainer here; each pass still draws its keyed latent sample from it, as without it;
* the text encoders' conditioning instead of the captions, when nothing in the text encoders'
  forward can change (``LossContext.text_encoding_fixed``: decided from what the run trains, see
  ``Trainable.changes_text_conditioning``); otherwise the captions are encoded at every pass.

Both are computed with the loss path's own calls under its autocast
(``library.training.diffusion_loss.encode_fixed_batch``), so a pass on an encoded batch gives the
same bits as a pass on the batch itself (tested). Memory: per image its latent mean and std
(2 x 4 x H/8 x W/8 float32: 512 KiB at 1024 px, 2 KiB at 64 px) and, when kept, its conditioning
(SDXL: 77 x 2048 hidden + 1280 pooled values, 0.6 MiB in float32, per caption), where the batch was
(the validation set's on the CPU, the probes' on the device); the images themselves are not kept.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Optional

Batch = dict[str, Any]


class FixedBatches:
    """``source``'s batches, each passed through ``encode`` at the first use and kept; ``encode`` None:
    nothing can be encoded once (e.g. inpainting draws its masked images anew), the batches are read
    from ``source`` at every pass as they are (nothing kept)."""

    def __init__(self, source: Iterable[Batch], encode: Optional[Callable[[Batch], Batch]]) -> None:
        self._source: Optional[Iterable[Batch]] = source
        self.encode = encode
        self._encoded: Optional[list[Batch]] = None

    def batches(self) -> Iterable[Batch]:
        """The batches to score (encoded at the first call when ``encode`` is given)."""
        if self.encode is None:
            return self._source
        if self._encoded is None:
            self._encoded = [self.encode(batch) for batch in self._source]
            self._source = None  # its images are not kept
        return self._encoded

    def __iter__(self) -> Iterator[Batch]:
        return iter(self.batches())

    def __len__(self) -> int:
        return len(self.batches())

    def __getitem__(self, index: int) -> Batch:
        return self.batches()[index]
