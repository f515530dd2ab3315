"""Build the real CLIP tokenizers offline, in kohya's --tokenizer_cache_dir layout.

    python tools/build_clip_tokenizers.py --out DIR [--bpe bpe_simple_vocab_16e6.txt.gz | --wheel open_clip_torch-*.whl]

Writes DIR/openai_clip-vit-large-patch14 (SD1.x, SDXL text encoder 1),
DIR/laion_CLIP-ViT-bigG-14-laion2B-39B-b160k (SDXL text encoder 2, pad "!") and
DIR/stabilityai_stable-diffusion-2 (SD2.x, pad "!"). Then pass
``--tokenizer_cache_dir DIR`` to the training scripts.

The BPE merges ship inside the ``open_clip_torch`` wheel on PyPI
(``open_clip/bpe_simple_vocab_16e6.txt.gz``); without --bpe/--wheel the wheel
is fetched with ``pip download --no-deps`` (it is not installed). The vocab is
built with OpenAI's rule: the 256 byte characters, the same with ``</w>``, the
first 48,894 merges joined, then ``<|startoftext|>`` and ``<|endoftext|>``
(49,408 tokens). The result is checked against known ids before it is written.
"""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `library` and `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from library.errors import UserError, exit_on_user_error
from library.clip_tokenizers import set_pad_token
from tools.build_tiny_models import byte_level_characters

BPE_MEMBER = "open_clip/bpe_simple_vocab_16e6.txt.gz"
MERGE_COUNT = 49152 - 256 - 2  # OpenAI keeps this many merges of the file
CHECK_TEXT = "a photo of a cat"
CHECK_IDS = [49406, 320, 1125, 539, 320, 2368, 49407]
# kohya cache folder name -> pad token (None: the tokenizer's own, <|endoftext|>)
TOKENIZER_FOLDERS: dict[str, str | None] = {
    "openai_clip-vit-large-patch14": None,
    "laion_CLIP-ViT-bigG-14-laion2B-39B-b160k": "!",
    "stabilityai_stable-diffusion-2": "!",
}


def read_bpe_merges(bpe_gz: Path) -> list[str]:
    """The merges OpenAI's CLIP tokenizer uses, from ``bpe_simple_vocab_16e6.txt.gz``."""
    if not bpe_gz.is_file():
        raise UserError(f"--bpe: {bpe_gz} does not exist")
    lines = gzip.decompress(bpe_gz.read_bytes()).decode("utf-8").split("\n")
    merges = lines[1:MERGE_COUNT + 1]  # line 0 is a version header
    if len(merges) != MERGE_COUNT or any(len(merge.split()) != 2 for merge in merges):
        raise UserError(f"--bpe: {bpe_gz} does not hold {MERGE_COUNT} BPE merges")
    return merges


def bpe_from_wheel(wheel: Path, work_dir: Path) -> Path:
    """Extract ``bpe_simple_vocab_16e6.txt.gz`` from an open_clip_torch wheel into ``work_dir``."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            target = work_dir / Path(BPE_MEMBER).name
            target.write_bytes(archive.read(BPE_MEMBER))
            return target
    except (OSError, KeyError, zipfile.BadZipFile) as error:
        raise UserError(f"--wheel: cannot read {BPE_MEMBER} from {wheel}: {error}") from error


def download_wheel(work_dir: Path) -> Path:
    """``pip download open_clip_torch --no-deps`` into ``work_dir``; returns the wheel path."""
    command = [sys.executable, "-m", "pip", "download", "open_clip_torch", "--no-deps", "--only-binary=:all:",
               "--quiet", "--dest", str(work_dir)]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(work_dir.glob("open_clip_torch-*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise UserError(f"pip download open_clip_torch failed ({detail[0]}); pass --bpe or --wheel instead")
    return wheels[-1]


def build_clip_tokenizers(out_dir: str | Path, bpe_gz: str | Path | None = None,
                          wheel: str | Path | None = None) -> dict[str, Path]:
    """Write the three tokenizer folders into ``out_dir``; returns kohya folder name -> path."""
    from transformers import CLIPTokenizer

    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory() as work:
        work_dir = Path(work)
        if bpe_gz is None:
            bpe_gz = bpe_from_wheel(Path(wheel) if wheel else download_wheel(work_dir), work_dir)
        merges = read_bpe_merges(Path(bpe_gz))
        characters = byte_level_characters()
        tokens = characters + [c + "</w>" for c in characters] + ["".join(m.split()) for m in merges]
        tokens += ["<|startoftext|>", "<|endoftext|>"]
        raw = work_dir / "raw"
        raw.mkdir()
        (raw / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False),
                                        encoding="utf-8")
        (raw / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
        written = {}
        for folder_name, pad_token in TOKENIZER_FOLDERS.items():
            tokenizer = CLIPTokenizer.from_pretrained(raw, model_max_length=77)
            if pad_token:
                tokenizer = set_pad_token(tokenizer, pad_token)
            ids = tokenizer(CHECK_TEXT).input_ids
            if ids != CHECK_IDS:  # a wrong rule would silently give a different model input
                raise RuntimeError(f"built tokenizer gives {ids} for {CHECK_TEXT!r}, expected {CHECK_IDS}")
            tokenizer.save_pretrained(out_dir / folder_name)
            for name in ("vocab.json", "merges.txt"):  # what kohya's transformers 4 pin reads (v5 writes only tokenizer.json)
                shutil.copyfile(raw / name, out_dir / folder_name / name)
            written[folder_name] = out_dir / folder_name
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder, used as --tokenizer_cache_dir (created)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--bpe", default=None, help="path of bpe_simple_vocab_16e6.txt.gz (default: from the wheel)")
    source.add_argument("--wheel", default=None,
                        help="path of an open_clip_torch wheel (default: pip download it, --no-deps)")
    args = parser.parse_args()
    for name, path in build_clip_tokenizers(args.out, bpe_gz=args.bpe, wheel=args.wheel).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    exit_on_user_error(main)
