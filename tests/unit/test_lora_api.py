"""The adapter endpoints' shapes (tokenizer_proc/http/lora_api.py), in both peers' words: the
API's real app and manager, a stand-in scheduler on the real socket that answers each control
as the scheduler does (a report first, then the result), and the checks made before any
control is sent. The whole path with the real scheduler: tests/e2e/test_lora_api.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from pipeline.config import ServerConfig
from pipeline.control_frames import LoadLoraControl, LoraAdapter, LoraControlResult
from pipeline.control_frames import UnloadLoraControl
from pipeline.io_struct import SchedulerInput, SchedulerStatsReport
from pipeline.tokenizer_loader import load_tokenizer
from tokenizer_proc.http.server import build_app
from tokenizer_proc.tokenizer_manager import TokenizerManager

BASE = "tiny"
LORA_PATHS = (
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/load_lora_adapter",
    "/unload_lora_adapter",
)
Scenario = Callable[[httpx.AsyncClient], Awaitable[None]]


def stats(adapters: tuple[LoraAdapter, ...]) -> SchedulerStatsReport:
    return SchedulerStatsReport(
        num_running_reqs=0, num_queue_reqs=0, token_usage=0.0, cache_hit_rate=0.0,
        gen_throughput=0.0, num_retracted_reqs=0, num_retracted_requests_total=0,
        kv_used_tokens=0, kv_capacity=100, cached_tokens_in_tree=0, forward_steps_total=0,
        live_reqs=0, instance=1, lora_adapters=adapters, max_loras=2,
    )  # fmt: skip


class StandInScheduler:
    """Serves adapters by name as the scheduler's registry does: a load of a new name gets the
    next id, an unknown name's unload is a 404; each answer comes after a report."""

    def __init__(self, tm: TokenizerManager) -> None:
        self.tm = tm
        self.adapters: dict[str, LoraAdapter] = {}
        self.next_id = 1

    async def serve(self, inbox: zmq.asyncio.Socket) -> None:
        decoder = msgspec.msgpack.Decoder(SchedulerInput)
        while True:
            msg = decoder.decode(await inbox.recv())
            if isinstance(msg, LoadLoraControl):
                self.adapters[msg.name] = LoraAdapter(msg.name, msg.path, self.next_id)
                self.next_id += 1
                self.answer(msg.control_id, True, "", 200)
            elif isinstance(msg, UnloadLoraControl):
                gone = self.adapters.pop(msg.name, None)
                error = "" if gone else f"The lora adapter '{msg.name}' cannot be found."
                self.answer(msg.control_id, gone is not None, error, 200 if gone else 404)

    def answer(self, control_id: int, ok: bool, error: str, status: int) -> None:
        served = tuple(self.adapters.values())
        self.tm.handle_output(stats(served))
        self.tm.handle_output(LoraControlResult(control_id, ok, error, status, served))


def run(
    tmp_path: Path, scenario: Scenario, *, lora: bool = True, api_key: str | None = None
) -> None:
    config = ServerConfig(
        scheduler_input=f"ipc://{tmp_path}/sched",
        tokenizer_input=f"ipc://{tmp_path}/tm",
        served_model_name=BASE,
        enable_lora=lora,
        api_key=api_key,
    )

    async def main() -> None:
        tm = TokenizerManager(config, load_tokenizer(None), context_length=256)
        ctx = zmq.asyncio.Context()
        inbox = ctx.socket(zmq.PULL)
        inbox.bind(config.scheduler_input)
        await tm.start()
        scheduler = StandInScheduler(tm)
        tm.handle_output(stats(()))  # the first report: the service is ready
        serving = asyncio.create_task(scheduler.serve(inbox))
        transport = httpx.ASGITransport(app=build_app(tm))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                await scenario(client)
        finally:
            serving.cancel()
            await tm.close()
            ctx.destroy(linger=0)

    asyncio.run(main())


def test_vllm_load_and_unload_answer_in_vllms_words(tmp_path: Path) -> None:
    async def scenario(client: httpx.AsyncClient) -> None:
        loaded = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/a/sql"}
        )
        assert loaded.status_code == 200
        assert loaded.text == "Success: LoRA adapter 'sql' added successfully."
        # Learnt from the answer: the next request of this worker sees it.
        cards = (await client.get("/v1/models")).json()["data"]
        assert [(c["id"], c["root"], c["parent"]) for c in cards[1:]] == [("sql", "/a/sql", BASE)]
        again = await client.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "sql", "lora_path": "/a/sql", "load_inplace": True},
        )
        assert again.status_code == 400
        assert again.json()["error"]["message"].startswith(
            "The lora adapter 'sql' has already been loaded."
        )
        gone = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert (gone.status_code, gone.text) == (
            200,
            "Success: LoRA adapter 'sql' removed successfully.",
        )
        missing = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert missing.status_code == 404
        assert missing.json()["error"]["message"] == "The lora adapter 'sql' cannot be found."
        models = await client.post("/v1/completions", json={"model": "sql", "prompt": "hi"})
        assert models.status_code == 404
        assert models.json()["error"]["message"] == (
            "the model 'sql' does not exist; see GET /v1/models"
        )

    run(tmp_path, scenario)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"lora_name": "", "lora_path": "/a"},
            "Both 'lora_name' and 'lora_path' must be provided.",
        ),
        (
            {"lora_name": BASE, "lora_path": "/a"},
            f"The lora adapter '{BASE}' conflicts with a served base model.",
        ),
        (
            {"lora_name": "x", "lora_path": "/a", "is_3d_lora_weight": True},
            "is_3d_lora_weight is not supported by this server (send false or leave it out)",
        ),
    ],
)
def test_vllm_load_refusals_before_the_scheduler(
    tmp_path: Path, body: dict[str, object], message: str
) -> None:
    async def scenario(client: httpx.AsyncClient) -> None:
        refused = await client.post("/v1/load_lora_adapter", json=body)
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == message

    run(tmp_path, scenario)


def test_sglang_load_and_unload_answer_in_sglangs_shape(tmp_path: Path) -> None:
    async def scenario(client: httpx.AsyncClient) -> None:
        loaded = await client.post(
            "/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/a/sql"}
        )
        assert loaded.status_code == 200
        assert loaded.json() == {
            "success": True,
            "error_message": "",
            "loaded_adapters": {"sql": "/a/sql"},
        }
        twice = await client.post(
            "/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/a/sql"}
        )
        assert twice.status_code == 400 and twice.json()["success"] is False
        assert twice.json()["error_message"] == (
            "Failed to load LoRA adapter sql because it is already loaded"
        )
        await client.post("/unload_lora_adapter", json={"lora_name": "sql"})
        missing = await client.post("/unload_lora_adapter", json={"lora_name": "sql"})
        assert missing.status_code == 400
        assert missing.json() == {
            "success": False,
            "error_message": "LoRA with name sql does not exist. Loaded LoRAs: dict_keys([])",
            "loaded_adapters": {},
        }

    run(tmp_path, scenario)


def test_with_lora_off_every_endpoint_names_the_flag(tmp_path: Path) -> None:
    async def scenario(client: httpx.AsyncClient) -> None:
        body = {"lora_name": "sql", "lora_path": "/a/sql"}
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            refused = await client.post(path, json=body if "/load" in path else {"lora_name": "x"})
            assert refused.status_code == 400
            assert "--enable-lora" in refused.json()["error"]["message"]
        for path in ("/load_lora_adapter", "/unload_lora_adapter"):
            refused = await client.post(path, json=body if "/load" in path else {"lora_name": "x"})
            assert refused.status_code == 400
            assert refused.json()["loaded_adapters"] is None
            assert "--enable-lora" in refused.json()["error_message"]
        named = await client.post("/generate", json={"text": "hi", "lora_path": "sql"})
        assert named.status_code == 400 and named.json()["error"]["param"] == "lora_path"

    run(tmp_path, scenario, lora=False)


def test_the_endpoints_need_the_api_key(tmp_path: Path) -> None:
    async def scenario(client: httpx.AsyncClient) -> None:
        body = {"lora_name": "sql", "lora_path": "/a/sql"}
        for path in LORA_PATHS:
            assert (await client.post(path, json=body)).status_code == 401
        keyed = await client.post(
            "/v1/load_lora_adapter", json=body, headers={"Authorization": "Bearer k"}
        )
        assert keyed.status_code == 200

    run(tmp_path, scenario, api_key="k")
