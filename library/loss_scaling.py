"""The loss scaler the project owns for fp16 (accelerate gives none on CPU)."""
from __future__ import annotations

from typing import Optional

import torch


def create_loss_scaler(mixed_precision: str, device: torch.device) -> Optional[torch.amp.GradScaler]:
    """A dynamic GradScaler for fp16 training on any device; None for fp32/bf16."""
    if mixed_precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)
