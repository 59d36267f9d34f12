"""The items of a ``POST /v1/responses`` request's ``input``: each field checked as a body
field is (a value of the wrong JSON type, a string outside an enumeration, a required field
left out: a 400 naming ``input[i].field``), the items in their full form
(``normalized_items``, which the response store keeps too), and the chat messages they
become (``conversation_messages``). Fields OpenAI gives an item that mean nothing here
(``id``, ``status``, a text part's ``annotations``) are checked and dropped.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizer_proc.request_edge.errors import RequestValidationError

__all__ = ["ITEM_TYPES", "conversation_messages", "normalized_items"]

ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
ROLES = ("user", "system", "developer", "assistant")
STATUSES = ("in_progress", "completed", "incomplete")
MESSAGE_PARTS = ("input_text", "output_text", "refusal")
OUTPUT_PARTS = ("input_text", "output_text")

_JSON_TYPES: tuple[tuple[type, str], ...] = (
    (bool, "a boolean"),  # before int: a bool is an int to Python, not to JSON
    (int, "an integer"),
    (float, "a number"),
    (str, "a string"),
    (list, "an array"),
    (dict, "an object"),
)


def _json_type(value: object) -> str:
    return next((name for kind, name in _JSON_TYPES if isinstance(value, kind)), "null")


def _field(
    obj: dict[str, Any], name: str, at: str, kinds: tuple[type, ...], required: bool = False
) -> Any:
    """``obj[name]`` when it is one of ``kinds`` (None when left out or null and optional);
    a RequestValidationError naming ``at.name`` otherwise."""
    where = f"{at}.{name}"
    value = obj.get(name)
    if value is None:
        if required:
            raise RequestValidationError(f"{where} is required", where)
        return None
    accepted = [label for kind, label in _JSON_TYPES if kind in kinds]
    if _json_type(value) not in accepted:
        message = f"{where} must be {' or '.join(accepted)}, got {_json_type(value)}"
        raise RequestValidationError(message, where)
    return value


def _one_of(
    obj: dict[str, Any], name: str, at: str, values: tuple[str, ...], required: bool = False
) -> str | None:
    value: str | None = _field(obj, name, at, (str,), required)
    if value is not None and value not in values:
        where = f"{at}.{name}"
        message = f"{where} must be one of {', '.join(values)}, got {value!r}"
        raise RequestValidationError(message, where)
    return value


def _object(value: object, at: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RequestValidationError(f"{at} must be an object, got {_json_type(value)}", at)
    return value


def _text_part(value: object, at: str, kinds: tuple[str, ...]) -> dict[str, str]:
    """A content part of one of ``kinds`` as ``{"type", "text"}`` (``"refusal"`` for a
    refusal): ``type`` first, so that a kind this server cannot read is named as such."""
    part = _object(value, at)
    kind = _field(part, "type", at, (str,), required=True)
    if kind not in kinds:
        message = (
            f"{at}.type: content parts of type {kind!r} are not supported by this server; only "
            f"{', '.join(kinds)}"
        )
        raise RequestValidationError(message, f"{at}.type")
    if kind == "refusal":
        return {"type": kind, "refusal": _field(part, "refusal", at, (str,), required=True)}
    text = _field(part, "text", at, (str,), required=True)
    _field(part, "annotations", at, (list,))
    _field(part, "logprobs", at, (list,))
    return {"type": kind, "text": text}


def _parts(value: list[Any], at: str, kinds: tuple[str, ...]) -> list[dict[str, str]]:
    return [_text_part(part, f"{at}[{j}]", kinds) for j, part in enumerate(value)]


def _common(item: dict[str, Any], at: str) -> None:
    """The fields every item may carry and nothing here reads."""
    _field(item, "id", at, (str,))
    _one_of(item, "status", at, STATUSES)


def normalized_items(
    value: str | list[dict[str, Any]] | None, where: str = "input"
) -> list[dict[str, Any]]:
    """The request's input as items in their full form (a string is one user message; a
    message item's ``type`` is filled in). Raises RequestValidationError naming the field at
    fault: an unknown type, a missing field or one of the wrong type, content of a kind this
    server cannot read."""
    if value is None:
        return []
    if isinstance(value, str):
        return [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}
        ]
    items = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        item = _object(item, at)
        # A message may give only its role (OpenAI's "easy" input message).
        kind = _field(item, "type", at, (str,), required="role" not in item)
        kind = "message" if kind is None else kind
        if kind not in ITEM_TYPES:
            raise RequestValidationError(
                f"{at}.type: items of type {kind!r} are not supported by this server; expected "
                f"one of {', '.join(ITEM_TYPES)}",
                f"{at}.type",
            )
        _common(item, at)
        items.append(_READERS[kind](item, at))
    return items


def _message_item(item: dict[str, Any], at: str) -> dict[str, Any]:
    role = _one_of(item, "role", at, ROLES, required=True)
    content = _field(item, "content", at, (str, list), required=True)
    if isinstance(content, str):
        parts = [{"type": "output_text" if role == "assistant" else "input_text", "text": content}]
    else:
        parts = _parts(content, f"{at}.content", MESSAGE_PARTS)
    return {"type": "message", "role": role, "content": parts}


def _function_call_item(item: dict[str, Any], at: str) -> dict[str, Any]:
    call_id = _field(item, "call_id", at, (str,), required=True)
    name = _field(item, "name", at, (str,), required=True)
    arguments = _field(item, "arguments", at, (str,), required=True)
    try:
        json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        raise RequestValidationError(
            f"{at}.arguments is not valid JSON: {exc}", f"{at}.arguments"
        ) from exc
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}


def _function_call_output_item(item: dict[str, Any], at: str) -> dict[str, Any]:
    call_id = _field(item, "call_id", at, (str,), required=True)
    output = _field(item, "output", at, (str, list), required=True)
    if isinstance(output, list):
        output = "".join(part["text"] for part in _parts(output, f"{at}.output", OUTPUT_PARTS))
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def _reasoning_item(item: dict[str, Any], at: str) -> dict[str, Any]:
    """The reasoning's text parts (``content``); the ``summary`` is checked, not used (it is
    not what the model wrote). ``encrypted_content`` is another server's: none can be read."""
    _parts(_field(item, "summary", at, (list,)) or [], f"{at}.summary", ("summary_text",))
    content = _parts(
        _field(item, "content", at, (list,)) or [], f"{at}.content", ("reasoning_text",)
    )
    if item.get("encrypted_content") is not None:
        raise RequestValidationError(
            f"{at}.encrypted_content: encrypted reasoning is not supported by this server (send "
            "null or leave it out)",
            f"{at}.encrypted_content",
        )
    return {"type": "reasoning", "content": content}


_READERS = {
    "message": _message_item,
    "function_call": _function_call_item,
    "function_call_output": _function_call_output_item,
    "reasoning": _reasoning_item,
}


def conversation_messages(items: list[dict[str, Any]], first_new: int) -> list[dict[str, Any]]:
    """The chat messages of a conversation's ``items`` (normalized), for the template.
    ``first_new``: the index of the first item of this request's ``input`` (the earlier ones
    come from the stored conversation), to name an item at fault as ``input[i]``.

    Items become messages as OpenAI's conversation state says: a message item is a message
    (``developer`` is ``system``), ``function_call`` items are the assistant's ``tool_calls``
    (consecutive ones, and the assistant text before them, make one assistant turn), a
    ``function_call_output`` is a ``tool`` message answering its ``call_id``, which an earlier
    ``function_call`` of the conversation must have made. A reasoning item's text is the
    ``reasoning`` of the assistant turn right after it (as the chat route passes an answer's
    reasoning back to the template); with no assistant turn after it, it is left out."""
    messages: list[dict[str, Any]] = []
    calls: set[str] = set()
    reasoning: str | None = None  # a reasoning item's, waiting for its assistant turn
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "reasoning":
            reasoning = "\n".join(part["text"] for part in item["content"]) or None
            continue
        if kind == "message":
            messages.append(_chat_message(item))
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls.add(item["call_id"])
        else:
            if item["call_id"] not in calls:
                at = f"input[{i - first_new}].call_id" if i >= first_new else "previous_response_id"
                raise RequestValidationError(
                    f"{at}: no function_call of this conversation has call_id {item['call_id']!r}",
                    at,
                )
            messages.append(
                {"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]}
            )
        if reasoning is not None and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning"] = reasoning
        reasoning = None
    return messages


def _chat_message(item: dict[str, Any]) -> dict[str, Any]:
    texts = [p["text"] if p["type"] != "refusal" else p["refusal"] for p in item["content"]]
    role = "system" if item["role"] == "developer" else item["role"]
    return {"role": role, "content": "\n".join(texts)}
