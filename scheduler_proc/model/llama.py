"""The decoder (RMSNorm, rotary, SwiGLU, GQA) that reads and writes the token-level KV pool.

One module serves every architecture of ``pipeline.model_config.ARCHITECTURES`` (Llama,
Qwen2, Qwen3, Mistral): their differences are switches of ``ModelConfig`` (projection
biases, per-head q/k RMSNorm, explicit head_dim, the rotary scaling of
``scheduler_proc.model.rotary``), not copies of the decoder.

Hot-path invariants (forward): one pass per call for the whole batch (per-layer work is
batched tensor ops; the only Python loop is over layers); the attention layout (padding
index, mask, rotary rows) is computed once per pass and shared by every layer; one host
sync per pass (max new length, to size the padded query block).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from pipeline.model_config import ModelConfig
from scheduler_proc.model.forward_batch import AttentionLayout, ForwardBatch
from scheduler_proc.cache.kv_pool import KVPool
from scheduler_proc.model import batch_invariant
from scheduler_proc.model.attention import pool_attention
from scheduler_proc.model.lora_delta import LoraPass, add_delta
from scheduler_proc.model.rotary import rotary_tables
from scheduler_proc.model.weights import (
    checkpoint_dtype,
    checkpoint_files,
    load_weights,
    read_config,
)


def _param(shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised on purpose: random() or from_pretrained() always overwrites it, and
    # default Linear init would be wasted work on every load.
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    bias: torch.Tensor | None
    # LoRA slots' stacked A [slots * rank, in] and B [out, slots * rank] (set by
    # scheduler_proc.lora.slots); None: no adapter changes this projection.
    lora_a: torch.Tensor | None
    lora_b: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        device: torch.device | str,
        dtype: torch.dtype,
        *,
        bias: bool = False,
        deterministic: bool = False,
    ) -> None:
        super().__init__()
        self.weight = _param((out_features, in_features), device, dtype)
        if bias:
            self.bias = _param((out_features,), device, dtype)
        else:
            self.register_parameter("bias", None)
        # Each row the same bits at any row count (batch_invariant.linear), chosen once here.
        self._linear = batch_invariant.linear if deterministic else F.linear
        # Non-persistent buffers: no checkpoint, weight load or weight update sees them.
        self.register_buffer("lora_a", None, persistent=False)
        self.register_buffer("lora_b", None, persistent=False)

    def forward(self, x: torch.Tensor, lora: LoraPass | None = None) -> torch.Tensor:
        y = self._linear(x, self.weight, self.bias)
        if lora is None or self.lora_a is None or self.lora_b is None:
            return y
        return add_delta(y, x, self.lora_a, self.lora_b, lora, self._linear)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int, device: torch.device | str, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param((num, dim), device, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(
        self, dim: int, eps: float, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.weight = _param((dim,), device, dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 then scale in the model dtype, as HF Llama does, so
        # half-precision checkpoints give the logits they were trained with.
        y = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)
        return self.weight * y


class LlamaAttention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        device: torch.device | str,
        dtype: torch.dtype,
        deterministic: bool,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        h, q_dim, kv_dim = (
            cfg.hidden_size,
            cfg.num_attention_heads * cfg.head_dim,
            cfg.num_key_value_heads * cfg.head_dim,
        )

        def proj(n_in: int, n_out: int, bias: bool) -> Linear:
            return Linear(n_in, n_out, device, dtype, bias=bias, deterministic=deterministic)

        self.q_proj = proj(h, q_dim, cfg.qkv_bias)
        self.k_proj = proj(h, kv_dim, cfg.qkv_bias)
        self.v_proj = proj(h, kv_dim, cfg.qkv_bias)
        self.o_proj = proj(q_dim, h, cfg.o_bias)
        # Qwen3: each head's q and k are RMS-normed over head_dim before the rotary.
        self.q_norm = (
            RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device, dtype) if cfg.qk_norm else None
        )
        self.k_norm = (
            RMSNorm(cfg.head_dim, cfg.rms_norm_eps, device, dtype) if cfg.qk_norm else None
        )

    def forward(
        self, x: torch.Tensor, layout: AttentionLayout, kv: KVPool, lora: LoraPass | None
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x, lora).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x, lora).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x, lora).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, layout.cos, layout.sin), apply_rotary(k, layout.cos, layout.sin)
        out = pool_attention(
            q,
            k,
            v,
            layout,
            kv.k[self.layer_idx],
            kv.v[self.layer_idx],
            self.head_dim**-0.5,
            self.layer_idx,
        )
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim), lora)


class LlamaMLP(nn.Module):
    def __init__(
        self, cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype, deterministic: bool
    ) -> None:
        super().__init__()
        h, i, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear(h, i, device, dtype, bias=bias, deterministic=deterministic)
        self.up_proj = Linear(h, i, device, dtype, bias=bias, deterministic=deterministic)
        self.down_proj = Linear(i, h, device, dtype, bias=bias, deterministic=deterministic)
        self.silu = batch_invariant.silu if deterministic else F.silu

    def forward(self, x: torch.Tensor, lora: LoraPass | None) -> torch.Tensor:
        gated = self.silu(self.gate_proj(x, lora)) * self.up_proj(x, lora)
        return self.down_proj(gated, lora)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        layer_idx: int,
        device: torch.device | str,
        dtype: torch.dtype,
        deterministic: bool,
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, device, dtype, deterministic)
        self.mlp = LlamaMLP(cfg, device, dtype, deterministic)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)

    def forward(
        self, h: torch.Tensor, layout: AttentionLayout, kv: KVPool, lora: LoraPass | None
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), layout, kv, lora)
        return h + self.mlp(self.post_attention_layernorm(h), lora)


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype, deterministic: bool
    ) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, device, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, device, dtype, deterministic)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)


class LlamaForCausalLM(nn.Module):
    """Parameter names match HF LlamaForCausalLM, so checkpoints load by name."""

    # Buffers (register_buffer below), declared so their type is known: nn.Module's
    # attribute lookup is typed Tensor | Module.
    rotary_cos: torch.Tensor
    rotary_sin: torch.Tensor

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        *,
        deterministic: bool = False,
    ) -> None:
        """``deterministic``: every row's result the same bits in any pass
        (``--enable-deterministic-inference``, ``scheduler_proc.model.batch_invariant``)."""
        super().__init__()
        self.config = config
        self.deterministic = deterministic
        self.model = LlamaModel(config, device, dtype, deterministic)
        self.lm_head = Linear(
            config.hidden_size, config.vocab_size, device, dtype, deterministic=deterministic
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rotary_tables(config, config.context_limit)
        # Non-persistent: derived from the config, never part of a checkpoint.
        self.register_buffer("rotary_cos", cos.to(device), persistent=False)
        self.register_buffer("rotary_sin", sin.to(device), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @torch.inference_mode()
    def forward(
        self,
        batch: ForwardBatch,
        kv: KVPool,
        *,
        return_hidden: bool = False,
        lora: LoraPass | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns float32 logits [B, vocab] at each sequence's last new token and, when
        return_hidden, the final-normed hidden states [T, hidden] of all new tokens.
        ``lora``: the adapters' delta of the pass's tokens (None: the base model alone)."""
        h = self.hidden_states(batch, kv, lora)
        # lm_head only on the rows that are sampled from: the vocab matmul dominates at decode.
        last = torch.cumsum(batch.new_lens, 0) - 1
        return self.logits(h[last]), (h if return_hidden else None)

    @torch.inference_mode()
    def hidden_states(
        self, batch: ForwardBatch, kv: KVPool, lora: LoraPass | None = None
    ) -> torch.Tensor:
        """The final-normed hidden states [T, hidden] of all new tokens; writes their KV."""
        layout = AttentionLayout.from_batch(
            batch, self.rotary_cos, self.rotary_sin, self.dtype, deterministic=self.deterministic
        )
        h = self.model.embed_tokens(batch.input_ids)
        for layer in self.model.layers:
            h = layer(h, layout, kv, lora)
        return self.model.norm(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] of final hidden states [N, hidden]."""
        return self.lm_head(h).float()

    @classmethod
    def random(
        cls,
        config: ModelConfig,
        seed: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
        *,
        deterministic: bool = False,
    ) -> LlamaForCausalLM:
        """Seeded init, drawn on the CPU in float32 so the weights are the same on every
        device and dtype conversion is the only difference."""
        model = cls(config, device, dtype, deterministic=deterministic)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():  # deduplicates a tied lm_head
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    p.copy_(
                        torch.randn(p.shape, generator=gen, dtype=torch.float32) * _init_std(name)
                    )
        return model

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        *,
        deterministic: bool = False,
    ) -> LlamaForCausalLM:
        """Load config.json and the checkpoint's safetensors (every shard of
        model.safetensors.index.json). dtype=None keeps the checkpoint's dtype."""
        model_dir = Path(model_dir)
        config = ModelConfig.from_hf_dict(read_config(model_dir))
        files = checkpoint_files(model_dir)
        model_dtype = dtype or checkpoint_dtype(config, files)
        model = cls(config, device, model_dtype, deterministic=deterministic)
        load_weights(model, files)
        return model

    def save_pretrained(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        model_dir.mkdir(parents=True, exist_ok=True)
        hf = self.config.to_hf_dict()
        hf["torch_dtype"] = str(self.dtype).removeprefix("torch.")
        (model_dir / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        tensors = {
            name: t.detach().contiguous().cpu()
            for name, t in self.state_dict().items()
            # A tied head is the embedding; HF omits it, and safetensors rejects shared storage.
            if not (self.config.tie_word_embeddings and name == "lm_head.weight")
        }
        save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF Llama rotate_half convention: the two halves of head_dim form the (re, im) pairs."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _init_std(name: str) -> float:
    # With std 0.02 everywhere, attention is uniform and its output outweighs the tiny
    # embeddings, so greedy decoding sticks on one token. Larger embeddings keep the
    # current token visible; larger q/k make attention sharp enough that context still
    # changes the logits (which is what the KV-path tests rely on).
    if "embed_tokens" in name:
        return 0.5
    if "q_proj" in name or "k_proj" in name:
        return 0.1
    return 0.02
