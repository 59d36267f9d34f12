"""The peers' words where a route renames fields or the server has a limit the peers lack
(tokenizer_proc/request_edge/peer_wording.py); the words on every route, through the official
clients, are tests/e2e/test_peer_errors_and_defaults.py."""

from __future__ import annotations

import msgspec
import pytest

from pipeline.config import ServerConfig
from pipeline.io_struct import SamplingParams
from tokenizer_proc.native.schema import GenerateRequest
from tokenizer_proc.openai.jobs import openai_names
from tokenizer_proc.openai.responses.request import responses_names
from tokenizer_proc.request_checks import ContextLengthError, RequestChecks
from tokenizer_proc.request_edge.errors import RequestValidationError
from tokenizer_proc.request_edge.peer_wording import PeerWordedError, decode_message

CONTEXT = 2048


def _checks(limit: int) -> RequestChecks:
    config = ServerConfig(max_new_tokens_limit=limit)
    return RequestChecks(config, None, vocab_size=4096, context_length=CONTEXT)


def _sampling(max_new_tokens: int) -> SamplingParams:
    return msgspec.structs.replace(SamplingParams(), max_new_tokens=max_new_tokens)


def test_the_context_is_checked_before_the_server_limit() -> None:
    """A request beyond both gets the peers' context words; one beyond the limit alone gets
    vLLM's words for a max_tokens it refuses (SGLang has no such limit)."""
    checks = _checks(limit=16)
    with pytest.raises(ContextLengthError):
        checks.validate_lengths(10, _sampling(CONTEXT))
    with pytest.raises(PeerWordedError) as info:
        checks.validate_lengths(10, _sampling(100))
    assert str(info.value).startswith("'max_tokens' or 'max_completion_tokens' is too large: 100.")
    assert info.value.param == "sampling_params.max_new_tokens"
    with pytest.raises(RequestValidationError) as renamed, openai_names("prompt", "max_tokens"):
        checks.validate_lengths(10, _sampling(100))
    assert renamed.value.param == "max_tokens"
    assert str(renamed.value) == (
        "'max_tokens' or 'max_completion_tokens' is too large: 100. (max_tokens is 100; this "
        "server allows at most 16)"
    )


def test_a_renaming_route_renames_the_detail_and_never_a_phrase() -> None:
    """The Responses API's names (``input`` for ``messages``, ``max_output_tokens`` for
    ``max_completion_tokens``) are words in the peers' phrases too."""
    with pytest.raises(RequestValidationError) as info:
        with openai_names("messages", "max_completion_tokens"):
            raise ContextLengthError(10, CONTEXT, CONTEXT)
    renamed = responses_names(info.value)
    message = str(renamed)
    assert renamed.param == "max_output_tokens"
    assert message.startswith(f"'max_tokens' or 'max_completion_tokens' is too large: {CONTEXT}.")
    assert "tokens from the input messages" in message
    assert message.endswith(f"(input: 10 tokens; max_output_tokens: {CONTEXT})")


@pytest.mark.parametrize(
    ("message", "native", "expected"),
    [
        (
            "Expected `int`, got `array` - at `$.token_ids_logprob[0]`",
            True,
            "token_ids_logprob must be a flat list of integers. Input should be a valid "
            "integer. Expected `int`, got `array` - at `$.token_ids_logprob[0]`",
        ),
        (
            "Expected `int`, got `array` - at `$.prompt[0][1]`",
            False,
            "Input should be a valid integer. prompt[0] must be a flat list of integers. "
            "Expected `int`, got `array` - at `$.prompt[0][1]`",
        ),
        (
            "Expected `int` >= -9223372036854775808 - at `$.seed`",
            False,
            "Input should be greater than or equal to -9223372036854775808. Expected `int` >= "
            "-9223372036854775808 - at `$.seed`",
        ),
        # Not the peers' to word: as msgspec says it.
        ("Expected `int` >= 1 - at `$.n`", False, "Expected `int` >= 1 - at `$.n`"),
        ("Expected `int`, got `array` - at `$.n`", True, "Expected `int`, got `array` - at `$.n`"),
    ],
)
def test_decode_errors_the_peers_word_lead_with_their_words(
    message: str, native: bool, expected: str
) -> None:
    assert decode_message(message, GenerateRequest if native else dict) == expected
