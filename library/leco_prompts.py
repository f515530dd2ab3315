"""LECO / concept-slider prompt files (kohya sd-scripts v0.11.1 ``--prompts_file``).

Two formats, read into the same list of :class:`PromptPair` (one training example each):

- the original LECO pairs: ``prompts = [{target, positive, unconditional, neutral, action,
  guidance_scale, resolution, batch_size, multiplier, weight, ...}]`` (top-level keys are defaults),
  or ``targets`` whose first entry has a ``target``;
- ai-toolkit slider targets: ``targets = [{target_class, positive, negative, multiplier, ...}]``
  (optionally under ``[slider]``) with ``neutral`` / ``neutrals`` / ``neutral_prompt_file``. Each
  target expands into the bidirectional pairs a slider needs: with both prompts four pairs (towards
  ``positive`` at +multiplier, away from ``negative`` at +multiplier, and the mirror at
  -multiplier), with one prompt two.

The file is TOML as kohya reads it (the GUI's LECO tab picks ``*.toml``); a ``.yaml``/``.yml`` file
is read as YAML (ai-toolkit's slider targets are written in YAML; a top-level list is a list of
prompts). Bad input is one ``UserError`` line naming the file and the key.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Union

import torch

from library.errors import UserError

ACTIONS = ("erase", "enhance")
PROMPT_KEYS = frozenset({"target", "positive", "unconditional", "neutral", "action", "guidance_scale", "resolution",
                         "dynamic_resolution", "batch_size", "dynamic_crops", "multiplier", "weight"})
SLIDER_KEYS = frozenset({"target_class", "positive", "negative", "neutral", "guidance_scale", "resolution",
                         "resolutions", "dynamic_resolution", "batch_size", "dynamic_crops", "multiplier", "weight"})
DEFAULTS = {"guidance_scale": 1.0, "resolution": 512, "dynamic_resolution": False, "batch_size": 1,
            "dynamic_crops": False, "multiplier": 1.0, "weight": 1.0}
NEUTRAL_LIST_KEYS = ("neutral_prompt_file", "prompt_file")  # files of neutral prompts, one a line


@dataclass(frozen=True)
class PromptPair:
    """One LECO example: the LoRA at ``multiplier`` makes the UNet's prediction for ``target``
    what the frozen UNet predicts for ``neutral`` moved ``guidance_scale`` times the direction
    ``unconditional`` -> ``positive`` (``enhance``) or against it (``erase``)."""

    target: str
    positive: str
    unconditional: str
    neutral: str
    action: str
    guidance_scale: float
    resolution: tuple[int, int]  # (height, width)
    dynamic_resolution: bool
    batch_size: int
    dynamic_crops: bool
    multiplier: float
    weight: float

    def preview(self) -> dict[str, Any]:
        """The fields kohya's ``ss_leco_preview`` metadata lists."""
        return {"target": self.target, "positive": self.positive, "unconditional": self.unconditional,
                "neutral": self.neutral, "action": self.action, "multiplier": self.multiplier, "weight": self.weight}


def leco_target(pair: PromptPair, positive: torch.Tensor, neutral: torch.Tensor,
                unconditional: torch.Tensor) -> torch.Tensor:
    """What the LoRA's prediction for ``pair.target`` is trained towards, from the frozen UNet's
    predictions for the pair's positive, neutral and unconditional prompts (same noisy latents)."""
    offset = pair.guidance_scale * (positive - unconditional)
    return neutral - offset if pair.action == "erase" else neutral + offset


def load_prompt_pairs(path: Union[str, Path], flag: str = "--prompts_file") -> list[PromptPair]:
    """Every example of the prompt file, in file order (sliders expanded per resolution and neutral)."""
    path = Path(path)
    data = _read(path, flag)
    where = f"{flag} {path}"
    pairs: list[PromptPair] = []
    if isinstance(data, list):  # YAML: a list of prompt pairs
        data = {"prompts": data}
    if not isinstance(data, dict) or not data:
        raise UserError(f"{where}: the file is empty; give `prompts` (LECO pairs) or `targets` (slider targets)")
    if "prompts" in data:
        defaults = {**DEFAULTS, **_known(data, PROMPT_KEYS)}
        for index, item in enumerate(_entries(data["prompts"], where, "prompts")):
            if "target_class" in item:
                pairs += _slider_pairs(item, _known(defaults, SLIDER_KEYS), [_text(item.get("neutral"))],
                                       f"{where}: prompts[{index}]")
            else:
                pairs.append(_prompt_pair(item, defaults, f"{where}: prompts[{index}]"))
    else:
        config = data.get("slider", data)
        if not isinstance(config, dict):
            raise UserError(f"{where}: `slider` must be a table of slider settings with `targets`")
        targets = config.get("targets")
        if targets is None:
            if "target_class" not in config and "target" not in config:
                raise UserError(f"{where}: no `prompts` and no slider `targets`; give `prompts` (LECO pairs with "
                                f"target/positive/unconditional/neutral/action) or `targets` (target_class/positive/"
                                f"negative)")
            targets = [config]
        targets = _entries(targets, where, "targets")
        if not targets:
            raise UserError(f"{where}: `targets` is empty; give at least one target")
        if "target" in targets[0]:
            defaults = {**DEFAULTS, **_known(config, PROMPT_KEYS)}
            pairs += [_prompt_pair(item, defaults, f"{where}: targets[{index}]") for index, item in enumerate(targets)]
        else:
            defaults = {**DEFAULTS, **_known(config, SLIDER_KEYS)}
            neutrals = _neutral_list(config, path, where)
            if not neutrals:
                neutrals = [_text(config.get("neutral"))]
            for index, item in enumerate(targets):
                item_neutrals = _neutral_list(item, path, where, first_only=True)
                if not item_neutrals and "neutral" in item:
                    item_neutrals = [_text(item["neutral"])]
                pairs += _slider_pairs(item, defaults, item_neutrals or neutrals, f"{where}: targets[{index}]")
    if not pairs:
        raise UserError(f"{where}: no prompt pairs in the file")
    return pairs


def _read(path: Path, flag: str) -> Any:
    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file; give the LECO prompt file (TOML, or YAML as .yaml/.yml)")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            return yaml.safe_load(text)
        import toml

        return toml.loads(text)
    except Exception as error:  # the parsers' own errors name line and column
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(f"{flag} {path}: not a valid {'YAML' if path.suffix.lower() in ('.yaml', '.yml') else 'TOML'} "
                        f"file: {message}") from None


def _known(table: dict[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    return {key: value for key, value in table.items() if key in keys}


def _entries(value: Any, where: str, key: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
        raise UserError(f"{where}: `{key}` must be a list of tables")
    return value


def _text(value: Any) -> str:
    return str(value or "")


def _neutral_list(table: dict[str, Any], path: Path, where: str, first_only: bool = False) -> list[str]:
    """Neutral prompts from ``neutrals`` and the neutral prompt files (kohya: the file's table adds
    them all up; a target uses the first of them it names)."""
    neutrals: list[str] = []
    for key in ("neutrals", *NEUTRAL_LIST_KEYS):
        if key not in table:
            continue
        if key == "neutrals":
            values = table[key]
            if not isinstance(values, list):
                raise UserError(f"{where}: `neutrals` must be a list of prompts")
            found = [str(value) for value in values]
        else:
            neutral_file = path.parent / str(table[key])
            if not neutral_file.is_file():
                raise UserError(f"{where}: `{key}` {neutral_file}: no such file")
            found = [line.strip() for line in neutral_file.read_text(encoding="utf-8").splitlines() if line.strip()]
        if first_only:
            return found
        neutrals += found
    return neutrals


def _resolution(value: Any, where: str) -> tuple[int, int]:
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or not all(isinstance(v, (int, float)) for v in value):
            raise UserError(f"{where}: `resolution` {value!r}: give one number or [height, width]")
        return int(value[0]), int(value[1])
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise UserError(f"{where}: `resolution` {value!r}: give one number or [height, width]") from None
    return size, size


def _number(table: dict[str, Any], key: str, kind: type, where: str) -> Any:
    try:
        return kind(table[key])
    except (TypeError, ValueError):
        raise UserError(f"{where}: `{key}` {table[key]!r} is not a number") from None


def _pair(fields: dict[str, Any], where: str) -> PromptPair:
    action = fields["action"]
    if action not in ACTIONS:
        raise UserError(f"{where}: `action` {action!r} is unknown; valid: erase, enhance")
    batch_size = _number(fields, "batch_size", int, where)
    if batch_size < 1:
        raise UserError(f"{where}: `batch_size` {batch_size} must be at least 1")
    return PromptPair(
        target=_text(fields["target"]), positive=_text(fields["positive"]),
        unconditional=_text(fields["unconditional"]), neutral=_text(fields["neutral"]), action=action,
        guidance_scale=_number(fields, "guidance_scale", float, where),
        resolution=_resolution(fields["resolution"], where), dynamic_resolution=bool(fields["dynamic_resolution"]),
        batch_size=batch_size, dynamic_crops=bool(fields["dynamic_crops"]),
        multiplier=_number(fields, "multiplier", float, where), weight=_number(fields, "weight", float, where),
    )


def _prompt_pair(item: dict[str, Any], defaults: dict[str, Any], where: str) -> PromptPair:
    """An original LECO pair: ``target`` required; ``positive`` defaults to it, ``neutral`` to
    ``unconditional`` (default empty), ``action`` to erase."""
    unknown = sorted(set(item) - PROMPT_KEYS)
    if unknown:
        raise UserError(f"{where}: unknown key {unknown[0]!r}; valid: {', '.join(sorted(PROMPT_KEYS))}")
    if "target" not in item:
        raise UserError(f"{where}: the key `target` is missing (the prompt the LoRA changes)")
    fields = {**defaults, **item}
    fields.setdefault("unconditional", "")
    if fields.get("positive") is None:
        fields["positive"] = fields["target"]
    if fields.get("neutral") is None:
        fields["neutral"] = fields["unconditional"]
    fields.setdefault("action", "erase")
    return _pair(fields, where)


def _slider_pairs(item: dict[str, Any], defaults: dict[str, Any], neutrals: list[str], where: str) -> list[PromptPair]:
    """An ai-toolkit slider target expanded, per resolution and neutral prompt, into its pairs."""
    fields = {**defaults, **item}
    positive, negative = _text(fields.get("positive")), _text(fields.get("negative"))
    multiplier = _number(fields, "multiplier", float, where)
    if positive.strip() and negative.strip():  # (positive, unconditional, action, multiplier)
        directions = [(negative, positive, "erase", multiplier), (positive, negative, "enhance", multiplier),
                      (positive, negative, "erase", -multiplier), (negative, positive, "enhance", -multiplier)]
    elif negative.strip():
        directions = [(negative, "", "erase", multiplier), (negative, "", "enhance", -multiplier)]
    elif positive.strip():
        directions = [(positive, "", "enhance", multiplier), (positive, "", "erase", -multiplier)]
    else:
        raise UserError(f"{where}: a slider target needs `positive` or `negative` (or both)")
    resolutions = fields.get("resolutions", fields.get("resolution", 512))
    if not (isinstance(resolutions, list) and resolutions and isinstance(resolutions[0], (list, tuple))):
        resolutions = [resolutions]
    pairs = []
    for neutral in neutrals:
        for resolution in resolutions:
            for pair_positive, unconditional, action, pair_multiplier in directions:
                pairs.append(_pair({**fields, "target": fields.get("target_class", ""), "positive": pair_positive,
                                    "unconditional": unconditional, "neutral": neutral, "action": action,
                                    "resolution": resolution, "multiplier": pair_multiplier}, where))
    return pairs
