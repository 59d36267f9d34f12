"""What a LoRA-serving scheduler holds (``--enable-lora``, docs/design/lora.md): the
registry of adapters served and the model's device slots, built together at start with
the adapters of ``--lora-modules`` / ``--lora-paths`` already loaded."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.config import ServerConfig
from pipeline.control_frames import LoraAdapter
from pipeline.lora_modules import parse_lora_modules
from pipeline.model_config import ModelConfig
from scheduler_proc.lora.registry import LoraRegistry
from scheduler_proc.lora.slots import LoraSlots
from scheduler_proc.model.llama import LlamaForCausalLM
from scheduler_proc.model.lora_delta import LoraPass


@dataclass
class LoraRuntime:
    registry: LoraRegistry
    slots: LoraSlots

    @classmethod
    def start(
        cls, config: ServerConfig, model_config: ModelConfig, model: LlamaForCausalLM
    ) -> LoraRuntime:
        """The registry with the start's adapters loaded (a LoraError, naming the adapter and
        its key, fails the start) and the slots on ``model``."""
        max_cpu = config.max_cpu_loras if config.max_cpu_loras is not None else config.max_loras
        registry = LoraRegistry(model_config, config.max_lora_rank, max_cpu)
        for module in parse_lora_modules(config.lora_modules, config.lora_paths):
            registry.load(module.name, module.path)
        return cls(registry, LoraSlots(model, config.max_loras, config.max_lora_rank))

    def acquire(self, adapter: LoraAdapter) -> int | None:
        """Pins a slot holding ``adapter`` (None: every slot is pinned by others); LoraError
        when its weights must be read again and its directory no longer holds them."""
        return self.slots.acquire(adapter, self.registry.weights)

    def release(self, adapter: LoraAdapter) -> None:
        self.slots.release(adapter.id)

    def pass_for(self, token_slots: np.ndarray) -> LoraPass | None:
        """The pass of tokens using ``token_slots`` (-1: base); None, and no work in the
        pass, when no token uses an adapter."""
        if not bool((token_slots >= 0).any()):
            return None
        return self.slots.pass_for(torch.from_numpy(token_slots.astype(np.int64)))
