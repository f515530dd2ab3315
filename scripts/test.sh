#!/usr/bin/env bash
# Set up and run the test suite (what CI runs). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh requirements-dev.txt
export HF_HUB_OFFLINE=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Two workers, each taking whole test files (module fixtures are built once), one intra-op thread each.
# Time: CI took 44 minutes (2643 s) on a fresh 2-core machine with a cold inductor cache before the slow
# matrices were cut to their distinct cases (`--full_matrix` runs them whole) and the imported objects were
# frozen for the garbage collector; those cut ~5 CPU-minutes, but the training core's trainers (full
# fine-tuning, textual inversion, inpainting) then added ~100 tests: the merged suite ran 59 minutes on a
# 2-core machine partly shared with other jobs, far over the 15-minute target. --durations lists the
# slowest tests for the next cuts. Then the runs that need no process of their own (references, resumes,
# one-process comparisons) moved into the test's process and rarely-informative cases behind --full_matrix;
# what costs most in a tiny run now (py-spy, an 8-step fp16 SDXL LoRA run): the tiny VAE's 64 px encoder (69% of
# the samples; the latents are not cached) and the effect monitor's probe (49%: at each check, every quarter of
# a short run, it encodes its batch once per fixed timestep, twice at the first check for the base model).
# The merged suite of stop 36 (LECO, fused backward, healthy point, GUI Dreambooth/Finetuning replays: 1385 tests) ran
# 54 minutes (3215 s) on this 2-core machine, not shared. Stop 37: validation, the monitor's probe and the LR finder
# encode their fixed batches once (the probe's re-encoding was the 49% above), --torch_compile compiles one graph
# (it compiled three) and the whole-run compile tests use aot_eager, and the runs that need no process of their own
# run in the test's process: 1395 tests in 34 minutes (2024 s) on this machine, not shared. The slowest now: the
# compile tests (121 s setup + 93 s), the healing runs (79, 57, 53 s), the NaN-on-one-rank two-process run (64 s).
# Extra arguments come after, so `-n 0` runs it in one process.
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=30 "$@"
