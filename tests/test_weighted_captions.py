"""--weighted_captions: kohya's A1111 attention syntax, per-token weights, weighted hidden states, training runs."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import model_args, run_trainer

import sdxl_train_network
import train_network
from library import model_loading, text_encoding
from library.errors import UserError
from networks import lora

ROUND, SQUARE = 1.1, 1 / 1.1

PARSE_TABLE = [
    # kohya's docstring examples (A1111's parse_prompt_attention)
    ("normal text", [("normal text", 1.0)]),
    ("an (important) word", [("an ", 1.0), ("important", 1.1), (" word", 1.0)]),
    ("(unbalanced", [("unbalanced", 1.1)]),
    (r"\(literal\]", [("(literal]", 1.0)]),
    ("(unnecessary)(parens)", [("unnecessaryparens", 1.1)]),
    ("a (((house:1.3)) [on] a (hill:0.5), sun, (((sky))).",
     [("a ", 1.0), ("house", 1.5730000000000004), (" ", 1.1), ("on", 1.0), (" a ", 1.1), ("hill", 0.55),
      (", sun, ", 1.1), ("sky", 1.4641000000000006), (".", 1.1)]),
    # more of the same rules
    ("", [("", 1.0)]),
    ("[abc]", [("abc", SQUARE)]),
    ("((a)) b", [("a", ROUND * ROUND), (" b", 1.0)]),
    ("[(a:1.5)]", [("a", 1.5 * SQUARE)]),
    ("(a:-0.5) (b:+2)", [("a", -0.5), (" ", 1.0), ("b", 2.0)]),
    ("[a:1.3]", [("a:1.3", SQUARE)]),  # an explicit weight only closes a round bracket
    ("a:1.3) b", [("a:1.3) b", 1.0)]),  # ... and is text when none is open
    ("a) b] c", [("a) b] c", 1.0)]),  # unmatched closing brackets are text
    ("(a [b)", [("a ", ROUND), ("b", ROUND * SQUARE)]),  # open brackets weigh to the end, rounds first
    (r"a\\b \[c\)", [("a\\b [c)", 1.0)]),
    ("a\\b", [("ab", 1.0)]),  # a backslash escaping nothing vanishes
    ("(a), (b) (c:1.1)", [("a", 1.1), (", ", 1.0), ("b", 1.1), (" ", 1.0), ("c", 1.1)]),
]


@pytest.mark.parametrize("caption,expected", PARSE_TABLE)
def test_parser_matches_kohya(caption, expected):
    parsed = text_encoding.parse_weighted_caption(caption)
    assert parsed == expected  # exact floats: weights are multiplied in kohya's order


def test_a_weight_that_is_not_a_number_names_the_caption():
    with pytest.raises(UserError, match=r"weight '1\.2\.3' in caption 'x \(a:1\.2\.3\)' is not a number"):
        text_encoding.parse_weighted_caption("x (a:1.2.3)")


@pytest.fixture(scope="module")
def sdxl(tiny_models):
    return model_loading.load_models(str(tiny_models["sdxl"]), sdxl=True)


@pytest.fixture(scope="module")
def sd1(tiny_models):
    return model_loading.load_models(str(tiny_models["sd15"]), sdxl=False)


def test_token_weights_follow_their_tokens(sdxl):
    for tokenizer in sdxl.tokenizers:  # tokenizer 2 pads with "!", not <EOS>
        elephant = tokenizer("elephant", add_special_tokens=False).input_ids
        assert len(elephant) == 8  # the tiny tokenizer spells words out: a word of many tokens
        ids, weights = text_encoding.tokenize_weighted(tokenizer, ["a (elephant:1.5) [run]"])
        assert torch.equal(ids, text_encoding.tokenize(tokenizer, ["a elephant run"]))  # no syntax tokenised
        expected = torch.ones(1, 1, 77)
        expected[0, 0, 2:10] = 1.5  # <BOS> a elephant(8) run(3) <EOS> <PAD>...: every token of the word
        expected[0, 0, 10:13] = SQUARE
        assert weights.dtype == torch.float32 and torch.equal(weights, expected)

        # 150 tokens: the word crosses the chunk border (72 one-token words before it); chunked like the ids
        ids, weights = text_encoding.tokenize_weighted(tokenizer, ["x " * 72 + "(elephant:1.5) run"], 150)
        assert torch.equal(ids, text_encoding.tokenize(tokenizer, ["x " * 72 + "elephant run"], 150))
        expected = torch.ones(1, 2, 77)
        expected[0, 0, 73:76] = 1.5  # "ele" ends chunk 1, before its <EOS>
        expected[0, 1, 1:6] = 1.5  # "phant" starts chunk 2, after its <BOS>
        assert torch.equal(weights, expected)

        # cut at the token limit like unweighted captions: <BOS> 75 tokens <EOS>
        ids, weights = text_encoding.tokenize_weighted(tokenizer, ["(" + "y " * 100 + ")"])
        assert torch.equal(ids, text_encoding.tokenize(tokenizer, ["y " * 100]))
        assert weights[0, 0, 0] == 1.0 and weights[0, 0, -1] == 1.0 and (weights[0, 0, 1:-1] == 1.1).all()


@pytest.mark.parametrize("max_token_length", [None, 150])
def test_captions_without_syntax_encode_bit_identically(sdxl, sd1, max_token_length):
    captions = ["a red circle", "a blue square, " * 12, ""]  # the second one fills more than one chunk
    with torch.no_grad():
        plain = text_encoding.encode_sdxl(sdxl.tokenizers, sdxl.text_encoders, captions, max_token_length)
        weighted = text_encoding.encode_sdxl(sdxl.tokenizers, sdxl.text_encoders, captions, max_token_length,
                                             weighted=True)
        assert all(torch.equal(a, b) for a, b in zip(plain, weighted))
        for clip_skip in (None, 2):
            plain = text_encoding.encode_sd(sd1.tokenizers[0], sd1.text_encoders[0], captions, max_token_length,
                                            clip_skip)
            weighted = text_encoding.encode_sd(sd1.tokenizers[0], sd1.text_encoders[0], captions, max_token_length,
                                               clip_skip, weighted=True)
            assert torch.equal(plain, weighted)


@pytest.mark.parametrize("max_token_length", [None, 150])
def test_weighted_hidden_states_are_the_plain_ones_times_the_weights(sdxl, max_token_length):
    prefix = "x " * 72 if max_token_length else ""  # with 150 the word crosses the chunk border
    weighted_caption, plain_caption = prefix + "a (elephant:1.5) [run]", prefix + "a elephant run"
    with torch.no_grad():
        hidden1, hidden2, pooled = text_encoding.encode_sdxl_parts(
            sdxl.tokenizers, sdxl.text_encoders, [weighted_caption], max_token_length, weighted=True)
        plain1, plain2, plain_pooled = text_encoding.encode_sdxl_parts(
            sdxl.tokenizers, sdxl.text_encoders, [plain_caption], max_token_length)
    start = len(prefix) // 2 + 2  # <BOS>, the prefix's tokens, "a"
    weights = torch.ones(1, hidden1.shape[1], 1)  # joined layout: <BOS> 75*n tokens <EOS>
    weights[0, start : start + 8] = 1.5
    weights[0, start + 8 : start + 11] = SQUARE
    assert torch.equal(hidden1, plain1 * weights) and torch.equal(hidden2, plain2 * weights)
    assert torch.equal(pooled, plain_pooled)  # the pooled output is not weighted


def test_trainers_encode_prompts_follow_the_flag(sdxl, sd1):
    captions = ["a (red:1.4) [circle]"]
    for weighted in (True, False):
        flags = ["--weighted_captions"] if weighted else []
        with torch.no_grad():
            hidden, pooled = sdxl_train_network.SdxlNetworkTrainer().encode_prompts(
                sdxl_train_network.setup_parser().parse_args(flags), sdxl, captions)
            expected_hidden, expected_pooled = text_encoding.encode_sdxl(sdxl.tokenizers, sdxl.text_encoders,
                                                                         captions, weighted=weighted)
            sd1_hidden = train_network.NetworkTrainer().encode_prompts(
                train_network.setup_parser().parse_args(flags), sd1, captions)
            sd1_expected = text_encoding.encode_sd(sd1.tokenizers[0], sd1.text_encoders[0], captions,
                                                   weighted=weighted)
        assert torch.equal(hidden, expected_hidden) and torch.equal(pooled, expected_pooled)
        assert torch.equal(sd1_hidden, sd1_expected)


def weighted_dataset(demo_dataset: Path, root: Path) -> Path:
    """The demo images with captions such as "a (red:1.4) [circle], (shape), photo"."""
    shutil.copytree(demo_dataset, root)
    for caption_file in root.rglob("*.txt"):
        article, colour, shape = caption_file.read_text(encoding="utf-8").split()
        caption_file.write_text(f"{article} ({colour}:1.4) [{shape}], (shape), photo\n", encoding="utf-8")
    return root


def args_for(tiny_models, dataset: Path, output_dir: Path, *extra: str) -> list[str]:
    return model_args(tiny_models, "sdxl") + [
        "--train_data_dir", str(dataset), "--caption_extension", ".txt", "--resolution", "64",
        "--output_dir", str(output_dir), "--seed", "2", "--max_data_loader_n_workers", "0", *extra,
    ]


def test_sdxl_training_with_weighted_shuffled_long_bf16_captions(tiny_models, demo_dataset, tmp_path):
    dataset = weighted_dataset(demo_dataset, tmp_path / "data")
    run_trainer("sdxl_train_network", args_for(
        tiny_models, dataset, tmp_path / "out", "--weighted_captions", "--shuffle_caption",
        "--max_token_length", "150", "--mixed_precision", "bf16", "--max_train_steps", "2"))
    weights = lora.read_lora_file(str(tmp_path / "out" / "last.safetensors"))
    assert any(key.startswith("lora_te1_") for key in weights)  # the text encoders train through the weights
    assert all(torch.isfinite(value).all() for value in weights.values())


def test_cached_text_outputs_are_the_weighted_ones_and_not_reused_unweighted(tiny_models, demo_dataset, sdxl,
                                                                           tmp_path):
    dataset = weighted_dataset(demo_dataset, tmp_path / "data")
    npz_path = next(dataset.rglob("000.png")).with_name("000_te_outputs.npz")

    def train(*extra: str) -> dict:
        run_trainer("sdxl_train_network", args_for(
            tiny_models, dataset, tmp_path / "out", "--cache_text_encoder_outputs_to_disk",
            "--network_train_unet_only", "--max_train_steps", "1", *extra))
        with np.load(npz_path) as npz:
            return {key: npz[key] for key in npz.files}

    unweighted = train()
    cached = train("--weighted_captions")  # the unweighted file is stale: rebuilt
    meta = json.loads(str(cached["cache_meta"]))
    assert json.loads(str(unweighted["cache_meta"]))["weighted_captions"] is False
    assert meta["weighted_captions"] is True and meta["caption"] == "a (red:1.4) [circle], (shape), photo"
    with torch.no_grad():
        hidden1, hidden2, pooled = text_encoding.encode_sdxl_parts(
            sdxl.tokenizers, sdxl.text_encoders, [meta["caption"]], weighted=True)
    torch.testing.assert_close(torch.from_numpy(cached["hidden_state1"]), hidden1[0])
    torch.testing.assert_close(torch.from_numpy(cached["hidden_state2"]), hidden2[0])
    torch.testing.assert_close(torch.from_numpy(cached["pool2"]), pooled[0])
    assert not np.allclose(cached["hidden_state1"], unweighted["hidden_state1"])
    weights = lora.read_lora_file(str(tmp_path / "out" / "last.safetensors"))
    assert weights and all(key.startswith("lora_unet_") for key in weights)
