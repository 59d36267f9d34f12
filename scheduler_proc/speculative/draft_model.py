"""The draft-model proposer (SGLang's STANDALONE, vLLM's draft_model): a smaller checkpoint
with the target's tokenizer runs beside the target, with its own KV (``draft_kv.py``). One
pass feeds each row the tokens the draft has not seen (its whole sequence at first, then the
few accepted since) and draws draft 1; k - 1 passes of one token each draw the others. Each
draft is drawn as the target will draw that position: the row's temperature, top_k, top_p,
min_p and seed, and the position's counter; no penalties, bias, bans or grammar (a proposal
only: the verify pass applies them). So a draft equal to the target proposes the target's own
tokens, bit for bit under --enable-deterministic-inference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pipeline.config import ServerConfig
from pipeline.model_config import ModelConfig, context_length_of
from scheduler_proc.batch.running_batch import RunningBatch
from scheduler_proc.cache.kv_pool import KVPool
from scheduler_proc.model.forward_batch import ForwardBatch
from scheduler_proc.model.llama import LlamaForCausalLM
from scheduler_proc.model.runner import ModelRunner
from scheduler_proc.model.weights import DTYPES, read_config
from scheduler_proc.sampling.sampler import SamplingColumns, draw_counter, sample
from scheduler_proc.speculative.draft_kv import DraftKV, fit

FLAG = "--speculative-draft-model-path"


class DraftModelProposer:
    """A ``Proposer`` (proposer.py) that runs a draft model. The scheduler builds it at start
    from its config and the target's runner; the refusals are ``load_draft_model``'s.

    When the draft pool (``--max-total-tokens`` slots, as the target's) cannot hold a row's
    new tokens and drafts, that row gets 0 drafts this step (it decodes as without
    speculation) and keeps the KV it has; the step never fails for it. A row's first
    proposal reads its whole sequence, at most ``--chunked-prefill-size`` tokens per step
    over all rows (a longer one drafts once read). A request's KV is freed at the first
    propose after it left the batch."""

    def __init__(self, config: ServerConfig, target: ModelRunner) -> None:
        self.model = load_draft_model(config, target)
        self.device = target.device
        mc = self.model.config
        pool = KVPool(
            mc.num_hidden_layers,
            config.max_total_tokens,
            mc.num_key_value_heads,
            mc.head_dim,
            self.model.dtype,
            self.device,
        )
        self.kv = DraftKV(pool)
        chunk = config.chunked_prefill_size
        self.budget = chunk if chunk > 0 else config.max_total_tokens  # tokens fed per propose

    def propose(
        self, batch: RunningBatch, rows: np.ndarray, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for ``rows`` (see ``Proposer.propose``); first frees the KV of requests no
        longer in the batch. A row drafts at most up to the end of its context."""
        self.kv.retain(batch.req_id[: len(batch)])
        drafts = np.zeros((len(rows), k), dtype=np.int64)
        counts = np.zeros(len(rows), dtype=np.int64)
        if k <= 0 or not len(rows):
            return drafts, counts
        seq = batch.seq_len[rows]
        req_ids = batch.req_id[rows].tolist()
        held = [self.kv.usable(r, s) for r, s in zip(req_ids, seq.tolist())]
        have = np.array([h.numel() for h in held], dtype=np.int64)
        want = np.clip(np.minimum(k, batch.tokens.shape[1] - seq), 0, None)
        feed, counts = fit(seq - have, want, self.kv.pool.num_free, self.budget)
        fed = np.flatnonzero(feed)
        if not fed.size:
            return drafts, counts
        extra = np.maximum(counts[fed] - 1, 0)  # slots of drafts 1 .. n - 1 (n's is never written)
        new = self.kv.pool.alloc(int(feed[fed].sum() + extra.sum()))
        assert new is not None, "fit() kept within the draft pool's free slots"
        parts = torch.split(new, np.stack([feed[fed], extra], axis=1).reshape(-1).tolist())
        tokens = [batch.tokens[rows[i], have[i] : have[i] + feed[i]].tolist() for i in fed]
        prefix = [held[i] for i in fed]
        pass_ = ForwardBatch.build(tokens, prefix, list(parts[0::2]), self.device)
        logits, _ = self.model.forward(pass_, self.kv.pool)
        slots = [torch.cat((held[i], parts[2 * j], parts[2 * j + 1])) for j, i in enumerate(fed)]
        for j, i in enumerate(fed.tolist()):
            self.kv.hold(req_ids[i], slots[j], int(have[i] + feed[i]))
        drafting = np.flatnonzero(counts)
        if drafting.size:
            at = np.searchsorted(fed, drafting)  # their places in the pass
            first = logits.index_select(0, torch.from_numpy(at).to(logits.device))
            own = [slots[j] for j in at.tolist()]
            drafts[drafting] = self._draft(batch, rows[drafting], counts[drafting], k, first, own)
        return drafts, counts

    def _draft(
        self,
        batch: RunningBatch,
        rows: np.ndarray,
        counts: np.ndarray,
        k: int,
        first: torch.Tensor,
        slots: list[torch.Tensor],
    ) -> np.ndarray:
        """``[len(rows), k]`` drafts of rows caught up to their last token: draft 1 from its
        logits ``first``; pass j feeds draft j at position seq_len + j - 1 (its slot in
        ``slots``: known tokens' then drafts') and draws draft j + 1."""
        seq = batch.seq_len[rows]
        out_len = seq - batch.prompt_len[rows]
        out = np.zeros((len(rows), k), dtype=np.int64)
        out[:, 0] = sample(first, draft_columns(batch, rows, out_len))
        table = torch.zeros((len(rows), max(s.numel() for s in slots)), dtype=torch.long)
        for i, row_slots in enumerate(slots):
            table[i, : row_slots.numel()] = row_slots
        for j in range(1, int(counts.max())):
            act = np.flatnonzero(counts > j)
            lens = seq[act] + j
            pass_ = ForwardBatch.decode(
                torch.from_numpy(out[act, j - 1]),
                torch.from_numpy(lens),
                table[torch.from_numpy(act), : int(lens.max())],
                self.device,
            )
            logits, _ = self.model.forward(pass_, self.kv.pool)
            out[act, j] = sample(logits, draft_columns(batch, rows[act], out_len[act] + j))
        return out

    def after_verify(
        self, req_ids: np.ndarray, drafted_at: np.ndarray, accepted: np.ndarray
    ) -> None:
        """Request ``req_ids[i]`` keeps the draft KV of its tokens now known: through its last
        token when it drafted and its accepted drafts (those whose KV was computed: the last
        draft's never is). The rest is freed at once."""
        self.kv.keep_first(req_ids, drafted_at + accepted)


def draft_columns(
    batch: RunningBatch, rows: np.ndarray, output_index: np.ndarray
) -> SamplingColumns:
    """How the target draws output token ``output_index[i]`` of row ``rows[i]``, less its
    penalties, bias, bans, grammar and forced tokens: the row's own draw parameters and
    seed, and that position's counter (``draw_counter``)."""
    draw, n = batch.params, len(rows)
    return SamplingColumns(
        temperature=draw["temperature"][rows],
        top_k=draw["top_k"][rows],
        top_p=draw["top_p"][rows],
        min_p=draw["min_p"][rows],
        seed=batch.seed[rows],
        counter=draw_counter(output_index),
        frequency_penalty=np.zeros(n, dtype=np.float32),
        presence_penalty=np.zeros(n, dtype=np.float32),
        repetition_penalty=np.ones(n, dtype=np.float32),
        output_counts=None,
        seen=None,
        logit_bias=None,
    )


def load_draft_model(config: ServerConfig, target: ModelRunner) -> LlamaForCausalLM:
    """The draft checkpoint ``config.speculative`` names, on the target's device, in the
    ``--dtype`` both follow, with the target's kernels (``--enable-deterministic-inference``).
    ValueError naming the flag when the directory is missing or not a checkpoint tokenpipe
    serves, its vocabulary is not the target's, or it has fewer positions than the server's
    context."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model" or not spec.draft_model:
        raise ValueError(f"a draft model needs --speculative-algorithm STANDALONE and {FLAG}")
    flag = f'--speculative-config "model" ({FLAG})' if config.speculative_config else FLAG
    path = Path(spec.draft_model)
    if not path.is_dir():
        raise ValueError(f"{flag} {path}: no such directory")
    try:
        draft = ModelConfig.from_hf_dict(read_config(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag} {path}: {exc}") from exc
    vocab = target.model_config.vocab_size
    if draft.vocab_size != vocab:
        raise ValueError(
            f"{flag} {path}: the draft's vocabulary has {draft.vocab_size} tokens and the "
            f"target's {vocab}; a draft model must use the target's tokenizer"
        )
    context = context_length_of(config, vocab)
    if draft.context_limit < context:
        raise ValueError(
            f"{flag} {path}: the draft computes {draft.context_limit} positions, fewer than "
            f"the server's context of {context}; pass --context-length {draft.context_limit} "
            "or a draft with a longer max_position_embeddings"
        )
    try:
        model = LlamaForCausalLM.from_pretrained(
            path,
            device=target.device,
            dtype=None if config.dtype == "auto" else DTYPES[config.dtype],
            deterministic=config.enable_deterministic_inference,
        )
    except (OSError, ValueError) as exc:
        raise ValueError(f"{flag} {path}: {exc}") from exc
    return model.eval()
