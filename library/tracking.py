"""Step scalars for scripts and GUIs: a JSON-lines file next to accelerate's trackers."""
from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping, Optional


class JsonlLog:
    """Appends one JSON object per optimizer step (``{"step": N, ...scalars}``) to ``path``.

    Each line is flushed when written, so a tailing GUI sees it at once. A resumed run
    first drops the lines of steps after the resumed step, so every step appears once.
    NaN/Inf are written as strings ("nan", "inf") to keep every line valid JSON.
    """

    def __init__(self, path: str, resume_step: Optional[int] = None) -> None:
        self.path = path
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        kept = []
        if resume_step is not None and os.path.exists(path):
            with open(path, encoding="utf-8") as file:
                for line in file:
                    try:
                        if json.loads(line)["step"] <= resume_step:
                            kept.append(line if line.endswith("\n") else line + "\n")
                    except (ValueError, KeyError):
                        break  # a line cut by a crash ends the usable part
        with open(path, "w", encoding="utf-8") as file:
            file.writelines(kept)
        self._file = open(path, "a", encoding="utf-8")

    def append(self, step: int, scalars: Mapping[str, Any]) -> None:
        record = {"step": step}
        for key, value in scalars.items():
            record[key] = value if not isinstance(value, float) or math.isfinite(value) else str(value)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
