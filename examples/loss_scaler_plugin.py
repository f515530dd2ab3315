"""An example loss scale policy plugin: dynamic scaling with hysteresis.

Use it with::

    python sdxl_train_network.py ... --mixed_precision fp16 \\
        --loss_scaler examples/loss_scaler_plugin.py:HysteresisPolicy \\
        --loss_scaler_args init_scale=32768 hysteresis=3

Every overflow still skips its optimizer step (the scaler does that); this policy only lowers
the scale after ``hysteresis`` overflows without a growth in between, so one odd batch does not
halve the scale. A clean step grows the scale after ``growth_interval`` clean steps in a row and
refills the hysteresis budget when it grows. See docs/loss_scaling.md for the contract.
"""
from __future__ import annotations

from library.loss_scaling import ScalePolicy, register_loss_scaler


@register_loss_scaler("hysteresis")  # optional: also selectable as examples/loss_scaler_plugin.py:hysteresis
class HysteresisPolicy(ScalePolicy):
    """Halve the scale on every ``hysteresis``-th overflow, double it after ``growth_interval``
    clean steps in a row (never above ``max_scale``)."""

    # The counters that change during training: saved and restored with the train state.
    STATE_FIELDS = ("clean_steps", "overflows_left")

    def __init__(self, *, init_scale: float = 2.0**16, hysteresis: int = 2, growth_interval: int = 1000,
                 max_scale: float = 2.0**24) -> None:
        # The keyword arguments are the --loss_scaler_args keys; refuse bad values here, at start-up.
        if not (isinstance(hysteresis, int) and hysteresis >= 1):
            raise ValueError(f"hysteresis must be a whole number >= 1, got {hysteresis!r}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"growth_interval must be a whole number >= 1, got {growth_interval!r}")
        if not 0 < init_scale <= max_scale:
            raise ValueError(f"need 0 < init_scale <= max_scale, got {init_scale!r} and {max_scale!r}")
        self.init_scale = float(init_scale)
        self.hysteresis = hysteresis
        self.growth_interval = growth_interval
        self.max_scale = float(max_scale)
        self.clean_steps = 0
        self.overflows_left = hysteresis

    def initial_scale(self) -> float:
        return self.init_scale

    def next_scale(self, scale: float, overflow: bool) -> float:
        if overflow:
            self.clean_steps = 0
            self.overflows_left -= 1
            if self.overflows_left > 0:
                return scale  # tolerated: the step was skipped, the scale stays
            self.overflows_left = self.hysteresis
            return scale / 2
        self.clean_steps += 1
        if self.clean_steps < self.growth_interval:
            return scale
        self.clean_steps = 0
        self.overflows_left = self.hysteresis
        return min(scale * 2, self.max_scale)
