"""The decoder against transformers on checkpoints transformers writes itself, one per
supported family and rotary scaling: the pool-backed forward (a prefill, then chunks, then
token-by-token decode) gives transformers' log-softmax within 1e-4. And what is not
implemented fails at load, naming it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import family_checkpoints
from pipeline.config import ServerConfig
from pipeline.model_config import ARCHITECTURES, ModelConfig, context_length_of
from pipeline.tokenizer_loader import SHIPPED_VOCAB_SIZE
from scheduler_proc.model.forward_batch import ForwardBatch
from scheduler_proc.cache.kv_pool import KVPool
from scheduler_proc.model.llama import LlamaForCausalLM
from tests.hf_checkpoints import TINY, require_transformers
from tokenizer_proc.http.worker_api import ModelIdentity

VOCAB = SHIPPED_VOCAB_SIZE


# Each case: a family of bench/family_checkpoints.py and config keys that vary it. head_dim 32
# where set (hidden/heads is 16), so an explicit head_dim is exercised.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-tied-bias": ("llama3", {"head_dim": 32, "attention_bias": True}),
    "llama-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "llama-dynamic": ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}),
    "llama-yarn": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
    "mistral": ("mistral", {"sliding_window": 4096}),
}


def write_checkpoint(directory: Path, case: str, **kw: Any) -> Any:
    require_transformers()
    family, overrides = CASES[case]
    return family_checkpoints.write(directory, family, shape=TINY, **kw, **overrides)


def pool_logprobs(model: LlamaForCausalLM, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """Log-softmax at every position, through the KV pool: ``chunks`` tokens per pass (the
    rest one by one, as decode)."""
    cfg = model.config
    kv = KVPool(
        cfg.num_hidden_layers, 512, cfg.num_key_value_heads, cfg.head_dim, model.dtype, "cpu"
    )
    slots = kv.alloc(len(ids))
    assert slots is not None
    sizes = chunks + [1] * (len(ids) - sum(chunks))
    out, done = [], 0
    for n in sizes:
        batch = ForwardBatch.build(
            [ids[done : done + n]], [slots[:done]], [slots[done : done + n]], "cpu"
        )
        _, hidden = model(batch, kv, return_hidden=True)
        assert hidden is not None
        out.append(torch.log_softmax(model.logits(hidden), -1))
        done += n
    return torch.cat(out)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_family_equals_transformers_through_the_pool(
    case: str, deterministic: bool, tmp_path: Path
) -> None:
    """Both kernel sets: the default, and --enable-deterministic-inference's, whose logprobs
    are moreover the same bits however the positions are split into passes."""
    reference = write_checkpoint(tmp_path, case)
    ours = LlamaForCausalLM.from_pretrained(tmp_path, device="cpu", deterministic=deterministic)
    assert ours.config.architecture == reference.config.architectures[0]
    ids = torch.randint(0, VOCAB, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), -1)
    got = pool_logprobs(ours, ids, [40, 16])
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    if deterministic:
        for chunks in ([70], [1, 5, 33], []):  # whole, ragged chunks, every position a decode
            assert torch.equal(pool_logprobs(ours, ids, chunks), got), chunks


def test_the_scalings_change_the_rotary() -> None:
    """The equality above proves something only if each scaling differs from plain rotary
    within the tested positions."""
    for case in ("llama3-tied-bias", "llama-linear", "llama-yarn"):
        cfg = ModelConfig.from_hf_dict(_config(case))
        assert cfg.rope_scaling is not None
        plain = LlamaForCausalLM(dataclasses.replace(cfg, rope_scaling=None), "cpu")
        scaled = LlamaForCausalLM(cfg, "cpu")
        assert (scaled.rotary_cos[:70] - plain.rotary_cos[:70]).abs().max() > 0.1, case


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
    assert (
        LlamaForCausalLM.from_pretrained(tmp_path, device="cpu", dtype=torch.float32).dtype
        == torch.float32
    )


def _config(case: str) -> dict[str, Any]:
    """The config.json transformers writes for ``case``."""
    require_transformers()
    family, overrides = CASES[case]
    cfg = family_checkpoints.hf_config(family, TINY, **overrides)
    return json.loads(cfg.to_json_string()) | {
        "architectures": [cfg.__class__.__name__.replace("Config", "ForCausalLM")]
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            "'GPT2LMHeadModel' is not supported; tokenpipe serves " + ", ".join(ARCHITECTURES),
        ),
        ({"quantization_config": {"quant_method": "gptq"}}, "'quantization_config'"),
        ({"some_new_switch": True}, "'some_new_switch' are not implemented"),
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0}},
            "'longrope' is not supported",
        ),
        ({"rope_interleaved": True}, "'rope_interleaved'"),
        ({"hidden_act": "gelu"}, "'hidden_act'='gelu'"),
        ({"model_type": "qwen2"}, "does not match"),
    ],
)
def test_what_the_decoder_does_not_implement_fails_naming_it(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_hf_dict(_config("llama3-tied-bias") | change)


def test_a_sliding_window_caps_the_context_and_a_longer_one_is_refused(tmp_path: Path) -> None:
    cfg = _config("mistral") | {"sliding_window": 128}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert context_length_of(ServerConfig(model_path=str(tmp_path)), VOCAB) == 128
    assert (
        context_length_of(ServerConfig(model_path=str(tmp_path), context_length=100), VOCAB) == 100
    )
    with pytest.raises(ValueError, match="exceeds the model's sliding_window"):
        context_length_of(ServerConfig(model_path=str(tmp_path), context_length=200), VOCAB)
    # Qwen's window is off unless use_sliding_window says so.
    qwen = _config("qwen2") | {"sliding_window": 128, "use_sliding_window": False}
    assert ModelConfig.from_hf_dict(qwen).context_limit == TINY.positions


def test_model_info_reports_generation_config_sampling_defaults(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(_config("qwen3")))
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "eos_token_id": [1, 2],
                "do_sample": True,
                "temperature": 0.6,
                "top_p": 0.95,
                "top_k": 20,
            }
        )
    )
    identity = ModelIdentity.of(str(tmp_path))
    assert identity.architectures == ("Qwen3ForCausalLM",) and identity.model_type == "qwen3"
    assert identity.preferred_sampling_params == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
