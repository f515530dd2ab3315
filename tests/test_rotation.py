"""--save_last_n_* rotation, exactly as kohya-ss sd-scripts removes files and states.

The expected sets are derived here from kohya's own formulas (train_util.get_remove_step_no,
get_remove_epoch_no, save_and_remove_state_stepwise/_on_epoch_end): after saving step S it
removes the one save point at ``S - N - 1`` rounded down to a multiple of --save_every_n_steps
(N counts steps); after saving epoch E the one at ``E - save_every_n_epochs * N`` (N counts
saves); a *_state value that is not given falls back to the LoRA files' value. Real trainings
then have to leave exactly those files and states on disk.
"""
from __future__ import annotations

from typing import Optional

import pytest
from conftest import model_args, run_trainer


def kohya_kept_steps(last_step: int, every: int, keep: Optional[int]) -> set[int]:
    kept = set()
    for step in range(every, last_step + 1, every):
        kept.add(step)
        if keep is not None:
            removed = step - keep - 1
            kept.discard(removed - removed % every)
    return kept


def kohya_kept_epochs(num_epochs: int, every: int, keep: Optional[int]) -> set[int]:
    kept = set()
    for epoch in range(every, num_epochs, every):  # the last epoch is the final file, not an epoch save
        kept.add(epoch)
        if keep is not None:
            kept.discard(epoch - every * keep)
    return kept


def test_the_issue_example_by_kohya_formula():
    # --save_every_n_steps 2 --save_last_n_steps_state 2: at step 8 kohya removes step 4 and keeps 6 and 8
    assert kohya_kept_steps(8, every=2, keep=2) == {6, 8}
    assert kohya_kept_steps(8, every=2, keep=4) == {4, 6, 8}  # N counts steps: 4 steps back is still kept
    assert kohya_kept_epochs(8, every=2, keep=2) == {4, 6}  # N counts saves


# (epochs, save_every_n_steps, save_last_n_steps, save_last_n_steps_state,
#  save_every_n_epochs, save_last_n_epochs, save_last_n_epochs_state)
ROWS = [
    (8, 2, None, 2, 1, 3, None),  # the issue's example; epoch states fall back to --save_last_n_epochs
    (8, 2, 4, None, 2, 2, 1),  # step states fall back to --save_last_n_steps
    (9, 3, 4, 1, 2, None, 2),  # N not a multiple of every: rounded down; epoch files all kept, states rotated
]


@pytest.mark.parametrize("row", ROWS, ids=[f"row{index}" for index in range(len(ROWS))])
def test_rotation_leaves_exactly_what_kohya_leaves(row, tiny_models, demo_dataset, tmp_path):
    epochs, step_every, last_steps, last_steps_state, epoch_every, last_epochs, last_epochs_state = row
    output_dir = tmp_path / "out"
    optional = {"--save_last_n_steps": last_steps, "--save_last_n_steps_state": last_steps_state,
                "--save_last_n_epochs": last_epochs, "--save_last_n_epochs_state": last_epochs_state}
    run_trainer("sdxl_train_network", model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(demo_dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--output_name", "run", "--max_data_loader_n_workers", "0",
        "--network_train_unet_only", "--seed", "1",
        "--train_batch_size", "4",  # the 4 images are one step: epoch E ends at step E
        "--max_train_epochs", str(epochs), "--save_state",
        "--save_every_n_steps", str(step_every), "--save_every_n_epochs", str(epoch_every),
        *[item for flag, value in optional.items() if value is not None for item in (flag, str(value))],
    ])
    state_steps = last_steps_state or last_steps  # kohya's fallback
    state_epochs = last_epochs_state or last_epochs
    expected_files = {"run.safetensors"}
    expected_files |= {f"run-step{step:08d}.safetensors" for step in kohya_kept_steps(epochs, step_every, last_steps)}
    expected_files |= {f"run-{epoch:06d}.safetensors" for epoch in kohya_kept_epochs(epochs, epoch_every, last_epochs)}
    expected_states = {f"run-step{step:08d}-state" for step in kohya_kept_steps(epochs, step_every, state_steps)}
    expected_states |= {f"run-{epoch:06d}-state" for epoch in kohya_kept_epochs(epochs, epoch_every, state_epochs)}
    expected_states.add("run-state")  # kohya: --save_state also saves the state at the end, never rotated
    on_disk = {path.name for path in output_dir.iterdir()}
    assert {name for name in on_disk if name.endswith(".safetensors")} == expected_files
    assert {name for name in on_disk if name.endswith("-state")} == expected_states
    if row == ROWS[0]:  # spelled out once: the issue's example
        assert {name for name in on_disk if name.startswith("run-step")} == {
            "run-step00000002.safetensors", "run-step00000004.safetensors", "run-step00000006.safetensors",
            "run-step00000008.safetensors", "run-step00000006-state", "run-step00000008-state"}
