"""The adapters a scheduler serves, by name, and the host copies of their weights.

A load reads and checks the adapter's files at once, so a bad adapter fails its load, and
gives it a new id (vLLM's ``lora_int_id``, from 1, never reused): whatever was kept for an
id, KV or a device slot, belongs to those weights alone. An unloaded adapter leaves the
names but keeps its weights reachable by ``weights`` for the requests still running on it.
At most ``max_cpu_loras`` adapters' weights stay read, least recently used going first; an
evicted one is read from its directory again. Errors carry vLLM's wording and status."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

from pipeline.control_frames import LoraAdapter
from pipeline.model_config import ModelConfig
from scheduler_proc.lora.adapter_files import LoraError, LoraWeights, read_adapter


class LoraRegistry:
    def __init__(self, model_config: ModelConfig, max_rank: int, max_cpu_loras: int) -> None:
        self.model_config = model_config
        self.max_rank = max_rank
        self.max_cpu_loras = max(1, max_cpu_loras)
        self._served: dict[str, LoraAdapter] = {}  # by name, in load order
        self._host: OrderedDict[int, LoraWeights] = OrderedDict()
        self._last_id = 0

    def load(self, name: str, path: str) -> LoraAdapter:
        """Serve the adapter in directory ``path`` as ``name``; LoraError when the name is
        taken or the files cannot be served exactly (nothing changes then)."""
        if not name or not path:
            raise LoraError("Both 'lora_name' and 'lora_path' must be provided.")
        if name in self._served:
            raise LoraError(f"The lora adapter '{name}' has already been loaded.")
        if not Path(path).is_dir():
            raise LoraError(f"Loading lora {name} failed: No adapter found for {path}", 404)
        try:
            weights = read_adapter(path, self.model_config, self.max_rank)
        except LoraError as exc:
            raise LoraError(f"Loading lora {name} failed: {exc}", exc.status_code) from exc
        self._last_id += 1
        adapter = LoraAdapter(name=name, path=path, id=self._last_id)
        self._served[name] = adapter
        self._keep(adapter.id, weights)
        return adapter

    def unload(self, name: str) -> LoraAdapter:
        """Stop serving ``name`` to new requests; LoraError (404) when it is not served."""
        adapter = self._served.pop(name, None)
        if adapter is None:
            raise LoraError(f"The lora adapter '{name}' cannot be found.", 404)
        return adapter

    def adapters(self) -> tuple[LoraAdapter, ...]:
        """The adapters served, in load order."""
        return tuple(self._served.values())

    def by_name(self, name: str) -> LoraAdapter | None:
        return self._served.get(name)

    def by_id(self, adapter_id: int) -> LoraAdapter | None:
        """The served adapter of this load id (None once unloaded). A scan: adapters are
        few, and it runs once per arriving request."""
        return next((a for a in self._served.values() if a.id == adapter_id), None)

    def weights(self, adapter: LoraAdapter) -> LoraWeights:
        """The adapter's weights, from the host copies or read again from its directory
        (LoraError when the directory no longer holds an adapter that fits)."""
        weights = self._host.get(adapter.id)
        if weights is None:
            weights = read_adapter(adapter.path, self.model_config, self.max_rank)
            self._keep(adapter.id, weights)
        else:
            self._host.move_to_end(adapter.id)
        return weights

    def host_copies(self) -> tuple[int, ...]:
        """Ids of the adapters whose weights are kept read, least recently used first."""
        return tuple(self._host)

    def _keep(self, adapter_id: int, weights: LoraWeights) -> None:
        self._host[adapter_id] = weights
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
