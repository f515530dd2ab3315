"""--grad_guard_preset stable trains every network type the kohya_ss GUI offers (16) on the tiny SDXL with the
real trainer: every step trained (the fork's absolute 200000 skipped every step of LyCORIS Full). The training
loss goes down (the trained network's mean loss over the inputs it trained on below the untrained network's: the
same inputs, noise and timesteps are keyed by sample) for the types whose gradients are far from a LoRA's (Full,
GLoRA) and for a LoRA, in fp16 (loss scaler) and bf16. ``benchmarks/bench_network_types.py --stable_preset`` runs
the whole matrix (16 types x fp16/bf16, loss included), and so does ``pytest --full_matrix``; CI trains every
type in fp16 (the three whose loss is checked in that check's runs; LoCon in test_healing's quick-start runs)
and checks the loss of the three in fp16 and of Full in bf16 too, so the suite stays short."""
from __future__ import annotations

import pytest
from conftest import full_matrix

from benchmarks.bench_network_types import (CONTROL_LEARNING_RATE, PRECISIONS, TYPES, stable_preset_run,
                                            trained_and_untrained_loss)

STEPS = 3
LOSS_CHECKED = ("networks.lora (Standard)", "lycoris full", "lycoris glora")
# (type, precision): every step trained; the loss cases below assert that too
# networks.lora (LoCon) is networks.lora (Standard, loss-checked here) with 3x3 convs, which the quick start's
# command trains under the stable preset in fp16 in test_healing (conv_dim 16: every step trained but the
# quarantined one): its run here is --full_matrix's.
TRAINED_ELSEWHERE = ("networks.lora (LoCon)",)
STEP_CASES = [(label, precision) for precision in PRECISIONS for label in TYPES
              if full_matrix() or (precision == "fp16" and label not in LOSS_CHECKED + TRAINED_ELSEWHERE)]
LOSS_CASES = [(label, precision) for precision in PRECISIONS for label in LOSS_CHECKED
              if full_matrix() or precision == "fp16" or label == "lycoris full"]


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


def assert_every_step_trained(run) -> None:
    assert run.trained == run.steps, run.last_line
    assert run.last_line.startswith("done:") and "skipped: guard 0," in run.last_line


@pytest.mark.slow
@pytest.mark.parametrize(("label", "precision"), STEP_CASES)
def test_every_type_trains_every_step_under_the_stable_preset(label, precision, tiny_models, one_image_dataset,
                                                              tmp_path):
    assert len(TYPES) == 16 and set(LOSS_CHECKED) <= set(TYPES)
    assert_every_step_trained(stable_preset_run(tiny_models, one_image_dataset, label, precision, tmp_path, 2))


@pytest.mark.slow
@pytest.mark.parametrize(("label", "precision"), LOSS_CASES)
def test_the_loss_goes_down_under_the_stable_preset(label, precision, control, tiny_models, one_image_dataset,
                                                    tmp_path):
    run, trained_loss, untrained_loss = trained_and_untrained_loss(tiny_models, one_image_dataset, label, precision,
                                                                   tmp_path, STEPS, control(precision))
    assert_every_step_trained(run)
    assert trained_loss < untrained_loss
