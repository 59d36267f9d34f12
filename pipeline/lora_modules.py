"""The adapters a server is started with, as both peers spell them: vLLM's ``--lora-modules``
(``name=path``, or JSON ``{"name", "path", "base_model_name"}``) and SGLang's
``--lora-paths`` (``name=path``, a bare path that is its own name, or JSON
``{"lora_name", "lora_path", "pinned"}``). Parsed once, in the config check, so a bad entry
fails the start with the flag's name."""

from __future__ import annotations

import json
from typing import NamedTuple


class LoraModule(NamedTuple):
    name: str
    path: str


def parse_lora_modules(modules: tuple[str, ...], paths: tuple[str, ...]) -> list[LoraModule]:
    """Every adapter of both flags, in order; ValueError naming the flag and the entry that
    cannot be read, or a name given twice."""
    found = [_parse(entry, "--lora-modules", ("name", "path")) for entry in modules]
    found += [_parse(entry, "--lora-paths", ("lora_name", "lora_path")) for entry in paths]
    seen: set[str] = set()
    for module in found:
        if module.name in seen:
            raise ValueError(f"adapter name {module.name!r} is given twice")
        seen.add(module.name)
    return found


def _parse(entry: str, flag: str, keys: tuple[str, str]) -> LoraModule:
    text = entry.strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{flag}: {entry!r} is not valid JSON: {exc}") from exc
        name, path = (spec.get(key) if isinstance(spec, dict) else None for key in keys)
        if not (isinstance(name, str) and isinstance(path, str) and name and path):
            raise ValueError(f"{flag}: {entry!r} needs string {keys[0]!r} and {keys[1]!r}")
        return LoraModule(name, path)
    name, sep, path = text.partition("=")
    if not sep:
        if flag == "--lora-paths" and text:  # SGLang: a bare path names itself
            return LoraModule(text, text)
        raise ValueError(f"{flag}: {entry!r} is not name=path")
    if not name or not path:
        raise ValueError(f"{flag}: {entry!r} needs both a name and a path (name=path)")
    return LoraModule(name, path)
