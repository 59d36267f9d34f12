"""Speculative decoding's flags in both peers' spellings (``pipeline.speculative_config``): vLLM's
``--speculative-config`` JSON with vLLM's defaults, SGLang's ``--speculative-algorithm`` flags
with SGLang's defaults and its count of draft tokens (the verified token included), the
refusals (EAGLE and the other trained heads, tree drafting, conflicts, modes without
decoding), each naming the flag; and ``tokenpipe serve`` exiting non-zero on them."""

from __future__ import annotations

import argparse
import json

import pytest

from pipeline.config import ServerConfig
from pipeline.server_args import add_server_args, check_config, config_from_args
from pipeline.speculative_config import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    SpeculativeConfig,
)
from tokenpipe.cli import main


def config_of(*argv: str) -> ServerConfig:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return config_from_args(parser.parse_args(list(argv)), environ={})


def vllm(spec: dict[str, object], *argv: str) -> SpeculativeConfig | None:
    return config_of("--speculative-config", json.dumps(spec), *argv).speculative


def refused(match: str, *argv: str) -> None:
    with pytest.raises(ValueError, match=match):
        config_of(*argv)


def test_off_without_either_spelling() -> None:
    assert ServerConfig().speculative is None
    assert config_of().speculative is None


# --- vLLM's --speculative-config ------------------------------------------------------------


def test_vllm_ngram_defaults_both_windows_to_5() -> None:
    assert vllm({"method": "ngram", "num_speculative_tokens": 3}) == SpeculativeConfig(
        "ngram", 3, 5, 5, None, DEFAULT_DISABLE_BY_BATCH_SIZE
    )


def test_vllm_one_window_bound_sets_both() -> None:
    spec = vllm({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4})
    assert spec is not None and (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    spec = vllm({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2})
    assert spec is not None and (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 2)
    spec = vllm(
        {
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 6,
        }
    )
    assert spec is not None and (spec.prompt_lookup_min, spec.prompt_lookup_max) == (1, 6)


def test_vllm_model_names_the_method_as_vllm_reads_it() -> None:
    # No method: "ngram" (or "[ngram]") as the model is the n-gram method, anything else a
    # draft checkpoint.
    spec = vllm({"model": "[ngram]", "num_speculative_tokens": 2})
    assert spec is not None and (spec.method, spec.draft_model) == ("ngram", None)
    spec = vllm({"method": "ngram", "model": "ngram", "num_speculative_tokens": 2})
    assert spec is not None and (spec.method, spec.draft_model) == ("ngram", None)
    spec = vllm({"model": "/ckpt/draft", "num_speculative_tokens": 2})
    assert spec is not None and (spec.method, spec.draft_model) == ("draft_model", "/ckpt/draft")
    spec = vllm({"method": "[ngram]", "num_speculative_tokens": 2})
    assert spec is not None and spec.method == "ngram"


def test_vllm_disable_by_batch_size_from_the_json_or_the_flag() -> None:
    base = {"method": "ngram", "num_speculative_tokens": 2}
    spec = vllm({**base, "disable_by_batch_size": 8})
    assert spec is not None and spec.disable_by_batch_size == 8
    spec = vllm(base, "--speculative-disable-by-batch-size", "0")
    assert spec is not None and spec.disable_by_batch_size == 0  # 0: no limit


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"method": "ngram"}, "'num_speculative_tokens' must be an integer from 1 to 16"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "from 1 to 16"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "from 1 to 16"),
        ({"method": "ngram", "num_speculative_tokens": True}, "must be an integer"),
        ({"method": "ngram", "num_speculative_tokens": "3"}, "must be an integer"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": "2"},
            "'prompt_lookup_min' must be an integer",
        ),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 3,
            },
            "prompt_lookup_min and prompt_lookup_max need 1 <= min <= max, got 4 and 3",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0},
            "1 <= min <= max",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "model": "/ckpt"},
            "n-gram speculation takes no draft model",
        ),
        (
            {"method": "draft_model", "num_speculative_tokens": 2},
            "a draft model needs its checkpoint directory",
        ),
        ({"num_speculative_tokens": 2}, "give 'method'"),
        ({"method": "suffix", "num_speculative_tokens": 2}, "'suffix' is not one of"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "num_speculative_tokens_per_batch_size": [],
            },
            "unsupported key\\(s\\) num_speculative_tokens_per_batch_size",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1},
            "disable_by_batch_size must be 0 \\(no limit\\) or the batch size",
        ),
    ],
)
def test_vllm_refusals_name_the_flag(spec: dict[str, object], match: str) -> None:
    refused("--speculative-config: .*" + match, "--speculative-config", json.dumps(spec))


def test_vllm_refuses_what_is_not_json_or_not_an_object() -> None:
    refused("--speculative-config: .* is not valid JSON", "--speculative-config", "{method")
    refused("--speculative-config: expected a JSON object", "--speculative-config", "[1]")


@pytest.mark.parametrize(
    "method", ["eagle", "eagle3", "EAGLE3", "mtp", "deepseek_mtp", "medusa", "dflash"]
)
def test_vllm_refuses_methods_that_need_trained_heads(method: str) -> None:
    refused(
        f"--speculative-config: '{method}' needs draft heads trained on this model's hidden states",
        "--speculative-config",
        json.dumps({"method": method, "num_speculative_tokens": 2}),
    )


def test_vllm_batch_size_limit_given_twice_is_refused() -> None:
    refused(
        "give disable_by_batch_size in the JSON or --speculative-disable-by-batch-size, not both",
        "--speculative-config",
        json.dumps({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 4}),
        "--speculative-disable-by-batch-size",
        "4",
    )


# --- SGLang's --speculative-algorithm -------------------------------------------------------


def test_sglang_ngram_defaults() -> None:
    # Windows as SGLang's (1 and 12); 4 drafts (SGLang's --speculative-num-draft-tokens 5).
    assert config_of("--speculative-algorithm", "NGRAM").speculative == SpeculativeConfig(
        "ngram", 4, 1, 12, None, DEFAULT_DISABLE_BY_BATCH_SIZE
    )


def test_sglang_num_draft_tokens_counts_the_verified_token() -> None:
    spec = config_of(
        "--speculative-algorithm",
        "ngram",  # any case, as SGLang's choices are matched here
        "--speculative-num-draft-tokens",
        "8",
        "--speculative-ngram-min-match-window-size",
        "2",
        "--speculative-ngram-max-match-window-size",
        "4",
        "--speculative-disable-by-batch-size",
        "0",
    ).speculative
    assert spec == SpeculativeConfig("ngram", 7, 2, 4, None, 0)


def test_sglang_standalone_drafts_from_steps_or_draft_tokens() -> None:
    base = ("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "/d")
    spec = config_of(*base).speculative
    assert spec == SpeculativeConfig("draft_model", 4, 1, 12, "/d", DEFAULT_DISABLE_BY_BATCH_SIZE)
    spec = config_of(*base, "--speculative-num-draft-tokens", "3").speculative
    assert spec is not None and spec.num_speculative_tokens == 2
    # SGLang's usual line: steps, top-k 1, and num_draft_tokens = steps + 1.
    spec = config_of(
        *base,
        "--speculative-num-steps",
        "3",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "4",
    ).speculative
    assert spec is not None and spec.num_speculative_tokens == 3
    # With top-k 1 SGLang sets num_draft_tokens to steps + 1: the steps decide.
    spec = config_of(
        *base, "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "9"
    ).speculative
    assert spec is not None and spec.num_speculative_tokens == 2


def test_sglang_ngram_ignores_steps_as_sglang_does() -> None:
    spec = config_of(
        "--speculative-algorithm",
        "NGRAM",
        "--speculative-num-steps",
        "2",
        "--speculative-num-draft-tokens",
        "6",
    ).speculative
    assert spec is not None and spec.num_speculative_tokens == 5


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3", "NEXTN", "MTP", "eagle3", "DFLASH"])
def test_sglang_refuses_algorithms_that_need_trained_heads(algorithm: str) -> None:
    refused(
        f"--speculative-algorithm: '{algorithm}' needs draft heads trained",
        "--speculative-algorithm",
        algorithm,
    )


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--speculative-algorithm", "LOOKAHEAD"], "'LOOKAHEAD' is not one of NGRAM, STANDALONE"),
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "1"],
            "--speculative-num-draft-tokens counts the verified token .* 2 to 17, got 1",
        ),
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "18"],
            "2 to 17, got 18",
        ),
        (
            [
                "--speculative-algorithm",
                "STANDALONE",
                "--speculative-draft-model-path",
                "/d",
                "--speculative-num-steps",
                "0",
            ],
            "--speculative-num-steps must be 1 to 16, got 0",
        ),
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-eagle-topk", "4"],
            "--speculative-eagle-topk: tokenpipe drafts one chain per request",
        ),
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-ngram-min-match-window-size", "13"],
            "need 1 <= min <= max \\(defaults 1 and 12\\), got 13 and 12",
        ),
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-draft-model-path", "/d"],
            "--speculative-draft-model-path: n-gram speculation takes no draft model",
        ),
        (
            ["--speculative-algorithm", "STANDALONE"],
            "--speculative-draft-model-path: a draft model needs its checkpoint directory",
        ),
        (
            ["--speculative-algorithm", "NGRAM", "--speculative-disable-by-batch-size", "-1"],
            "--speculative-disable-by-batch-size must be 0 \\(no limit\\)",
        ),
    ],
)
def test_sglang_refusals_name_the_flag(argv: list[str], match: str) -> None:
    refused(match, *argv)


# --- the two spellings together, and settings without speculation -------------------------


def test_both_spellings_at_once_are_refused() -> None:
    refused(
        "give --speculative-config \\(vLLM's spelling\\) or --speculative-algorithm",
        "--speculative-config",
        json.dumps({"method": "ngram", "num_speculative_tokens": 2}),
        "--speculative-algorithm",
        "NGRAM",
    )


@pytest.mark.parametrize(
    "flag",
    [
        "--speculative-num-draft-tokens",
        "--speculative-num-steps",
        "--speculative-eagle-topk",
        "--speculative-ngram-min-match-window-size",
        "--speculative-ngram-max-match-window-size",
    ],
)
def test_sglang_flags_without_the_algorithm_are_refused(flag: str) -> None:
    refused(f"{flag}: SGLang's spelling, which needs --speculative-algorithm", flag, "3")
    # Beside vLLM's JSON they would be ignored: refused too.
    refused(
        f"{flag}: SGLang's spelling",
        flag,
        "3",
        "--speculative-config",
        json.dumps({"method": "ngram", "num_speculative_tokens": 2}),
    )


def test_a_batch_size_limit_without_speculation_is_refused() -> None:
    refused(
        "--speculative-disable-by-batch-size needs speculation on",
        "--speculative-disable-by-batch-size",
        "8",
    )


@pytest.mark.parametrize("mode", ["embedding", "dllm"])
def test_modes_without_token_decoding_refuse_speculation(mode: str) -> None:
    refused(
        "speculative decoding \\(--speculative-config, --speculative-algorithm\\) needs --mode "
        "generate",
        "--mode",
        mode,
        "--speculative-algorithm",
        "NGRAM",
    )
    config = ServerConfig(mode=mode, speculative_algorithm="NGRAM")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs --mode generate"):
        check_config(config)


def test_serve_exits_non_zero_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--speculative-algorithm", "EAGLE3"])
    assert exit_.value.code != 0
    err = capsys.readouterr().err
    assert "--speculative-algorithm: 'EAGLE3' needs draft heads trained" in err
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": 2}'])
    assert exit_.value.code != 0
    assert "--speculative-config: 'eagle' needs draft heads trained" in capsys.readouterr().err
