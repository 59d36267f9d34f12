"""Tests for the shipped default tokenizer and pipeline.tokenizer_loader."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.tokenizer_loader import (
    DEFAULT_TOKENIZER_DIR,
    LoadedTokenizer,
    TokenizerLoadError,
    load_tokenizer,
)

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|image|>",
    "<|audio|>",
    "<|video|>",
]


@pytest.fixture(scope="module")
def default() -> LoadedTokenizer:
    return load_tokenizer(None)


def test_default_loads_with_expected_ids(default: LoadedTokenizer) -> None:
    assert default.name == "tokenpipe-tiny"
    assert default.eos_token_ids == frozenset({0})
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        assert default.tokenizer.token_to_id(token) == expected_id
    assert default.special_token_ids == frozenset(range(len(SPECIAL_TOKENS)))
    assert default.media_token_ids == {"image": 3, "audio": 4, "video": 5}
    assert default.chat_template is not None and "<|im_start|>" in default.chat_template


def test_default_vocab_size_matches_file(default: LoadedTokenizer) -> None:
    data = json.loads((DEFAULT_TOKENIZER_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    ids = set(data["model"]["vocab"].values()) | {t["id"] for t in data["added_tokens"]}
    assert default.vocab_size == len(ids) == max(ids) + 1
    assert default.vocab_size == 4096


def test_default_has_full_byte_alphabet(default: LoadedTokenizer) -> None:
    # With all 256 byte symbols in the vocab, no UTF-8 input can hit an unknown token.
    from tokenizers.pre_tokenizers import ByteLevel

    assert set(ByteLevel.alphabet()) <= set(default.tokenizer.get_vocab())
    every_latin1 = "".join(chr(c) for c in range(256))
    assert default.decode(default.encode(every_latin1)) == every_latin1


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "naïve café résumé — déjà vu, Zürich, São Paulo, Ångström",
        "你好，世界。今日は良い天気です。안녕하세요",
        "emoji: 🙂🚀👍🏽 👨‍👩‍👧‍👦 ❤️ 🇯🇵",
        "mixed\ttabs\n\nnewlines   and  spaces  ",
        " leading space and trailing space ",
        "math: ∑ x² ≤ ∞, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢, \u200b zero-width, \U0010ffff",
        "",
    ],
)
def test_unicode_round_trips(default: LoadedTokenizer, text: str) -> None:
    ids = default.encode(text)
    assert default.decode(ids) == text
    assert all(0 <= i < default.vocab_size for i in ids)


def test_encode_adds_no_special_tokens(default: LoadedTokenizer) -> None:
    ids = default.encode("hello")
    assert not set(ids) & default.special_token_ids


def test_special_tokens_are_recognised_and_skippable(default: LoadedTokenizer) -> None:
    ids = default.encode("<|im_start|>user\nHi<|im_end|>\n<|endoftext|>")
    assert ids[0] == 1 and 2 in ids and ids[-1] == 0
    assert default.decode(ids) == "user\nHi\n"
    assert (
        default.decode(ids, skip_special_tokens=False)
        == "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>"
    )


def test_chat_template_renders_to_control_tokens(default: LoadedTokenizer) -> None:
    jinja2 = pytest.importorskip("jinja2")
    assert default.chat_template is not None
    rendered = (
        jinja2.Environment()
        .from_string(default.chat_template)
        .render(
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
            add_generation_prompt=True,
        )
    )
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = default.encode(rendered)
    assert ids.count(1) == 3 and ids.count(2) == 2


def test_english_compresses(default: LoadedTokenizer) -> None:
    text = (
        "The quick brown fox jumps over the lazy dog. Language models are trained on large amounts "
        "of text, and they learn to predict the next word in a sentence. In the morning, we walked "
        "along the river to the old market, where people were selling fresh bread and cheese."
    )
    ratio = len(default.encode(text)) / len(text.encode("utf-8"))
    assert ratio < 0.6, ratio


def _write_model_dir(path: Path, **configs: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(DEFAULT_TOKENIZER_DIR / "tokenizer.json", path / "tokenizer.json")
    for name, content in configs.items():
        (path / f"{name}.json").write_text(json.dumps(content), encoding="utf-8")
    return path


def test_model_dir_unions_eos_ids(tmp_path: Path) -> None:
    model_dir = _write_model_dir(
        tmp_path / "my-model",
        tokenizer_config={
            "eos_token": {"content": "<|im_end|>", "special": True},
            "bos_token": None,
        },
        generation_config={"eos_token_id": [0, 2]},
    )
    loaded = load_tokenizer(model_dir)
    assert loaded.eos_token_ids == frozenset({0, 2})
    assert loaded.name == "my-model"
    assert loaded.chat_template is None
    assert loaded.vocab_size == load_tokenizer(None).vocab_size


def test_model_dir_int_eos_from_config_json(tmp_path: Path) -> None:
    # Without generation_config.json, config.json's eos_token_id counts (as in transformers).
    model_dir = _write_model_dir(
        tmp_path / "m", tokenizer_config={"eos_token": "<|endoftext|>"}, config={"eos_token_id": 2}
    )
    assert load_tokenizer(str(model_dir)).eos_token_ids == frozenset({0, 2})


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        '{"eos_token": "<|endoftext|>"}', encoding="utf-8"
    )
    with pytest.raises(TokenizerLoadError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match="not a directory"):
        load_tokenizer(tmp_path / "nope")


def test_no_eos_anywhere(tmp_path: Path) -> None:
    model_dir = _write_model_dir(tmp_path / "m")
    with pytest.raises(TokenizerLoadError, match="eos_token"):
        load_tokenizer(model_dir)


@pytest.mark.parametrize(
    ("configs", "needle"),
    [
        ({"tokenizer_config": {"eos_token": "<|not-a-token|>"}}, "not in the vocabulary"),
        ({"tokenizer_config": {"eos_token": 5}}, "eos_token"),
        ({"generation_config": {"eos_token_id": [0, 999999]}}, "generation_config.json"),
        ({"generation_config": {"eos_token_id": True}}, "eos_token_id"),
    ],
)
def test_bad_eos_fields(tmp_path: Path, configs: dict[str, object], needle: str) -> None:
    model_dir = _write_model_dir(tmp_path / "m", **configs)
    with pytest.raises(TokenizerLoadError, match=needle):
        load_tokenizer(model_dir)


def test_malformed_optional_file_names_it(tmp_path: Path) -> None:
    model_dir = _write_model_dir(tmp_path / "m")
    (model_dir / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(TokenizerLoadError, match="tokenizer_config.json"):
        load_tokenizer(model_dir)


def test_error_is_value_error() -> None:
    assert issubclass(TokenizerLoadError, ValueError)
