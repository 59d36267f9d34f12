"""The decoder against transformers on checkpoints transformers writes itself, one per
supported family and rotary scaling: the pool-backed forward (a prefill, then chunks, then
token-by-token decode) gives transformers' log-softmax within 1e-4. And what is not
implemented fails at load, naming it."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.config import ServerConfig
from pipeline.model_config import ARCHITECTURES, ModelConfig, context_length_of
from scheduler_proc.batch.forward_batch import ForwardBatch
from scheduler_proc.cache.kv_pool import KVPool
from scheduler_proc.model.llama import LlamaForCausalLM
from tokenizer_proc.http.worker_api import ModelIdentity

VOCAB = 320
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _transformers() -> Any:
    if importlib.util.find_spec("transformers") is None:
        message = "transformers is not installed (make test installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(message + "; CI=true: a missing reference is a failure")
        pytest.skip(message)
    import transformers

    return transformers


# Each family's config, in transformers' own classes; head_dim 32 where the family has its own
# (hidden/heads is 16), so an explicit head_dim is exercised.
FAMILIES: dict[str, Callable[[Any], Any]] = {
    "llama3-tied-bias": lambda t: t.LlamaConfig(**SHAPE, rope_scaling=LLAMA3_ROPE, tie_word_embeddings=True, head_dim=32, attention_bias=True),
    "llama-linear": lambda t: t.LlamaConfig(**SHAPE, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama-dynamic": lambda t: t.LlamaConfig(**SHAPE, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "llama-yarn": lambda t: t.LlamaConfig(**SHAPE, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": lambda t: t.Qwen2Config(**SHAPE, tie_word_embeddings=True),
    "qwen3": lambda t: t.Qwen3Config(**SHAPE, head_dim=32),
    "mistral": lambda t: t.MistralConfig(**SHAPE, sliding_window=4096),
}


def write_checkpoint(directory: Path, family: str, *, dtype: torch.dtype = torch.float32, max_shard_size: str | None = None) -> Any:
    """transformers' model with seeded weights, rescaled from its 0.02 init so attention is
    sharp enough that context (and so the rotary) changes the logits; saved by transformers."""
    t = _transformers()
    torch.manual_seed(0)
    model = t.AutoModelForCausalLM.from_config(FAMILIES[family](t), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif "embed" in name:
                p.normal_(0.0, 0.5)
            elif name.endswith("bias") or "q_proj" in name or "k_proj" in name:
                p.normal_(0.0, 0.1)
    model = model.to(dtype)
    model.save_pretrained(directory, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


def pool_logprobs(model: LlamaForCausalLM, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Log-softmax at every position, through the KV pool: ``chunks`` tokens per pass (the
    rest one by one, as decode)."""
    cfg = model.config
    kv = KVPool(cfg.num_hidden_layers, 512, cfg.num_key_value_heads, cfg.head_dim, model.dtype, "cpu")
    slots = kv.alloc(len(ids))
    assert slots is not None
    sizes = chunks + [1] * (len(ids) - sum(chunks))
    out, done = [], 0
    for n in sizes:
        batch = ForwardBatch.build([ids[done : done + n]], [slots[:done]], [slots[done : done + n]], "cpu")
        _, hidden = model(batch, kv, return_hidden=True)
        assert hidden is not None
        out.append(torch.log_softmax(model.logits(hidden), -1))
        done += n
    return torch.cat(out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_family_equals_transformers_through_the_pool(family: str, tmp_path: Path) -> None:
    reference = write_checkpoint(tmp_path, family)
    ours = LlamaForCausalLM.from_pretrained(tmp_path, device="cpu")
    assert ours.config.architecture == reference.config.architectures[0]
    ids = torch.randint(0, VOCAB, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), -1)
    torch.testing.assert_close(pool_logprobs(ours, ids, [40, 16]), expected, atol=1e-4, rtol=0)


def test_the_scalings_change_the_rotary() -> None:
    """The equality above proves something only if each scaling differs from plain rotary
    within the tested positions."""
    t = _transformers()
    plain = LlamaForCausalLM(ModelConfig.from_hf_dict(t.LlamaConfig(**SHAPE).to_dict() | {"architectures": ["LlamaForCausalLM"]}), "cpu")
    for family in ("llama3-tied-bias", "llama-linear", "llama-yarn"):
        cfg = ModelConfig.from_hf_dict(FAMILIES[family](t).to_dict() | {"architectures": ["LlamaForCausalLM"]})
        scaled = LlamaForCausalLM(dataclasses.replace(cfg, head_dim=16), "cpu")
        assert (scaled.rotary_cos[:70] - plain.rotary_cos[:70]).abs().max() > 0.1, family


def test_a_sharded_checkpoint_loads_every_shard(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "whole", "qwen3")
    write_checkpoint(tmp_path / "sharded", "qwen3", max_shard_size="100KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    # A stray weight file beside the index (as Mistral's consolidated.safetensors) is not read.
    (tmp_path / "sharded" / "consolidated.safetensors").write_bytes(b"not read")
    whole = LlamaForCausalLM.from_pretrained(tmp_path / "whole", device="cpu").state_dict()
    sharded = LlamaForCausalLM.from_pretrained(tmp_path / "sharded", device="cpu").state_dict()
    assert whole.keys() == sharded.keys() and all(torch.equal(whole[k], sharded[k]) for k in whole)


def test_dtype_is_the_checkpoints_unless_asked(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, "llama3-tied-bias", dtype=torch.bfloat16)
    assert LlamaForCausalLM.from_pretrained(tmp_path, device="cpu").dtype == torch.bfloat16
    assert LlamaForCausalLM.from_pretrained(tmp_path, device="cpu", dtype=torch.float32).dtype == torch.float32


def _config(family: str) -> dict[str, Any]:
    t = _transformers()
    cfg = FAMILIES[family](t).to_dict()
    return cfg | {"architectures": [type(t.AutoModelForCausalLM.from_config(FAMILIES[family](t))).__name__]}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "'GPT2LMHeadModel' is not supported; tokenpipe serves " + ", ".join(ARCHITECTURES)),
        ({"quantization_config": {"quant_method": "gptq"}}, "'quantization_config'"),
        ({"some_new_switch": True}, "'some_new_switch' are not implemented"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}}, "'longrope' is not supported"),
        ({"rope_interleaved": True}, "'rope_interleaved'"),
        ({"hidden_act": "gelu"}, "'hidden_act'='gelu'"),
        ({"model_type": "qwen2"}, "does not match"),
    ],
)
def test_what_the_decoder_does_not_implement_fails_naming_it(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_hf_dict(_config("llama3-tied-bias") | change)


def test_a_sliding_window_caps_the_context_and_a_longer_one_is_refused(tmp_path: Path) -> None:
    cfg = _config("mistral") | {"sliding_window": 128}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert context_length_of(ServerConfig(model_path=str(tmp_path)), VOCAB) == 128
    assert context_length_of(ServerConfig(model_path=str(tmp_path), context_length=100), VOCAB) == 100
    with pytest.raises(ValueError, match="exceeds the model's sliding_window"):
        context_length_of(ServerConfig(model_path=str(tmp_path), context_length=200), VOCAB)
    # Qwen's window is off unless use_sliding_window says so.
    qwen = _config("qwen2") | {"sliding_window": 128, "use_sliding_window": False}
    assert ModelConfig.from_hf_dict(qwen).context_limit == SHAPE["max_position_embeddings"]


def test_model_info_reports_generation_config_sampling_defaults(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_config("qwen3")))
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [1, 2], "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20})
    )
    identity = ModelIdentity.of(str(tmp_path))
    assert identity.architectures == ("Qwen3ForCausalLM",) and identity.model_type == "qwen3"
    assert identity.preferred_sampling_params == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
