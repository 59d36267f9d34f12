"""The scheduler's model and KV pool: the batched, pool-backed forward must agree with a
plain full-sequence causal forward, whatever the chunking, batching and slot placement."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.model_config import ModelConfig, default_model_config
from scheduler_proc.model.forward_batch import ForwardBatch
from scheduler_proc.cache.kv_pool import KVPool
from scheduler_proc.model.llama import LlamaForCausalLM

DEVICE = "cpu"
ATOL = 1e-4


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return LlamaForCausalLM.random(default_model_config(1024), seed=0, device=DEVICE)


def new_pool(model: LlamaForCausalLM, capacity: int = 1024, debug: bool = True) -> KVPool:
    c = model.config
    return KVPool(
        c.num_hidden_layers,
        capacity,
        c.num_key_value_heads,
        c.head_dim,
        model.dtype,
        DEVICE,
        debug=debug,
    )


def reference_forward(model: LlamaForCausalLM, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook causal Llama in float64 on the same weights: (logits [T, V], normed hidden
    [T, H])."""
    c = model.config
    w = {k: v.double() for k, v in model.state_dict().items()}
    t, d, g = len(ids), c.head_dim, c.num_attention_heads // c.num_key_value_heads

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * weight

    inv_freq = c.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.arange(t, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = (
        torch.cat([angles.cos()] * 2, -1)[:, None],
        torch.cat([angles.sin()] * 2, -1)[:, None],
    )

    def rope(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    causal = torch.ones(t, t, dtype=torch.bool).tril()
    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        hn = rms(x, w[p + "input_layernorm.weight"])
        q = rope((hn @ w[p + "self_attn.q_proj.weight"].T).view(t, -1, d)).transpose(0, 1)
        k = rope((hn @ w[p + "self_attn.k_proj.weight"].T).view(t, -1, d)).transpose(0, 1)
        v = (hn @ w[p + "self_attn.v_proj.weight"].T).view(t, -1, d).transpose(0, 1)
        k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        scores = (q @ k.transpose(1, 2) / math.sqrt(d)).masked_fill(~causal, float("-inf"))
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, -1)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        hn = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = hn @ w[p + "mlp.gate_proj.weight"].T, hn @ w[p + "mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    hidden = rms(x, w["model.norm.weight"])
    head = w["model.embed_tokens.weight"] if c.tie_word_embeddings else w["lm_head.weight"]
    return (hidden @ head.T).float(), hidden.float()


def prompt(n: int, seed: int, vocab: int = 1024) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Seq:
    """One sequence's token ids and pool slots, extended chunk by chunk."""

    def __init__(self, ids: list[int], slots: torch.Tensor) -> None:
        self.ids, self.slots, self.done = ids, slots, 0

    def step(self, n: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        chunk = (
            self.ids[self.done : self.done + n],
            self.slots[: self.done],
            self.slots[self.done : self.done + n],
        )
        self.done += n
        return chunk


def extend(model: LlamaForCausalLM, kv: KVPool, seqs: list[Seq], ns: list[int], **kw):
    parts = [s.step(n) for s, n in zip(seqs, ns)]
    batch = ForwardBatch.build(
        [p[0] for p in parts], [p[1] for p in parts], [p[2] for p in parts], DEVICE
    )
    return model(batch, kv, **kw)


def test_single_prefill_matches_reference(model: LlamaForCausalLM) -> None:
    ids = prompt(37, seed=1)
    kv = new_pool(model)
    logits, hidden = extend(
        model, kv, [Seq(ids, kv.alloc(len(ids)))], [len(ids)], return_hidden=True
    )
    ref_logits, ref_hidden = reference_forward(model, ids)
    torch.testing.assert_close(logits[0], ref_logits[-1], atol=ATOL, rtol=0)
    assert hidden is not None and hidden.shape == (len(ids), model.config.hidden_size)
    torch.testing.assert_close(hidden, ref_hidden, atol=ATOL, rtol=0)


def test_prefill_in_three_chunks_matches_reference(model: LlamaForCausalLM) -> None:
    ids = prompt(50, seed=2)
    kv = new_pool(model)
    seq = Seq(ids, kv.alloc(len(ids)))
    for n in (16, 21, 13):
        logits, hidden = extend(model, kv, [seq], [n])
        assert hidden is None
    torch.testing.assert_close(logits[0], reference_forward(model, ids)[0][-1], atol=ATOL, rtol=0)


def test_decode_token_by_token_matches_reference(model: LlamaForCausalLM) -> None:
    ids = prompt(30, seed=3)
    kv = new_pool(model)
    seq = Seq(ids, kv.alloc(len(ids)))
    extend(model, kv, [seq], [20])
    ref_logits, _ = reference_forward(model, ids)
    for pos in range(20, 30):
        logits, _ = extend(model, kv, [seq], [1])
        torch.testing.assert_close(logits[0], ref_logits[pos], atol=ATOL, rtol=0)


def test_mixed_batch_with_shuffled_slots_matches_reference(model: LlamaForCausalLM) -> None:
    lengths = [1, 6, 17, 40, 9]
    prompts = [prompt(n + 2, seed=10 + i) for i, n in enumerate(lengths)]
    kv = new_pool(model, capacity=512)
    # Non-contiguous, interleaved slots across sequences, as after heavy alloc/free churn.
    every = kv.alloc(kv.capacity)
    kv.free(every)
    shuffled = every[torch.randperm(kv.capacity, generator=torch.Generator().manual_seed(0))]
    seqs, at = [], 0
    for p in prompts:
        seqs.append(Seq(p, shuffled[at : at + len(p)]))
        at += len(p)

    # One batched prefill of unequal lengths (padded queries), then two batched decode steps.
    extend(model, kv, seqs, lengths)
    for step in range(2):
        logits, _ = extend(model, kv, seqs, [1] * len(seqs))
        for b, p in enumerate(prompts):
            ref = reference_forward(model, p[: lengths[b] + step + 1])[0][-1]
            torch.testing.assert_close(logits[b], ref, atol=ATOL, rtol=0)


def test_decode_and_prefill_chunks_share_one_pass(model: LlamaForCausalLM) -> None:
    a, b = prompt(12, seed=20), prompt(25, seed=21)
    kv = new_pool(model)
    sa, sb = Seq(a, kv.alloc(len(a))), Seq(b, kv.alloc(len(b)))
    extend(model, kv, [sa, sb], [11, 10])
    logits, hidden = extend(model, kv, [sa, sb], [1, 15], return_hidden=True)
    torch.testing.assert_close(logits[0], reference_forward(model, a)[0][-1], atol=ATOL, rtol=0)
    ref_b_logits, ref_b_hidden = reference_forward(model, b)
    torch.testing.assert_close(logits[1], ref_b_logits[-1], atol=ATOL, rtol=0)
    assert hidden is not None
    torch.testing.assert_close(hidden[1:], ref_b_hidden[10:], atol=ATOL, rtol=0)


def test_forward_batch_layout() -> None:
    batch = ForwardBatch.build(
        [[5, 6], [7]],
        [torch.tensor([10, 11, 12]), torch.tensor([], dtype=torch.long)],
        [torch.tensor([3, 4]), torch.tensor([9])],
        DEVICE,
    )
    assert batch.positions.tolist() == [3, 4, 0]
    assert batch.kv_lens.tolist() == [5, 1]
    assert batch.out_slots.tolist() == [3, 4, 9]
    assert batch.kv_slot_table.tolist() == [[10, 11, 12, 3, 4], [9, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="do not match"):
        ForwardBatch.build(
            [[1, 2]], [torch.tensor([], dtype=torch.long)], [torch.tensor([0])], DEVICE
        )


def test_random_weights_depend_only_on_seed() -> None:
    cfg = default_model_config(256)
    a, b = (LlamaForCausalLM.random(cfg, seed=7, device=DEVICE).state_dict() for _ in range(2))
    c = LlamaForCausalLM.random(cfg, seed=8, device=DEVICE).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["model.layers.0.self_attn.q_proj.weight"], c["model.layers.0.self_attn.q_proj.weight"]
    )
    assert torch.equal(a["model.norm.weight"], torch.ones(cfg.hidden_size))


def test_save_load_round_trip_gives_identical_logits(
    model: LlamaForCausalLM, tmp_path: Path
) -> None:
    model.save_pretrained(tmp_path)
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, device=DEVICE)
    assert loaded.config == model.config
    ids = prompt(20, seed=4)
    outs = []
    for m in (model, loaded):
        kv = new_pool(m)
        outs.append(extend(m, kv, [Seq(ids, kv.alloc(len(ids)))], [len(ids)])[0])
    assert torch.equal(outs[0], outs[1])


def test_tied_embeddings_load_without_lm_head(tmp_path: Path) -> None:
    cfg = dataclasses.replace(default_model_config(128), tie_word_embeddings=True)
    LlamaForCausalLM.random(cfg, seed=1, device=DEVICE).save_pretrained(tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path, device=DEVICE)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    ids = prompt(9, seed=5, vocab=128)
    kv = new_pool(loaded)
    logits, _ = extend(loaded, kv, [Seq(ids, kv.alloc(len(ids)))], [len(ids)])
    torch.testing.assert_close(logits[0], reference_forward(loaded, ids)[0][-1], atol=ATOL, rtol=0)


def test_load_errors_name_what_is_wrong(model: LlamaForCausalLM, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        LlamaForCausalLM.from_pretrained(tmp_path, device=DEVICE)
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.2.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        LlamaForCausalLM.from_pretrained(tmp_path, device=DEVICE)

    weights["model.layers.2.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"up_proj\.weight.*shape"):
        LlamaForCausalLM.from_pretrained(tmp_path, device=DEVICE)


def test_config_round_trip_and_missing_key() -> None:
    cfg = default_model_config(4096)
    hf = cfg.to_hf_dict()
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(hf))) == cfg
    del hf["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_hf_dict(hf)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelConfig.from_hf_dict({**cfg.to_hf_dict(), "num_hidden_layers": 0})


def test_kv_pool_alloc_free_accounting() -> None:
    kv = KVPool(2, 10, 1, 4, torch.float32, DEVICE, debug=True)
    a = kv.alloc(4)
    b = kv.alloc(5)
    assert a is not None and b is not None
    assert (kv.num_used, kv.num_free, kv.capacity) == (9, 1, 10)
    assert torch.cat([a, b]).unique().numel() == 9
    assert kv.alloc(2) is None and kv.num_free == 1  # never partial
    kv.free(a)
    c = kv.alloc(5)
    assert c is not None and kv.num_free == 0
    assert torch.cat([b, c]).unique().numel() == 10
    kv.free(b)
    kv.free(c)
    assert (kv.num_used, kv.num_free) == (0, 10)
    assert kv.alloc(0) is not None and kv.alloc(0).numel() == 0


def test_kv_pool_double_free_detected() -> None:
    kv = KVPool(1, 8, 1, 4, torch.float32, DEVICE, debug=True)
    a = kv.alloc(3)
    kv.alloc(3)
    kv.free(a)
    with pytest.raises(AssertionError, match="freed twice"):
        kv.free(a)
    # Without debug, freeing more than is in use is still caught.
    fast = KVPool(1, 4, 1, 4, torch.float32, DEVICE)
    s = fast.alloc(4)
    fast.free(s)
    with pytest.raises(RuntimeError, match="double free"):
        fast.free(s)


def test_greedy_decoding_of_random_model_is_not_degenerate() -> None:
    model = LlamaForCausalLM.random(default_model_config(4096), seed=0, device=DEVICE)
    kv = new_pool(model)
    for ids in ([1, 2, 3], [100, 200, 300, 400, 500], [7] * 10):
        seq = Seq(list(ids), kv.alloc(len(ids) + 32))
        logits, _ = extend(model, kv, [seq], [len(ids)])
        out = []
        for _ in range(32):
            out.append(int(logits.argmax(-1)[0]))
            seq.ids.append(out[-1])
            logits, _ = extend(model, kv, [seq], [1])
        assert len(set(out)) > 8, out
        kv.free(seq.slots)
