"""PD KV transfer benchmark: what it costs to move a prompt's KV from a prefill scheduler to
a decode scheduler, against computing it again (the prefill the transfer replaces).

For each prompt length the real code path runs in one process over real ZeroMQ sockets:
``gather_kv`` from the prefill pool, ``KVFetchServer.send`` (header plus the raw K and V
frames), ``KVFetchClient.receive`` on the decode side, ``tensors_from_frames`` (size and
layout checks, copy out of the frames) and ``scatter_kv`` into the decode pool. The
baseline, timed in the same run and interleaved round by round, is one prefill of the same
tokens by the model (``ModelRunner.extend``); each figure is the minimum over rounds. A
ratio transfer / prefill below 1 means the transfer is cheaper than recomputing. Usage:
bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import zmq  # noqa: E402

from bench.launch import free_port  # noqa: E402
from pipeline.config import ServerConfig  # noqa: E402
from pipeline.io_struct import KVFetch, KVTransferHeader  # noqa: E402
from pipeline.tokenizer_loader import load_tokenizer  # noqa: E402
from scheduler_proc.pd.kv_transfer import (  # noqa: E402
    KVFetchClient,
    KVFetchServer,
    gather_kv,
    pool_layout,
    scatter_kv,
    tensors_from_frames,
)
from scheduler_proc.model.runner import ModelRunner  # noqa: E402

COLUMNS = ("tokens", "kv_MB", "transfer_ms", "GB_per_s", "prefill_ms", "transfer/prefill")


def _runner(pool: int, threads: int | None) -> ModelRunner:
    config = ServerConfig(max_total_tokens=pool, torch_threads=threads)
    return ModelRunner(config, load_tokenizer(None).vocab_size)


def _transfer_once(
    src: ModelRunner,
    dst: ModelRunner,
    server: KVFetchServer,
    client: KVFetchClient,
    identity: bytes,
    n: int,
) -> float:
    layout = pool_layout(src.kv)
    slots = torch.arange(n, dtype=torch.long)
    started = time.perf_counter()
    k, v = gather_kv(src.kv, slots)
    server.send(
        identity,
        KVTransferHeader(room=0, attempt=0, ok=True, num_tokens=n, layout=layout, first_token=1),
        k,
        v,
    )
    got: list[tuple[str, KVTransferHeader, list[bytes]]] = []
    while not got:
        got = client.receive()
    _, header, frames = got[0]
    k2, v2 = tensors_from_frames(header, frames[0], frames[1], pool_layout(dst.kv))
    scatter_kv(dst.kv, slots, k2, v2)
    return time.perf_counter() - started


def _prefill_once(runner: ModelRunner, tokens: list[int]) -> float:
    slots = torch.arange(len(tokens), dtype=torch.long)
    started = time.perf_counter()
    runner.extend([tokens], [torch.empty(0, dtype=torch.long)], [slots])
    return time.perf_counter() - started


def run(
    lengths: Sequence[int], rounds: int, transport: str, threads: int | None
) -> list[dict[str, float]]:
    pool = max(lengths) + 16
    src, dst = _runner(pool, threads), _runner(pool, threads)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        endpoint = f"ipc://{tmp}/kv" if transport == "ipc" else f"tcp://127.0.0.1:{free_port()}"
        server = KVFetchServer(ctx, endpoint)
        client = KVFetchClient(ctx)
        # One fetch gives the server the decode side's identity, as in a real bootstrap.
        client.send(
            endpoint,
            KVFetch(room=0, attempt=0, token_ids=[1], prompt_tokens=1, layout=pool_layout(dst.kv)),
        )
        received: list[tuple[bytes, KVFetch]] = []
        while not received:
            received = server.receive()
            time.sleep(0.001)
        identity = received[0][0]
        rows = []
        for n in lengths:
            tokens = [(37 * i) % 4000 + 50 for i in range(n)]
            transfer, prefill = float("inf"), float("inf")
            for _ in range(rounds):  # interleaved, so both see the same machine load
                transfer = min(transfer, _transfer_once(src, dst, server, client, identity, n))
                prefill = min(prefill, _prefill_once(dst, tokens))
            kv_bytes = 2 * src.kv.k[:, :n].numel() * src.kv.k.element_size()
            rows.append(
                {
                    "tokens": n,
                    "kv_MB": kv_bytes / 1e6,
                    "transfer_ms": transfer * 1e3,
                    "GB_per_s": kv_bytes / transfer / 1e9,
                    "prefill_ms": prefill * 1e3,
                    "transfer/prefill": transfer / prefill,
                }
            )
        server.close()
        client.close()
    ctx.destroy(linger=0)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="64,256,1024", help="prompt lengths in tokens")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--transport", default="ipc,tcp")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        help="model threads (default: cores - 2, at least 1)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    results: dict[str, list[dict[str, float]]] = {}
    for transport in args.transport.split(","):
        rows = run(lengths, args.rounds, transport, args.torch_threads)
        results[transport] = rows
        print(f"transport={transport} rounds={args.rounds} (minimum over rounds)")
        print("".join(f"{c:>18}" for c in COLUMNS))
        for row in rows:
            print(f"{int(row['tokens']):>18}" + "".join(f"{row[c]:>18.3f}" for c in COLUMNS[1:]))
        print()
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
