"""Load a tokenizer and the token ids the pipeline depends on.

Every process (tokenizer manager, scheduler, detokenizer) must agree on which ids end a sequence
and which are special, so they all go through :func:`load_tokenizer` rather than reading the
files themselves. Under ``--skip-tokenizer-init`` no process loads a tokenizer:
:func:`load_model_vocab` reads the vocabulary size and EOS ids from the model's own configs
instead, and :func:`load_vocab` picks one of the two for a process. Only local directories are
read: the servers never reach the network.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

__all__ = [
    "DEFAULT_MODEL_NAME",
    "DEFAULT_TOKENIZER_DIR",
    "MEDIA_TOKENS",
    "SHIPPED_EOS_TOKEN_IDS",
    "SHIPPED_VOCAB_SIZE",
    "LoadedTokenizer",
    "ModelVocab",
    "TokenizerLoadError",
    "load_model_vocab",
    "load_tokenizer",
    "load_vocab",
    "model_directory",
]

DEFAULT_TOKENIZER_DIR: Path = Path(__file__).resolve().parent / "assets"
"""Where the shipped tokenizer lives (built by ``scripts/train_tokenizer.py``)."""

DEFAULT_MODEL_NAME = "tokenpipe-tiny"

# The shipped tokenizer's vocabulary size and EOS ids (<|endoftext|>), for the built-in model
# under --skip-tokenizer-init, which must not open the tokenizer to learn them.
# tests/e2e/test_skip_tokenizer_init.py pins them to what load_tokenizer(None) reads.
SHIPPED_VOCAB_SIZE = 4096
SHIPPED_EOS_TOKEN_IDS: frozenset[int] = frozenset({0})

MEDIA_TOKENS: dict[str, str] = {"image": "<|image|>", "audio": "<|audio|>", "video": "<|video|>"}
"""Placeholder token per media kind; a tokenizer without one simply cannot take that kind."""

SPECIAL_TOKEN_FIELDS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The single special tokens of ``transformers``' special-token map, which it hands to chat
templates (``{{ bos_token }}``)."""


class TokenizerLoadError(ValueError):
    """A model directory cannot give a usable tokenizer.

    A ``ValueError`` so that command-line parsing and config validation can report it like any
    other bad option value.
    """


@dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer together with the facts about it that the pipeline keeps asking for.

    Frozen because it is shared by every request of a process; nothing may change EOS ids under
    a running request.
    """

    tokenizer: tokenizers.Tokenizer
    eos_token_ids: frozenset[int]
    special_token_ids: frozenset[int]
    vocab_size: int
    chat_template: str | None
    media_token_ids: dict[str, int]
    name: str
    special_tokens: dict[str, str]  # tokenizer_config.json's SPECIAL_TOKEN_FIELDS, as strings

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """``add_special_tokens``: whether the tokenizer's post-processor adds its tokens (a
        Llama tokenizer's BOS). The default, False, is the bare text's ids; a request's prompt
        goes through ``RequestChecks.tokenize``, which makes every route say which it wants
        (a plain prompt takes them, as in vLLM and SGLang; a rendered chat template holds
        its own BOS already).

        Special-token strings in ``text`` (such as ``<|im_start|>``) become their ids either
        way, so a rendered chat template encodes to real control tokens.
        """
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special_text(self, text: str) -> bool:
        """Whether ``text`` is one special token (which ``skip_special_tokens`` drops)."""
        token_id = self.tokenizer.token_to_id(text)
        return token_id is not None and token_id in self.special_token_ids


@dataclass(frozen=True)
class ModelVocab:
    """What a process knows of the vocabulary under ``--skip-tokenizer-init``: the facts
    that need no tokenizer, with the same names as ``LoadedTokenizer``'s, so code that needs
    only these takes either."""

    vocab_size: int
    eos_token_ids: frozenset[int]  # may be empty: requests then stop on stop_token_ids or length
    name: str


def load_vocab(
    model_path: str | os.PathLike[str] | None, *, skip_tokenizer_init: bool
) -> LoadedTokenizer | ModelVocab:
    """The tokenizer, or under ``--skip-tokenizer-init`` only what the model's configs say."""
    return load_model_vocab(model_path) if skip_tokenizer_init else load_tokenizer(model_path)


def load_model_vocab(model_path: str | os.PathLike[str] | None) -> ModelVocab:
    """The vocabulary without opening a tokenizer file: ``vocab_size`` from config.json, EOS
    ids from generation_config.json's ``eos_token_id`` (config.json's when there is no
    generation config), as :func:`load_tokenizer` reads them. Only tokenizer_config.json's
    ``eos_token`` is left out: it is a token string, and only the tokenizer maps it to an id.
    None -> the built-in model's shipped vocabulary.

    Raises TokenizerLoadError naming the missing or bad file/field.
    """
    if model_path is None:
        return ModelVocab(
            vocab_size=SHIPPED_VOCAB_SIZE,
            eos_token_ids=SHIPPED_EOS_TOKEN_IDS,
            name=DEFAULT_MODEL_NAME,
        )
    directory = Path(model_path).expanduser()
    if not directory.is_dir():
        raise TokenizerLoadError(f"model path {str(directory)!r} is not a directory")
    directory = directory.resolve()
    model_config = _read_json(directory / "config.json")
    if model_config is None:
        raise TokenizerLoadError(
            f"config.json not found in {directory}: --skip-tokenizer-init reads the vocabulary "
            "size there"
        )
    vocab_size = model_config.get("vocab_size")
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
        raise TokenizerLoadError(
            f"config.json: 'vocab_size' must be a positive integer, got {vocab_size!r}"
        )
    generation_config = _read_json(directory / "generation_config.json")
    if generation_config is None:
        eos_ids = _id_list(model_config, "eos_token_id", "config.json", vocab_size)
    else:
        eos_ids = _id_list(generation_config, "eos_token_id", "generation_config.json", vocab_size)
    return ModelVocab(vocab_size=vocab_size, eos_token_ids=frozenset(eos_ids), name=directory.name)


def model_directory(model_path: str | os.PathLike[str] | None) -> Path:
    """The absolute directory :func:`load_tokenizer` reads: ``--model-path``, or the shipped
    tokenizer's for the built-in model."""
    return DEFAULT_TOKENIZER_DIR if model_path is None else Path(model_path).expanduser().resolve()


def load_tokenizer(model_path: str | os.PathLike[str] | None) -> LoadedTokenizer:
    """None -> the shipped default. Otherwise a local Hugging Face-style directory with
    tokenizer.json (+ optional tokenizer_config.json, generation_config.json, config.json).

    EOS ids are the union of ``tokenizer_config.json``'s ``eos_token`` and the generation
    config's ``eos_token_id``: chat models often stop on a turn-end token that only the
    generation config names. As in ``transformers``, ``config.json`` stands in for a missing
    ``generation_config.json``.

    Raises TokenizerLoadError (a ValueError subclass) naming the missing or bad file/field.
    """
    is_default = model_path is None
    directory = DEFAULT_TOKENIZER_DIR if model_path is None else Path(model_path).expanduser()
    if not directory.is_dir():
        raise TokenizerLoadError(f"model path {str(directory)!r} is not a directory")
    directory = directory.resolve()
    is_default = is_default or directory == DEFAULT_TOKENIZER_DIR

    tokenizer_file = directory / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise TokenizerLoadError(f"tokenizer.json not found in {directory}")
    try:
        tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust side raises a bare Exception
        raise TokenizerLoadError(f"{tokenizer_file}: cannot parse tokenizer.json: {exc}") from exc
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    tokenizer_config = _read_json(directory / "tokenizer_config.json")
    generation_config = _read_json(directory / "generation_config.json")
    if generation_config is None:
        generation_config = _read_json(directory / "config.json")
        generation_config_name = "config.json"
    else:
        generation_config_name = "generation_config.json"

    eos_ids: set[int] = set()
    if tokenizer_config is not None and tokenizer_config.get("eos_token") is not None:
        eos_ids.add(_token_id(tokenizer, tokenizer_config, "eos_token"))
    if generation_config is not None:
        eos_ids.update(
            _id_list(generation_config, "eos_token_id", generation_config_name, vocab_size)
        )
    if not eos_ids:
        raise TokenizerLoadError(
            f"{directory}: no EOS token: set 'eos_token' in tokenizer_config.json or "
            "'eos_token_id' in generation_config.json"
        )

    special_ids = frozenset(
        token_id
        for token_id, added in tokenizer.get_added_tokens_decoder().items()
        if added.special
    )
    media_ids = {
        kind: token_id
        for kind, token in MEDIA_TOKENS.items()
        if (token_id := tokenizer.token_to_id(token)) is not None
    }

    return LoadedTokenizer(
        tokenizer=tokenizer,
        eos_token_ids=frozenset(eos_ids),
        special_token_ids=special_ids,
        vocab_size=vocab_size,
        chat_template=_chat_template(directory, tokenizer_config),
        media_token_ids=media_ids,
        name=DEFAULT_MODEL_NAME if is_default else directory.name,
        special_tokens=_special_tokens(tokenizer_config),
    )


def _read_json(path: Path) -> dict[str, Any] | None:
    """The optional files may be absent, but a present, broken one is an error, not a default."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerLoadError(f"{path}: cannot read {path.name}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path}: {path.name} must hold a JSON object")
    return data


def _token_content(config: dict[str, Any], field: str) -> str:
    """A token named in tokenizer_config.json; HF writes either a string or an AddedToken-style
    dict ``{"content": ...}``."""
    value = config[field]
    content = value.get("content") if isinstance(value, dict) else value
    if not isinstance(content, str):
        raise TokenizerLoadError(
            f"tokenizer_config.json: '{field}' must be a string or {{\"content\": str}}"
        )
    return content


def _special_tokens(config: dict[str, Any] | None) -> dict[str, str]:
    """What a chat template gets as ``bos_token`` etc.; like ``transformers``, a token the
    config leaves out or sets to null is simply not there (undefined in the template)."""
    if config is None:
        return {}
    return {
        name: _token_content(config, name)
        for name in SPECIAL_TOKEN_FIELDS
        if config.get(name) is not None
    }


def _token_id(tokenizer: tokenizers.Tokenizer, config: dict[str, Any], field: str) -> int:
    content = _token_content(config, field)
    token_id = tokenizer.token_to_id(content)
    if token_id is None:
        raise TokenizerLoadError(
            f"tokenizer_config.json: '{field}' {content!r} is not in the vocabulary"
        )
    return token_id


def _id_list(config: dict[str, Any], field: str, file_name: str, vocab_size: int) -> list[int]:
    """HF configs hold one id or a list of ids; an out-of-range id would never match, so it is
    rejected here instead of silently never stopping."""
    value = config.get(field)
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for item in values:
        # bool is an int subclass, and `true` is never a meaningful token id.
        if not isinstance(item, int) or isinstance(item, bool) or not 0 <= item < vocab_size:
            raise TokenizerLoadError(
                f"{file_name}: '{field}' must be a token id or a list of token ids "
                f"in [0, {vocab_size}), got {value!r}"
            )
    return values


def _chat_template(directory: Path, tokenizer_config: dict[str, Any] | None) -> str | None:
    """Newer HF repos put the template in chat_template.jinja, older ones in the config, some as
    a list of named templates of which "default" is the one to use."""
    template = tokenizer_config.get("chat_template") if tokenizer_config is not None else None
    if isinstance(template, list):
        named = {
            entry.get("name"): entry.get("template")
            for entry in template
            if isinstance(entry, dict)
        }
        template = named.get("default", next(iter(named.values()), None))
    if template is None:
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        raise TokenizerLoadError("tokenizer_config.json: 'chat_template' must be a string")
    return template
