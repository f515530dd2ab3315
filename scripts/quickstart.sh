#!/usr/bin/env bash
# Set up, build the tiny SDXL model and a generated dataset, and train an SDXL LoRA in
# fp16 with a GradScaler and the gradient guard's stable preset. Output: quickstart_output/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh requirements.txt
export HF_HUB_OFFLINE=1
# The tiny model gains nothing from more threads, and spinning OpenMP threads slow a busy
# 2-core machine down badly.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
OUT=quickstart_output
.venv/bin/python tools/build_tiny_models.py --out "$OUT/models"
.venv/bin/python tools/make_demo_dataset.py --out "$OUT/dataset"
.venv/bin/python sdxl_train_network.py \
    --pretrained_model_name_or_path "$OUT/models/sdxl.safetensors" \
    --model_config_dir "$OUT/models/sdxl_config" \
    --train_data_dir "$OUT/dataset" --caption_extension .txt --resolution 64 \
    --output_dir "$OUT/lora" --output_name quickstart_lora \
    --network_dim 16 --network_alpha 16 --network_args conv_dim=16 conv_alpha=16 \
    --learning_rate 5e-3 --optimizer_type AdamW \
    --mixed_precision fp16 --max_train_steps 40 --seed 42 --max_data_loader_n_workers 0 \
    --grad_guard_preset stable --save_every_n_steps 20 --logging_dir "$OUT/logs"
echo "LoRA written to $OUT/lora/quickstart_lora.safetensors; gradient log: $OUT/lora/gradient_logs+quickstart_lora.txt"
