"""--grad_guard_preset stable trains every network type the kohya_ss GUI offers (16), in fp16 (loss scaler) and
bf16, on the tiny SDXL with the real trainer: every step trained (the fork's absolute 200000 skipped every step of
LyCORIS Full) and the training loss went down: the trained network's mean loss over the inputs it trained on
below the untrained network's (the same inputs: noise and timesteps are keyed by sample). The same runs as
``benchmarks/bench_network_types.py --stable_preset``."""
from __future__ import annotations

import pytest

from benchmarks.bench_network_types import (CONTROL_LEARNING_RATE, PRECISIONS, TYPES, stable_preset_run,
                                            trained_and_untrained_loss)

STEPS = 3


@pytest.fixture(scope="module")
def control(tiny_models, one_image_dataset, tmp_path_factory):
    runs = {}

    def get(precision: str):
        if precision not in runs:
            runs[precision] = stable_preset_run(tiny_models, one_image_dataset, "networks.lora (Standard)", precision,
                                                tmp_path_factory.mktemp(f"control_{precision}"), STEPS,
                                                CONTROL_LEARNING_RATE)
        return runs[precision]
    return get


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("label", list(TYPES))
def test_every_type_trains_under_the_stable_preset(label, precision, control, tiny_models, one_image_dataset, tmp_path):
    assert len(TYPES) == 16
    run, trained_loss, untrained_loss = trained_and_untrained_loss(tiny_models, one_image_dataset, label, precision,
                                                                   tmp_path, STEPS, control(precision))
    assert run.trained == STEPS, run.last_line
    assert run.last_line.startswith("done:") and "skipped: guard 0," in run.last_line
    assert trained_loss < untrained_loss
