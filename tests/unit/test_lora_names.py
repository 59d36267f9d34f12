"""What a request's names mean (tokenizer_proc/lora_names.py): vLLM's ``model`` (the served
model, an adapter), SGLang's ``base:adapter`` and ``lora_path``, refusals in each peer's
words, and the view replaced whole by each report or control answer."""

from __future__ import annotations

import pytest

from pipeline.control_frames import LoraAdapter
from pipeline.io_struct import LoraRef
from tokenizer_proc.lora_names import ServedAdapters, UnknownModel
from tokenizer_proc.request_edge.errors import RequestValidationError

BASE = "tiny"


def served(*adapters: LoraAdapter, enabled: bool = True) -> ServedAdapters:
    view = ServedAdapters(BASE, enabled)
    view.learn(adapters)
    return view


SQL = LoraAdapter("sql", "/adapters/sql", 1)
CHAT = LoraAdapter("chat", "/adapters/chat", 2)


def test_model_names_the_base_or_an_adapter() -> None:
    view = served(SQL, CHAT)
    assert view.resolve(None) is None and view.resolve(BASE) is None
    assert view.resolve("sql") == LoraRef("sql", 1)
    assert view.resolve(f"{BASE}:chat") == LoraRef("chat", 2)  # SGLang's base:adapter
    assert view.served_name(LoraRef("sql", 1)) == "sql" and view.served_name(None) == BASE


@pytest.mark.parametrize("model", ["nope", "other:sql", f"{BASE}:nope", f"{BASE}:"])
def test_an_unknown_model_is_the_404s_error(model: str) -> None:
    with pytest.raises(UnknownModel) as raised:
        served(SQL).resolve(model)
    assert raised.value.model == model
    assert str(raised.value) == f"the model {model!r} does not exist; see GET /v1/models"


def test_lora_path_names_an_adapter_in_sglangs_words() -> None:
    view = served(SQL, CHAT)
    assert view.resolve(None, "chat") == LoraRef("chat", 2)
    assert view.resolve(BASE, "chat") == LoraRef("chat", 2)
    assert view.resolve("chat", "chat") == LoraRef("chat", 2)
    with pytest.raises(RequestValidationError) as unknown:
        view.resolve(None, "gone")
    assert str(unknown.value) == (
        "The following requested LoRA adapters are not loaded: gone\n"
        "Loaded adapters: dict_keys(['sql', 'chat'])."
    )
    assert unknown.value.param == "lora_path"
    with pytest.raises(RequestValidationError, match="model names the adapter 'sql'"):
        view.resolve("sql", "chat")


def test_with_lora_off_no_name_is_an_adapter() -> None:
    view = served(enabled=False)
    with pytest.raises(RequestValidationError, match="--enable-lora") as refused:
        view.resolve(None, "sql")
    assert refused.value.param == "lora_path"
    with pytest.raises(UnknownModel):
        view.resolve("sql")
    assert view.resolve(BASE) is None


def test_each_report_replaces_the_view() -> None:
    view = served(SQL, CHAT)
    view.learn((LoraAdapter("sql", "/adapters/sql-v2", 3),))  # reloaded: a new load id
    assert view.resolve("sql") == LoraRef("sql", 3)
    assert [adapter.name for adapter in view.adapters] == ["sql"]
    with pytest.raises(UnknownModel):
        view.resolve("chat")
