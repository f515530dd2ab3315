"""LECO / slider training (``sdxl_train_leco.py``, ``train_leco.py``, ``library.leco``): the prompt
files of both formats, the target, one-line refusals, and a slider that moves the UNet both ways."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from library import leco_prompts
from library.errors import UserError
from library.leco_prompts import PromptPair, leco_target, load_prompt_pairs
from tests.conftest import model_args

SLIDER_TOML = """
neutral = "a photo"
resolution = 64

[[targets]]
target_class = "a photo"
positive = "a bright red photo"
negative = "a dark blue photo"
"""


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def fields(pair: PromptPair) -> tuple:
    return (pair.target, pair.positive, pair.unconditional, pair.neutral, pair.action, pair.multiplier)


def test_original_leco_pairs_take_file_defaults_and_kohya_fallbacks(tmp_path):
    path = write(tmp_path, "p.toml", """
guidance_scale = 2.0
resolution = [64, 96]
[[prompts]]
target = "van gogh"
[[prompts]]
target = "cat"
positive = "tabby cat"
unconditional = "animal"
action = "enhance"
batch_size = 2
weight = 0.5
""")
    first, second = load_prompt_pairs(path)
    # positive defaults to target, neutral to unconditional (empty), action to erase
    assert fields(first) == ("van gogh", "van gogh", "", "", "erase", 1.0)
    assert (first.guidance_scale, first.resolution, first.batch_size) == (2.0, (64, 96), 1)
    assert fields(second) == ("cat", "tabby cat", "animal", "animal", "enhance", 1.0)
    assert (second.batch_size, second.weight) == (2, 0.5)


def test_yaml_list_is_a_list_of_leco_pairs(tmp_path):
    path = write(tmp_path, "p.yaml", '- target: "van gogh"\n  action: enhance\n  resolution: 512\n')
    (pair,) = load_prompt_pairs(path)
    assert fields(pair) == ("van gogh", "van gogh", "", "", "enhance", 1.0) and pair.resolution == (512, 512)


def test_slider_target_expands_into_four_bidirectional_pairs(tmp_path):
    pairs = load_prompt_pairs(write(tmp_path, "s.toml", SLIDER_TOML))
    pos, neg = "a bright red photo", "a dark blue photo"
    assert [fields(p) for p in pairs] == [
        ("a photo", neg, pos, "a photo", "erase", 1.0),
        ("a photo", pos, neg, "a photo", "enhance", 1.0),
        ("a photo", pos, neg, "a photo", "erase", -1.0),
        ("a photo", neg, pos, "a photo", "enhance", -1.0),
    ]
    assert all(p.resolution == (64, 64) for p in pairs)


def test_slider_neutrals_resolutions_and_one_sided_targets(tmp_path):
    (tmp_path / "neutrals.txt").write_text("studio photo\n\n  portrait \n", encoding="utf-8")
    path = write(tmp_path, "s.yaml", """
slider:
  neutrals: ["", "cinematic"]
  targets:
    - target_class: person
      positive: smiling person
      resolutions: [[64, 64], [64, 128]]
      multiplier: 2.0
    - target_class: person
      negative: blurry
      neutral_prompt_file: neutrals.txt
""")
    pairs = load_prompt_pairs(path)
    first = pairs[:8]  # 2 neutrals x 2 resolutions x 2 directions
    assert [(p.neutral, p.resolution, p.action, p.multiplier, p.unconditional) for p in first] == [
        ("", (64, 64), "enhance", 2.0, ""), ("", (64, 64), "erase", -2.0, ""),
        ("", (64, 128), "enhance", 2.0, ""), ("", (64, 128), "erase", -2.0, ""),
        ("cinematic", (64, 64), "enhance", 2.0, ""), ("cinematic", (64, 64), "erase", -2.0, ""),
        ("cinematic", (64, 128), "enhance", 2.0, ""), ("cinematic", (64, 128), "erase", -2.0, ""),
    ]
    assert all(p.positive == "smiling person" for p in first)
    second = pairs[8:]  # the target's own neutral file replaces the file's neutrals
    assert [(p.neutral, p.positive, p.action, p.multiplier) for p in second] == [
        ("studio photo", "blurry", "erase", 1.0), ("studio photo", "blurry", "enhance", -1.0),
        ("portrait", "blurry", "erase", 1.0), ("portrait", "blurry", "enhance", -1.0),
    ]


def test_target_erases_or_enhances_the_guided_direction():
    pair = PromptPair("t", "p", "u", "n", "erase", 2.0, (64, 64), False, 1, False, 1.0, 1.0)
    positive, neutral, unconditional = torch.tensor([3.0]), torch.tensor([10.0]), torch.tensor([1.0])
    assert leco_target(pair, positive, neutral, unconditional).item() == 10.0 - 2.0 * 2.0
    enhance = PromptPair(*[getattr(pair, f) for f in pair.__dataclass_fields__][:4], "enhance",
                         *[getattr(pair, f) for f in pair.__dataclass_fields__][5:])
    assert leco_target(enhance, positive, neutral, unconditional).item() == 10.0 + 2.0 * 2.0


@pytest.mark.parametrize("text, message", [
    ("[[prompts]]\npositive = 'x'\n", "prompts[0]: the key `target` is missing"),
    ("[[prompts]]\ntarget = 'x'\naction = 'remove'\n", "`action` 'remove' is unknown; valid: erase, enhance"),
    ("[[prompts]]\ntarget = 'x'\ntargett = 'y'\n", "unknown key 'targett'"),
    ("[[targets]]\ntarget_class = 'x'\n", "targets[0]: a slider target needs `positive` or `negative`"),
    ("targets = []\n", "`targets` is empty"),
    ("resolution = 512\n", "no `prompts` and no slider `targets`"),
    ("[[prompts]]\ntarget = 'x'\nresolution = 'big'\n", "`resolution` 'big'"),
    ("[[prompts]\ntarget = 1\n", "not a valid TOML file"),
])
def test_bad_prompt_files_are_one_line_user_errors(tmp_path, text, message):
    with pytest.raises(UserError) as error:
        load_prompt_pairs(write(tmp_path, "bad.toml", text))
    assert message in str(error.value) and "\n" not in str(error.value)
    assert "--prompts_file" in str(error.value)


def test_script_refuses_a_bad_prompt_file_with_exit_2_before_loading(tmp_path, capsys):
    import subprocess

    from tests.conftest import REPO, SCRIPT_ENV

    bad = write(tmp_path, "bad.toml", "[[prompts]]\ntarget = 'x'\naction = 'remove'\n")
    result = subprocess.run([sys.executable, str(REPO / "sdxl_train_leco.py"), "--pretrained_model_name_or_path",
                             str(tmp_path / "missing.safetensors"), "--prompts_file", str(bad), "--output_dir",
                             str(tmp_path / "out")], cwd=REPO, env=SCRIPT_ENV, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "`action` 'remove' is unknown; valid: erase, enhance" in lines[0]
