"""kohya's SDXL name for ``networks/merge_lora.py`` (the GUI calls it for SDXL): the same tool, the same flags.

    python networks/sdxl_merge_lora.py --sd_model sdxl.safetensors --save_to merged.safetensors \
        --models a.safetensors --ratios 1.0 [--lbws JSON] [--concat] [--shuffle] [--no_metadata]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from library.errors import exit_on_user_error  # noqa: E402
from networks import merge_lora  # noqa: E402

if __name__ == "__main__":
    exit_on_user_error(lambda: merge_lora.main(prog="sdxl_merge_lora.py"))
