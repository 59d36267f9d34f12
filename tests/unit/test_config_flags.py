"""The command line generated from ``ServerConfig``'s declarations (``pipeline.flags``): one
flag per field, spelled as it always was, with its help; the defaults of an empty command
line are the struct's; values and the OpenTelemetry variables arrive in the fields."""

from __future__ import annotations

import argparse
import os
from typing import Annotated

import msgspec
import pytest

from pipeline.config import ServerConfig
from pipeline.server_args import add_server_args, config_from_args
from pipeline.flags import Flag, NoFlag, add_flags, field_flags
from tokenpipe.cli import main

# Every flag tokenpipe has ever taken, as deploy/, README, docs/ and the tests spell them.
FLAGS = {
    "--model-path", "--served-model-name", "--model-seed", "--weight-version", "--device",
    "--scheduling-policy", "--enable-priority-scheduling", "--schedule-low-priority-values-first",
    "--kv-events-config", "--kv-events-block-size", "--enable-request-id-headers",
    "--enable-lora", "--lora-modules", "--lora-paths", "--max-loras", "--max-lora-rank",
    "--max-cpu-loras",
    "--speculative-config", "--speculative-algorithm", "--speculative-num-draft-tokens",
    "--speculative-num-steps", "--speculative-eagle-topk",
    "--speculative-draft-model-path", "--speculative-ngram-min-match-window-size",
    "--speculative-ngram-max-match-window-size", "--speculative-disable-by-batch-size",
    "--dtype", "--torch-threads",
    "--mode", "--context-length", "--skip-tokenizer-init", "--max-total-tokens",
    "--max-running-requests", "--disable-overlap-schedule", "--decode-kv-rows",
    "--chunked-prefill-size", "--stream-interval",
    "--max-new-tokens-limit", "--dllm-block-size", "--dllm-steps", "--discard-output",
    "--dense-usage-columns", "--hicache-host-tokens", "--hicache-storage-dir",
    "--disaggregation-mode", "--disaggregation-bootstrap-port",
    "--disaggregation-bootstrap-endpoint", "--disaggregation-bootstrap-timeout", "--host", "--port",
    "--api-key", "--graceful-timeout", "--health-generate-timeout", "--max-request-bytes",
    "--max-queued-requests", "--request-read-timeout", "--api-workers", "--api-worker-index",
    "--disable-metrics", "--otlp-traces-endpoint", "--log-level", "--scheduler-input",
    "--detokenizer-input", "--tokenizer-input", "--incremental-streaming-output",
    "--tool-call-parser", "--reasoning-parser", "--responses-store-max-count",
    "--responses-store-bytes", "--metrics-compat", "--enable-tokenizer-info-endpoint",
    "--constrained-json-max-whitespace", "--constrained-json-disable-any-whitespace",
    "--grammar-compile-timeout", "--enable-deterministic-inference", "--reject-unknown-fields",
}  # fmt: skip
HIDDEN = {"--ready-endpoint", "--config-json"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_server_args(p)
    return p


def options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {
        spelling: action
        for action in p._actions
        for spelling in action.option_strings
        if spelling != "-h" and spelling != "--help"
    }


def test_every_field_has_one_flag_or_is_marked_as_having_none() -> None:
    declared = field_flags(ServerConfig)  # raises on a field with no marker, or two
    assert [f.name for f in declared] == list(ServerConfig.__struct_fields__)
    without = {f.name for f in declared if isinstance(f.marker, NoFlag)}
    assert without == {"otlp_traces_protocol", "python_hash_seed"}
    by_field: dict[str, list[str]] = {}
    for spelling, action in options(parser()).items():
        by_field.setdefault(action.dest, []).append(spelling)
    assert by_field.pop("config_json") == ["--config-json"]  # a whole config, not a field
    assert by_field == {f.name: [f.spelling] for f in declared if f.name not in without}


def test_the_flags_keep_their_spellings_and_listed_ones_their_help() -> None:
    found = options(parser())
    assert set(found) == FLAGS | HIDDEN
    for spelling in FLAGS:
        assert found[spelling].help, f"{spelling} has no help"
    for spelling in HIDDEN:
        assert found[spelling].help == argparse.SUPPRESS


def test_serve_help_lists_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    listed = capsys.readouterr().out
    assert all(f"  {spelling}" in listed for spelling in FLAGS)
    assert not any(spelling in listed for spelling in HIDDEN)


def test_an_empty_command_line_gives_the_struct_defaults() -> None:
    assert config_from_args(parser().parse_args([]), environ={}) == ServerConfig()


def test_values_arrive_in_their_fields_with_their_types() -> None:
    argv = [
        "--mode", "dllm", "--context-length", "1024", "--skip-tokenizer-init",
        "--chunked-prefill-size", "-1", "--disaggregation-bootstrap-timeout", "2",
        "--max-queued-requests", "0", "--disable-metrics", "--hicache-host-tokens", "64",
        "--hicache-storage-dir", "kv", "--api-workers", "2", "--api-worker-index", "1",
        "--incremental-streaming-output", "--scheduler-input", "tcp://127.0.0.1:5001",
        "--ready-endpoint", "ipc:///tmp/ready",
    ]  # fmt: skip
    config = config_from_args(parser().parse_args(argv), environ={})
    assert config == ServerConfig(
        mode="dllm",
        context_length=1024,
        skip_tokenizer_init=True,
        chunked_prefill_size=-1,
        disaggregation_bootstrap_timeout=2.0,
        max_queued_requests=0,
        enable_metrics=False,
        hicache_host_tokens=64,
        hicache_storage_dir=os.path.abspath("kv"),  # relative to where the command runs
        api_workers=2,
        api_worker_index=1,
        incremental_streaming_output=True,
        scheduler_input="tcp://127.0.0.1:5001",
        ready_endpoint="ipc:///tmp/ready",
    )
    assert isinstance(config.disaggregation_bootstrap_timeout, float)
    # The config a supervisor hands its children reads back the same.
    assert (
        config_from_args(parser().parse_args(["--config-json", config.encode()]), environ={})
        == config
    )


def test_opentelemetry_variables_fill_in_what_the_flags_leave_out() -> None:
    environ = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
    }
    config = config_from_args(parser().parse_args([]), environ=environ)
    assert (config.otlp_traces_endpoint, config.otlp_traces_protocol) == (
        "http://collector:4318",
        "grpc",
    )
    config = config_from_args(
        parser().parse_args(["--otlp-traces-endpoint", "http://flag:4318"]), environ=environ
    )
    assert config.otlp_traces_endpoint == "http://flag:4318"


def test_validation_still_refuses_bad_values() -> None:
    with pytest.raises(ValueError, match="--dllm-steps must be between 1 and --dllm-block-size"):
        config_from_args(
            parser().parse_args(["--dllm-block-size", "2", "--dllm-steps", "3"]), environ={}
        )
    with pytest.raises(ValueError, match="--hicache-storage-dir needs the host tier"):
        config_from_args(parser().parse_args(["--hicache-storage-dir", "/tmp"]), environ={})


def test_a_field_without_a_marker_or_a_true_switch_without_a_spelling_is_refused() -> None:
    class Unmarked(msgspec.Struct):
        listed: Annotated[int, Flag("g", "help")] = 0
        forgotten: int = 0

    with pytest.raises(TypeError, match="Unmarked.forgotten needs exactly one"):
        field_flags(Unmarked)

    class OnByDefault(msgspec.Struct):
        enabled: Annotated[bool, Flag("g", "help")] = True

    with pytest.raises(TypeError, match="OnByDefault.enabled defaults to True"):
        add_flags(argparse.ArgumentParser(), OnByDefault)
