"""``AnthropicErrors`` on a small Starlette app, through real ASGI calls: on /v1/messages and
below it the server's error answers leave in Anthropic's shape and statuses (a full queue's
503 as 529 with its Retry-After); other paths, other bodies and successes, a stream included,
pass through unchanged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Message, Receive, Scope, Send

from pipeline.http.edge import error_response
from pipeline.io_struct import FinishAbort
from tokenizer_proc.anthropic.errors import AnthropicErrors, anthropic_error
from tokenizer_proc.http.common import abort_response

STREAM_PARTS = [b"event: message_start\ndata: {}\n\n", b"event: ping\ndata: {}\n\n", b""]


async def _parts(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


def _full_queue() -> Response:
    # The answer a generation route gives a request refused by a full waiting queue.
    message = "the waiting queue is full (2 requests wait); retry later"
    return abort_response(FinishAbort(message, status_code=503, retry_after=2.5))


ANSWERS: dict[str, Callable[[], Response]] = {
    "bad_field": lambda: error_response(400, "max_tokens: must be >= 1", param="max_tokens"),
    "unprocessable": lambda: error_response(422, "cannot parse"),
    "forbidden": lambda: error_response(403, "not yours", err_type="permission_error"),
    "full_queue": _full_queue,
    "internal": lambda: error_response(500, "internal error: KeyError", err_type="internal_error"),
    "gateway": lambda: error_response(502, "peer failed", err_type="bad_gateway"),
    "not_ours": lambda: Response(b"plain words", status_code=400),
    "already_anthropic": lambda: anthropic_error(429, "slow down"),
    "ok": lambda: JSONResponse({"id": "msg_1"}),
    # An error body sent in two parts: held until the last one.
    "split": lambda: StreamingResponse(
        _parts([b'{"error": {"message": "split", ', b'"type": "x", "code": 404}}']),
        status_code=404,
        media_type="application/json",
    ),
    "stream": lambda: StreamingResponse(_parts(STREAM_PARTS), media_type="text/event-stream"),
}


async def _answer(request: Request) -> Response:
    return ANSWERS[request.query_params["answer"]]()


APP = AnthropicErrors(Starlette(routes=[Route("/{path:path}", _answer, methods=["GET", "POST"])]))


def call(path: str, answer: str) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=APP)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(path, params={"answer": answer})

    return asyncio.run(go())


def assert_anthropic(response: httpx.Response, status: int, err_type: str, message: str) -> None:
    assert response.status_code == status, response.text
    assert response.json() == {"type": "error", "error": {"type": err_type, "message": message}}
    assert response.headers["content-length"] == str(len(response.content))
    assert response.headers["content-type"] == "application/json"


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_our_errors_leave_the_messages_routes_in_anthropics_shape(path: str) -> None:
    assert_anthropic(
        call(path, "bad_field"), 400, "invalid_request_error", "max_tokens: must be >= 1"
    )
    assert_anthropic(call(path, "unprocessable"), 422, "invalid_request_error", "cannot parse")
    assert_anthropic(call(path, "forbidden"), 403, "permission_error", "not yours")
    assert_anthropic(call(path, "internal"), 500, "api_error", "internal error: KeyError")
    assert_anthropic(call(path, "gateway"), 502, "api_error", "peer failed")
    assert_anthropic(call(path, "split"), 404, "not_found_error", "split")


def test_a_full_queue_is_529_overloaded_with_its_retry_after() -> None:
    response = call("/v1/messages", "full_queue")
    message = "the waiting queue is full (2 requests wait); retry later"
    assert_anthropic(response, 529, "overloaded_error", message)
    assert response.headers["retry-after"] == "3"


def test_other_paths_and_other_bodies_pass_unchanged() -> None:
    for path in ("/v1/chat/completions", "/v1/messagesX", "/v1/message", "/x/v1/messages"):
        response = call(path, "bad_field")
        assert response.status_code == 400
        assert response.json() == {
            "error": {
                "message": "max_tokens: must be >= 1",
                "type": "invalid_request_error",
                "code": 400,
                "param": "max_tokens",
            }
        }
        assert call(path, "full_queue").status_code == 503
    not_ours = call("/v1/messages", "not_ours")
    assert not_ours.status_code == 400 and not_ours.content == b"plain words"
    # A route's own Anthropic error is not rewritten a second time.
    assert_anthropic(
        call("/v1/messages", "already_anthropic"), 429, "rate_limit_error", "slow down"
    )
    ok = call("/v1/messages", "ok")
    assert ok.status_code == 200 and ok.json() == {"id": "msg_1"}


def test_a_success_stream_passes_through_message_by_message() -> None:
    """The app's very messages go on, each as it is sent: nothing is held or copied."""
    start: Message = {
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", b"text/event-stream")],
    }
    parts: list[Message] = [
        {"type": "http.response.body", "body": part, "more_body": i < len(STREAM_PARTS) - 1}
        for i, part in enumerate(STREAM_PARTS)
    ]
    delivered: list[Message] = []

    async def server_send(message: Message) -> None:
        delivered.append(message)

    async def streaming_app(scope: Scope, receive: Receive, send: Send) -> None:
        for message in (start, *parts):
            await send(message)
            assert delivered[-1] is message

    async def no_body() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    scope: Scope = {"type": "http", "method": "POST", "path": "/v1/messages", "headers": []}
    asyncio.run(AnthropicErrors(streaming_app)(scope, no_body, server_send))
    assert len(delivered) == 1 + len(parts)
