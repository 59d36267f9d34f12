"""The adapters this API worker knows the scheduler serves, and what a request's names mean
(docs/design/lora.md). The scheduler owns the registry; ``ServedAdapters`` is this worker's
view of it, replaced whole by every ``SchedulerStatsReport`` and by the answer to this
worker's own load or unload, so a change is seen here before its HTTP answer goes out.

A request names its adapter as either peer does: vLLM's ``model`` (the served model's name
or an adapter's), SGLang's ``model`` of ``base:adapter`` and its ``lora_path`` (an adapter's
name; on /generate a batch's list holds one per prompt). ``resolve`` turns them into the
``LoraRef`` the request carries (None: the base model), or refuses them: an unknown
``model`` is ``UnknownModel`` (the routes' 404), an unknown ``lora_path`` SGLang's 400."""

from __future__ import annotations

from pipeline.control_frames import LoraAdapter
from pipeline.io_struct import LoraRef
from tokenizer_proc.request_edge.errors import RequestValidationError

# The refusal of a named adapter while LoRA is off: the words of every field this server
# knows and does not serve (request_edge/known_fields.py), and the flag that serves it.
LORA_OFF = (
    "lora_path is not supported by this server: it runs without --enable-lora "
    "(send null or leave it out)"
)


class UnknownModel(Exception):
    """A request's ``model`` names neither the served model nor an adapter: a 404 (a batch
    item's 400 on /generate), in the words of ``str(exc)``."""

    def __init__(self, model: str) -> None:
        super().__init__(f"the model {model!r} does not exist; see GET /v1/models")
        self.model = model


class ServedAdapters:
    """The adapters served, by name, as the scheduler last said. ``enabled``: the server
    runs with LoRA (``ServerConfig.lora_enabled``); off, no name ever resolves to one."""

    def __init__(self, model_name: str, enabled: bool) -> None:
        self.model_name = model_name
        self.enabled = enabled
        self._by_name: dict[str, LoraAdapter] = {}

    def learn(self, adapters: tuple[LoraAdapter, ...]) -> None:
        """Replaces the view with ``adapters``: every adapter served, in the scheduler's
        order (a report's, or a load's or unload's answer)."""
        self._by_name = {adapter.name: adapter for adapter in adapters}

    @property
    def adapters(self) -> tuple[LoraAdapter, ...]:
        return tuple(self._by_name.values())

    def get(self, name: str) -> LoraAdapter | None:
        return self._by_name.get(name)

    def resolve(self, model: str | None, lora_path: str | None = None) -> LoraRef | None:
        """The adapter a request runs with: ``lora_path`` when given, else what ``model``
        names (None: the base model). Raises ``UnknownModel`` for an unknown ``model`` and
        RequestValidationError (param ``lora_path``) for an unknown ``lora_path``, or for a
        ``lora_path`` that disagrees with the adapter ``model`` names."""
        by_model = self.of_model(model)
        if lora_path is None:
            return by_model
        by_path = self.of_lora_path(lora_path, "lora_path")
        if by_model is not None and by_model != by_path:
            raise RequestValidationError(
                f"model names the adapter {by_model.name!r} and lora_path names "
                f"{lora_path!r}: name one adapter",
                "lora_path",
            )
        return by_path

    def of_model(self, model: str | None) -> LoraRef | None:
        """What ``model`` names: None (absent, or the served model: the base), an adapter
        by its name, or SGLang's ``{served model}:{adapter}``."""
        if model is None or model == self.model_name:
            return None
        found = self._by_name.get(model)
        if found is None:
            base, sep, adapter = model.partition(":")
            found = self._by_name.get(adapter) if sep and base == self.model_name else None
        if found is None:
            raise UnknownModel(model)
        return LoraRef(found.name, found.id)

    def of_lora_path(self, name: str, param: str) -> LoraRef:
        """The adapter SGLang's ``lora_path`` names (``param``: where it sits in the body);
        refused in SGLang's words when none is served under ``name``."""
        if not self.enabled:
            raise RequestValidationError(LORA_OFF, param)
        found = self._by_name.get(name)
        if found is None:
            raise RequestValidationError(
                f"The following requested LoRA adapters are not loaded: {name}\n"
                f"Loaded adapters: dict_keys({list(self._by_name)!r}).",
                param,
            )
        return LoraRef(found.name, found.id)

    def served_name(self, lora: LoraRef | None) -> str:
        """The name an answer's ``model`` shows, as vLLM's does: the adapter's, or the
        served model's."""
        return lora.name if lora is not None else self.model_name
