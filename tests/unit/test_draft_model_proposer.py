"""The draft-model proposer (scheduler_proc/speculative/draft_model.py) beside a real scheduler
decoding without speculation: with the target's own checkpoint as the draft and
--enable-deterministic-inference it proposes exactly the tokens the target then draws, greedy
and seeded; after a verify it keeps only the KV of known tokens and catches up on the next
propose; leaving rows free their KV; a full pool or a long prompt costs drafts, never the
step; a draft the server cannot use is refused at start, naming the flag."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np
import pytest

from pipeline.config import ServerConfig
from pipeline.io_struct import SamplingParams, TokenizedGenerateReqInput
from pipeline.model_config import ModelConfig
from scheduler_proc.batch.running_batch import RunningBatch
from scheduler_proc.main import build_scheduler
from scheduler_proc.model.llama import LlamaForCausalLM
from scheduler_proc.scheduler import Scheduler
from scheduler_proc.speculative.draft_model import FLAG, DraftModelProposer
from tests.hf_checkpoints import TINY, write_case

K = 4
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
NUCLEUS = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_new_tokens=40, ignore_eos=True)
TOP_K = SamplingParams(
    temperature=0.8, top_k=20, min_p=0.02, seed=11, max_new_tokens=40, ignore_eos=True
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("draft") / "llama3"
    write_case(directory, "llama3")
    return directory


@dataclass
class Served:
    """A scheduler decoding without speculation, and its config."""

    scheduler: Scheduler
    config: ServerConfig

    def proposer(self, draft: Path, **changes: object) -> DraftModelProposer:
        """A proposer of ``draft`` beside this scheduler's model (``changes``: config fields
        that differ for the proposer alone)."""
        config = msgspec.structs.replace(
            self.config,
            speculative_algorithm="STANDALONE",
            speculative_draft_model_path=str(draft),
            **changes,
        )
        return DraftModelProposer(config, self.scheduler.runner)

    def start(self, prompts: list[list[int]], params: list[SamplingParams]) -> RunningBatch:
        """Submits the requests (req_id i for prompt i) and steps until all are running."""
        for i, (ids, sampling) in enumerate(zip(prompts, params)):
            self.scheduler.add_request(
                TokenizedGenerateReqInput(
                    rid=f"r{i}",
                    req_id=i,
                    input_ids=ids,
                    sampling_params=sampling,
                    stream=False,
                    arrival_time=time.time(),
                )
            )
        self.scheduler.step()
        batch = self.scheduler.running
        assert isinstance(batch, RunningBatch) and len(batch) == len(prompts)
        return batch

    def decode(self, batch: RunningBatch, req_ids: list[int], steps: int) -> np.ndarray:
        """Each request's next ``steps`` tokens, decoded by the scheduler without speculation."""
        before = [int(batch.seq_len[row(batch, r)]) for r in req_ids]
        for _ in range(steps):
            self.scheduler.step()
        return np.array(
            [batch.tokens[row(batch, r), b : b + steps] for r, b in zip(req_ids, before)],
            dtype=np.int64,
        )


@pytest.fixture
def served(checkpoint: Path) -> Iterator[Served]:
    config = ServerConfig(
        model_path=str(checkpoint),
        max_total_tokens=4096,
        torch_threads=1,
        enable_deterministic_inference=True,
        disable_overlap_schedule=True,
    )
    scheduler = build_scheduler(config)
    yield Served(scheduler, config)
    scheduler.close()


def prompt(length: int, offset: int) -> list[int]:
    return [(offset + 37 * i) % 3000 + 50 for i in range(length)]


def row(batch: RunningBatch, req_id: int) -> int:
    return int(np.flatnonzero(batch.req_id[: len(batch)] == req_id)[0])


def rows_of(batch: RunningBatch, req_ids: list[int]) -> np.ndarray:
    return np.array([row(batch, r) for r in req_ids], dtype=np.int64)


def test_a_draft_equal_to_the_target_proposes_the_targets_tokens(
    served: Served, checkpoint: Path
) -> None:
    """Greedy, nucleus (temperature 1.0, top_p 0.9) and top-k rows of different lengths, over
    two rounds of full acceptance: the second reads the last draft and the target's token."""
    proposer = served.proposer(checkpoint)
    batch = served.start([prompt(5, 0), prompt(17, 1), prompt(40, 2)], [GREEDY, NUCLEUS, TOP_K])
    req_ids = [0, 1, 2]
    seen = set()
    for _ in range(2):
        rows = rows_of(batch, req_ids)
        drafts, counts = proposer.propose(batch, rows, K)
        assert counts.tolist() == [K] * 3
        proposer.after_verify(batch.req_id[rows], batch.seq_len[rows], counts)
        target = served.decode(batch, req_ids, K + 1)
        assert drafts.tolist() == target[:, :K].tolist()
        seen.update(target.reshape(-1).tolist())
    assert len(seen) > 6  # the model's text depends on its context: the match says something


def test_after_verify_frees_the_rejected_drafts_and_the_next_proposal_catches_up(
    served: Served, checkpoint: Path
) -> None:
    """Accepting 0, 2 and all 4 drafts keeps the KV through the last token and the accepted
    drafts (the 4th draft's was never computed); three target tokens later (the contract for
    the row that accepted 2; more and fewer than the others' accepted + 1) the proposals are
    again the target's next tokens."""
    proposer = served.proposer(checkpoint)
    pool = proposer.kv.pool
    batch = served.start([prompt(9, 3), prompt(12, 4), prompt(20, 5)], [GREEDY, NUCLEUS, GREEDY])
    req_ids = [0, 1, 2]
    rows = rows_of(batch, req_ids)
    seq = batch.seq_len[rows].copy()
    drafts, counts = proposer.propose(batch, rows, K)
    assert counts.tolist() == [K] * 3
    assert pool.num_used == int((seq + K - 1).sum())
    accepted = np.array([0, 2, 4])
    proposer.after_verify(batch.req_id[rows], seq, accepted)
    kept = seq + np.minimum(accepted, K - 1)
    assert [proposer.kv.held(r) for r in req_ids] == kept.tolist()
    assert pool.num_free == pool.capacity - int(kept.sum())
    served.decode(batch, req_ids, 3)
    rows = rows_of(batch, req_ids)
    drafts, counts = proposer.propose(batch, rows, K)
    assert counts.tolist() == [K] * 3
    assert [proposer.kv.held(r) for r in req_ids] == (batch.seq_len[rows] + K - 1).tolist()
    assert drafts.tolist() == served.decode(batch, req_ids, K).tolist()


def test_rows_that_leave_free_their_draft_kv(served: Served, checkpoint: Path) -> None:
    proposer = served.proposer(checkpoint)
    short = SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True)
    batch = served.start([prompt(8, 6), prompt(10, 7)], [short, GREEDY])
    proposer.propose(batch, rows_of(batch, [0, 1]), K)
    assert proposer.kv.held(0) > 0 and proposer.kv.held(1) > 0
    served.decode(batch, [1], 3)  # request 0 finishes and leaves
    assert batch.req_id[: len(batch)].tolist() == [1]
    proposer.propose(batch, np.zeros(0, dtype=np.int64), K)
    assert proposer.kv.held(0) == 0
    assert proposer.kv.pool.num_used == proposer.kv.held(1) > 0


def test_a_proposal_never_verified_leaves_no_kv_of_its_drafts(
    served: Served, checkpoint: Path
) -> None:
    """The target draws token 77 (a logit_bias the draft does not apply), so the drafts are
    not the sequence: with no after_verify between, the next proposal drops their KV and
    proposes what a proposer that reads the whole sequence afresh proposes."""
    proposer = served.proposer(checkpoint)
    biased = SamplingParams(
        temperature=0.0, logit_bias=((77, 100.0),), max_new_tokens=40, ignore_eos=True
    )
    batch = served.start([prompt(12, 13)], [biased])
    drafts, _ = proposer.propose(batch, rows_of(batch, [0]), K)
    assert 77 not in drafts[0].tolist()
    assert served.decode(batch, [0], 2).tolist() == [[77, 77]]
    again, counts = proposer.propose(batch, rows_of(batch, [0]), K)
    fresh, _ = served.proposer(checkpoint).propose(batch, rows_of(batch, [0]), K)
    assert counts.tolist() == [K] and again.tolist() == fresh.tolist()


def test_rows_that_do_not_fit_the_draft_pool_get_no_drafts(
    served: Served, checkpoint: Path
) -> None:
    """A pool of 40 slots: the rows with least to read first (11 + 3 and 21 + 3 slots), the
    third (31 + 3) drafts nothing and the step goes on."""
    proposer = served.proposer(checkpoint, max_total_tokens=40)
    batch = served.start([prompt(30, 8), prompt(10, 9), prompt(20, 10)], [GREEDY] * 3)
    rows = rows_of(batch, [0, 1, 2])
    drafts, counts = proposer.propose(batch, rows, K)
    assert counts.tolist() == [0, K, K]
    assert proposer.kv.held(0) == 0 and proposer.kv.pool.num_free == 40 - 14 - 24
    target = served.decode(batch, [0, 1, 2], K)
    assert drafts[1:].tolist() == target[1:].tolist()


def test_a_long_sequence_is_read_in_chunks_before_it_drafts(
    served: Served, checkpoint: Path
) -> None:
    """--chunked-prefill-size 16: a 31-token sequence is read 5 tokens beside a short row's
    11, then 15 beside its 1 (a step later), then its last 13 with its drafts, which are the
    target's."""
    proposer = served.proposer(checkpoint, chunked_prefill_size=16)
    batch = served.start([prompt(30, 11), prompt(10, 12)], [NUCLEUS, GREEDY])
    held = []
    for _ in range(3):
        rows = rows_of(batch, [0, 1])
        drafts, counts = proposer.propose(batch, rows, K)
        held.append(proposer.kv.held(0))
        proposer.after_verify(batch.req_id[rows], batch.seq_len[rows], np.zeros(2, dtype=np.int64))
        if counts[0]:
            break
        served.decode(batch, [0, 1], 1)
    assert counts.tolist() == [K, K]
    assert held == [5, 20, 33 + K - 1]
    assert drafts[0].tolist() == served.decode(batch, [0], K)[0].tolist()


def write_random(directory: Path, **shape: int) -> Path:
    """A checkpoint of the project's own writer (seeded random weights)."""
    config = ModelConfig(
        vocab_size=shape.get("vocab_size", 4096),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=shape.get("positions", TINY.positions),
    )
    LlamaForCausalLM.random(config, seed=0, device="cpu").save_pretrained(directory)
    return directory


def test_refusals_name_the_flag(served: Served, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"{FLAG} .*no such directory"):
        served.proposer(tmp_path / "missing")
    with pytest.raises(ValueError, match=f"{FLAG} .*config.json"):
        served.proposer(tmp_path)
    other_vocab = write_random(tmp_path / "vocab", vocab_size=1000)
    with pytest.raises(ValueError, match=f"{FLAG} .*vocabulary has 1000 tokens"):
        served.proposer(other_vocab)
    short = write_random(tmp_path / "short", positions=TINY.positions // 2)
    with pytest.raises(ValueError, match=f"{FLAG} .*--context-length {TINY.positions // 2}"):
        served.proposer(short)
    assert served.proposer(short, context_length=TINY.positions // 2).kv.pool.num_used == 0
