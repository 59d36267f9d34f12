"""Owns the model, its KV pool and the device; turns a list of (request, new tokens) into
one batched forward pass. Nothing above this module touches torch devices."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.config import ServerConfig
from pipeline.model_config import load_model_config
from scheduler_proc.model.forward_batch import ForwardBatch, decode_key_columns, key_align
from scheduler_proc.cache.kv_pool import KVPool
from scheduler_proc.cache.row_kv import NoRowKV, RowKV
from scheduler_proc.lora.runtime import LoraRuntime
from scheduler_proc.model.host_memory import keep_freed_host_memory
from scheduler_proc.model.llama import LlamaForCausalLM
from scheduler_proc.model.thread_budget import thread_budget
from scheduler_proc.model.weights import DTYPES
from scheduler_proc.sampling.sampler import SamplingColumns, sample


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def row_kv_budget(config: ServerConfig, device: torch.device) -> int:
    """Token positions the running batch's dense KV copy may hold (0: none; decode passes
    gather from the pool). As many as the pool, so KV memory at most doubles. Off on CUDA
    by default: a GPU gathers rows at memory bandwidth, and its pool is sized to the memory
    it has."""
    if config.decode_kv_rows == "off" or (
        config.decode_kv_rows == "auto" and device.type == "cuda"
    ):
        return 0
    return config.max_total_tokens


class ModelRunner:
    def __init__(self, config: ServerConfig, vocab_size: int) -> None:
        keep_freed_host_memory()  # before the model's first allocation: see host_memory.py
        # Intra-op threads: what the other processes leave idle, or --torch-threads N.
        self.threads = thread_budget(config, torch.set_num_threads)
        self.device = resolve_device(config.device)
        self.model_config = load_model_config(config, vocab_size)
        # --dtype auto: the checkpoint's own; the built-in model's is float32.
        dtype = None if config.dtype == "auto" else DTYPES[config.dtype]
        deterministic = config.enable_deterministic_inference
        if config.model_path is None:
            self.model = LlamaForCausalLM.random(
                self.model_config,
                seed=config.model_seed,
                device=self.device,
                dtype=dtype or torch.float32,
                deterministic=deterministic,
            )
        else:
            self.model = LlamaForCausalLM.from_pretrained(
                config.model_path, device=self.device, dtype=dtype, deterministic=deterministic
            )
        self.key_align = key_align(deterministic)
        self.model.eval()
        mc = self.model_config
        self.kv = KVPool(
            mc.num_hidden_layers,
            config.max_total_tokens,
            mc.num_key_value_heads,
            mc.head_dim,
            self.model.dtype,
            self.device,
        )
        budget = row_kv_budget(config, self.device)
        self.row_kv: RowKV | NoRowKV = RowKV(self.kv, budget) if budget else NoRowKV()
        # Adapters (docs/design/lora.md): the registry and the model's slots; None unless
        # the server serves adapters, and then a pass without adapter rows does no LoRA work.
        self.lora = (
            LoraRuntime.start(config, self.model_config, self.model)
            if config.lora_enabled
            else None
        )

    def extend(
        self,
        new_token_ids: list[list[int]],
        prefix_slots: list[torch.Tensor],
        new_slots: list[torch.Tensor],
        *,
        return_hidden: bool = False,
        lora_slots: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One batched pass: sequence b has ``prefix_slots[b]`` already in the pool and
        appends ``new_token_ids[b]`` into ``new_slots[b]``, with the adapter in LoRA slot
        ``lora_slots[b]`` (-1 or None: the base model). Returns last-token logits [B, V]
        and, when asked, the final hidden states of all new tokens [T, H]."""
        batch = ForwardBatch.build(new_token_ids, prefix_slots, new_slots, self.device)
        lora = None
        if lora_slots is not None and self.lora is not None:
            per_token = np.repeat(lora_slots, [len(ids) for ids in new_token_ids])
            lora = self.lora.pass_for(per_token)
        with torch.inference_mode():
            return self.model.forward(batch, self.kv, return_hidden=return_hidden, lora=lora)

    def decode(
        self,
        last_tokens: np.ndarray,
        seq_lens: np.ndarray,
        kv_slot_table: torch.Tensor,
        joined: np.ndarray,
        lora_slots: np.ndarray | None = None,
    ) -> torch.Tensor:
        """One decode pass over the running batch (``RunningBatch``'s columns): row b's last
        token, at position ``seq_lens[b] - 1``, whose KV slot is in ``kv_slot_table``; the
        request in row b joined the batch as ``joined[b]`` (which says whether the dense KV
        copy's row b is still its) and runs the adapter in LoRA slot ``lora_slots[b]`` (-1 or
        None: the base model). Returns last-token logits [B, V]."""
        row_kv = self.row_kv.prepare(
            joined,
            seq_lens,
            kv_slot_table,
            decode_key_columns(kv_slot_table.shape[1], self.key_align),
        )
        batch = ForwardBatch.decode(
            torch.from_numpy(last_tokens.astype(np.int64)),
            torch.from_numpy(seq_lens),
            kv_slot_table,
            self.device,
            row_kv,
        )
        lora = None
        if lora_slots is not None and self.lora is not None:
            lora = self.lora.pass_for(lora_slots)
        with torch.inference_mode():
            logits, _ = self.model.forward(batch, self.kv, lora=lora)
            return logits

    def verify(self, batch: ForwardBatch, lora_tokens: np.ndarray | None = None) -> torch.Tensor:
        """A speculative verify pass (``ForwardBatch.verify``), new token i with the adapter
        in LoRA slot ``lora_tokens[i]`` (-1 or None: the base model). Returns the float32
        logits of every new token [T, V], in order (a row's last token, then its drafts)."""
        lora = None
        if lora_tokens is not None and self.lora is not None:
            lora = self.lora.pass_for(lora_tokens)
        with torch.inference_mode():
            return self.model.logits(self.model.hidden_states(batch, self.kv, lora))

    def logits_at(
        self,
        new_token_ids: list[list[int]],
        prefix_slots: list[torch.Tensor],
        new_slots: list[torch.Tensor],
        rows: torch.Tensor,
        bidirectional_from: list[int],
    ) -> torch.Tensor:
        """One batched pass as ``extend``, where the new tokens of sequence b at positions
        from ``bidirectional_from[b]`` on attend to each other both ways (a dLLM block).
        Returns float32 logits [len(rows), V] at ``rows``, indices into the concatenated
        new tokens."""
        batch = ForwardBatch.build(
            new_token_ids, prefix_slots, new_slots, self.device, bidirectional_from
        )
        with torch.inference_mode():
            h = self.model.hidden_states(batch, self.kv)
            return self.model.logits(h.index_select(0, rows.to(h.device)))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states (rows of an ``extend(..., return_hidden=True)``)."""
        with torch.inference_mode():
            return self.model.logits(hidden)

    def sample(self, logits: torch.Tensor, columns: SamplingColumns) -> np.ndarray:
        """One token per row of ``logits`` (the sampler's batched draw). Called through the
        runner so that the sampling math, device work like the forward, is timed apart."""
        return sample(logits, columns)
