"""Embeddings through a real ``--mode embedding`` server, with the official openai client."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import numpy as np
import openai
import pytest

from pipeline.tokenizer_loader import load_tokenizer
from tests.server_harness import ServerProcess

TOKENIZER = load_tokenizer(None)


@pytest.fixture(scope="module")
def embedding_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(
        tmp_path_factory.mktemp("embed") / "tmp",
        ["--mode", "embedding", "--chunked-prefill-size", "32"],
    ).wait_ready()
    yield srv
    srv.stop()


def client(srv: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)


def test_float_and_base64_decode_to_the_same_unit_vectors(embedding_server: ServerProcess) -> None:
    texts = [
        "The quick brown fox.",
        "A much longer sentence that spans more than one prefill chunk of thirty-two tokens, " * 3,
    ]
    c = client(embedding_server)
    floats = c.embeddings.create(model="tokenpipe-tiny", input=texts, encoding_format="float")
    raw = c.with_raw_response.embeddings.create(
        model="tokenpipe-tiny", input=texts, encoding_format="base64"
    ).http_response.json()
    assert [d.index for d in floats.data] == [0, 1]
    for item, b64 in zip(floats.data, raw["data"]):
        vector = np.array(item.embedding, dtype=np.float32)
        decoded = np.frombuffer(base64.b64decode(b64["embedding"]), dtype="<f4")
        assert np.allclose(
            vector, decoded, atol=1e-6
        )  # two requests: batching may move the last bits
        assert abs(float(np.linalg.norm(vector)) - 1.0) < 1e-4
    assert not np.allclose(floats.data[0].embedding, floats.data[1].embedding)
    expected = sum(len(TOKENIZER.encode(t)) for t in texts)
    assert floats.usage.prompt_tokens == expected == floats.usage.total_tokens


def test_token_id_input_and_native_encode_agree(embedding_server: ServerProcess) -> None:
    ids = TOKENIZER.encode("embed these token ids")
    c = client(embedding_server)
    by_ids = c.embeddings.create(model="tokenpipe-tiny", input=ids).data[0].embedding
    by_text = (
        c.embeddings.create(model="tokenpipe-tiny", input="embed these token ids").data[0].embedding
    )
    with embedding_server.client() as h:
        native = h.post("/encode", json={"text": "embed these token ids"}).json()
        many = h.post("/encode", json={"input_ids": [ids, ids[:3]]}).json()
    assert np.allclose(by_ids, by_text, atol=1e-6) and np.allclose(
        native["embedding"], by_text, atol=1e-6
    )
    assert (
        native["meta_info"]["prompt_tokens"] == len(ids)
        and native["meta_info"]["completion_tokens"] == 0
    )
    assert len(many) == 2 and np.allclose(many[0]["embedding"], by_ids, atol=1e-6)


def test_modes_refuse_each_others_endpoints(
    embedding_server: ServerProcess, server: ServerProcess
) -> None:
    with embedding_server.client() as h:
        gen = h.post("/generate", json={"text": "hi"})
        assert gen.status_code == 400 and "--mode embedding" in gen.json()["error"]["message"]
        assert h.get("/health_generate").status_code == 200
        bad = h.post("/v1/embeddings", json={"input": [], "model": "tokenpipe-tiny"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
    with pytest.raises(openai.BadRequestError, match="--mode embedding"):
        client(server).embeddings.create(model="tokenpipe-tiny", input="hello")
