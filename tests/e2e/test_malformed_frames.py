"""Malformed ZeroMQ frames are dropped with a rate-limited warning, and real requests keep
flowing (docs/design.md section 1: a frame is data, never code)."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import msgspec
import zmq

from pipeline.io_struct import (
    BatchStrOutput,
    BatchTokenIDOutput,
    DecodeOptions,
    FinishLength,
    SamplingParams,
    TokenizedGenerateReqInput,
)
from tests.server_harness import ServerProcess

FRAMES_PER_SOCKET = 10_000


def hostile_frames(rng: random.Random, n: int) -> list[bytes]:
    """Random bytes, truncated real frames, and well-formed frames of the wrong shape."""
    enc = msgspec.msgpack.Encoder()
    real = [
        enc.encode(
            TokenizedGenerateReqInput(
                rid="x",
                req_id=1,
                input_ids=[1, 2, 3],
                sampling_params=SamplingParams(),
                stream=True,
                arrival_time=0.0,
            )
        ),
        enc.encode(
            BatchTokenIDOutput(
                req_ids=b"\x01" * 8,
                output_ids=b"\x02" * 4,
                output_counts=b"\x01\x00\x00\x00",
                completion_tokens=b"\x01\x00\x00\x00",
            )
        ),
        enc.encode(
            BatchStrOutput(
                req_ids=b"\x01" * 8,
                text_deltas=["a"],
                output_ids=b"\x02" * 4,
                output_counts=b"\x01\x00\x00\x00",
                completion_tokens=b"\x01\x00\x00\x00",
            )
        ),
    ]
    frames = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            frames.append(rng.randbytes(rng.randint(0, 200)))
        elif kind == 1:
            frame = rng.choice(real)
            frames.append(frame[: rng.randint(0, len(frame) - 1)])
        elif kind == 2:
            frames.append(enc.encode(["gen", rng.random(), None, {"a": [1, 2]}]))
        elif kind == 3:
            # Columns that disagree: 3 rows of counts for 1 token, unknown req ids.
            frames.append(
                enc.encode(
                    BatchTokenIDOutput(
                        req_ids=rng.randbytes(24),
                        output_ids=b"\x00" * 4,
                        output_counts=b"\x01\x00\x00\x00" * 3,
                        completion_tokens=b"\x00" * 12,
                    )
                )
            )
        elif kind == 4:
            # Token columns agree, a per-row list does not: 2 rows, 1 decode option (once
            # an IndexError that ended the detokenizer).
            frames.append(
                enc.encode(
                    BatchTokenIDOutput(
                        req_ids=rng.randbytes(16),
                        output_ids=b"\x00" * 8,
                        output_counts=b"\x01\x00\x00\x00" * 2,
                        completion_tokens=b"\x01\x00\x00\x00" * 2,
                        decode_options=[DecodeOptions()],
                    )
                )
            )
        else:
            # The same for the tokenizer manager: 2 rows, 3 finish reasons.
            frames.append(
                enc.encode(
                    BatchStrOutput(
                        req_ids=rng.randbytes(16),
                        text_deltas=["a", "b"],
                        output_ids=b"\x00" * 8,
                        output_counts=b"\x01\x00\x00\x00" * 2,
                        completion_tokens=b"\x01\x00\x00\x00" * 2,
                        finished_reasons=[None, None, FinishLength(length=1)],
                    )
                )
            )
    return frames


def test_ten_thousand_bad_frames_per_socket_are_dropped(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "tmp").wait_ready()
    try:
        (ipc_dir,) = list((tmp_path / "tmp").iterdir())
        ctx = zmq.Context()
        rng = random.Random(7)
        results: list[int] = []

        def traffic() -> None:
            with srv.client() as c:
                for i in range(20):
                    body = {
                        "text": f"still working {i}",
                        "sampling_params": {
                            "max_new_tokens": 8,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                    }
                    results.append(
                        c.post("/generate", json=body).json()["meta_info"]["completion_tokens"]
                    )

        worker = threading.Thread(target=traffic)
        worker.start()
        for name in ("scheduler", "detokenizer", "tokenizer"):
            push = ctx.socket(zmq.PUSH)
            push.connect(f"ipc://{ipc_dir / name}")
            for frame in hostile_frames(rng, FRAMES_PER_SOCKET):
                push.send(frame)
            push.close(linger=5000)
        worker.join(120)
        ctx.term()

        assert results == [8] * 20
        assert srv.proc.poll() is None, "a process died"
        with srv.client() as c:
            assert c.get("/health_generate").status_code == 200
        log = srv.output()
        for what in ("scheduler input", "detokenizer input", "tokenizer manager input"):
            assert f"dropped a malformed {what} frame" in log, what
        assert "dropped an inconsistent token frame" in log
        assert "dropped an inconsistent output frame" in log
        # Rate-limited: 30,000 bad frames must not mean 30,000 log lines.
        assert log.count("dropped") < 100
        assert "Traceback" not in log
    finally:
        srv.stop()
