"""The scheduler process: receives requests and aborts, runs ``Scheduler.step()`` while
there is work, and pushes each step's frames to the detokenizer."""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import zmq

from pipeline.config import ServerConfig
from pipeline.dispatch import TypeDispatcher, route
from pipeline.control_frames import (
    ContinueControl,
    FlushCacheControl,
    HiCacheStorageControl,
    LoadLoraControl,
    PauseControl,
    RolloutState,
    UnloadLoraControl,
    UpdateWeightsControl,
)
from pipeline.io_struct import (
    AbortReq,
    SchedulerInput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from pipeline.model_config import context_length_of
from pipeline.process_util import ShutdownFlag, exit_without_finalizing, report_ready
from pipeline.sockets import FrameDecoder, bind_pull, connect_push, make_encoder
from pipeline.tokenizer_loader import LoadedTokenizer, ModelVocab, load_vocab
from scheduler_proc.dllm import DllmConfig
from scheduler_proc.cache.hicache import HiCache
from scheduler_proc.cache.kv_storage import StorageError
from scheduler_proc.control import lora_control
from scheduler_proc.lora.adapter_files import LoraError
from scheduler_proc.kv_events.stream import attach_kv_events
from scheduler_proc.pd.kv_transfer import KVFetchClient, KVFetchServer
from scheduler_proc.model.runner import ModelRunner
from scheduler_proc.pd.decode import DecodeBootstrapper
from scheduler_proc.pd.prefill import PrefillKVSender
from scheduler_proc.speculative.proposers import build_drafter
from scheduler_proc.priority import priority_order
from scheduler_proc.sampling.grammar import GrammarCompiler, tokenizer_info
from scheduler_proc.sampling.json_grammar import JsonOptions
from scheduler_proc.scheduler import Scheduler
from scheduler_proc.stats_reporter import SchedulerStatsReporter
from scheduler_proc.stop_checker import StopChecker

logger = logging.getLogger("tokenpipe.scheduler")

# How long an otherwise idle loop waits on its sockets while grammars compile: a finished
# compile is taken at most this late, and the loop does not spin against the compiler.
GRAMMAR_POLL_MS = 2
# The same while new weights are read on their own thread: they are swapped in at most this
# late after the read ends.
ROLLOUT_POLL_MS = 5
# How long a stopping scheduler waits for a grammar compile under way (they take milliseconds
# as a rule). xgrammar cannot stop one, and the interpreter must not finalize around it.
COMPILE_EXIT_WAIT = 1.0


def build_scheduler(config: ServerConfig) -> Scheduler:
    # The tokenizer is here only to match stop strings and to compile grammars (structured
    # outputs); under --skip-tokenizer-init the API refuses both, and the EOS ids and
    # vocabulary size come from the model's configs.
    vocab = load_vocab(config.model_path, skip_tokenizer_init=config.skip_tokenizer_init)
    runner = ModelRunner(config, vocab.vocab_size)
    context_length = context_length_of(config, vocab.vocab_size)
    decode = vocab.decode if isinstance(vocab, LoadedTokenizer) else None
    stop_checker = StopChecker(vocab.eos_token_ids, decode, context_length)
    return Scheduler(
        runner,
        stop_checker,
        context_length=context_length,
        vocab_size=runner.model_config.vocab_size,
        chunked_prefill_size=config.chunked_prefill_size,
        max_running_requests=config.max_running_requests,
        max_queued_requests=config.max_queued_requests,
        stream_interval=config.stream_interval,
        collect_time_stats=config.enable_metrics,
        dense_usage_columns=config.dense_usage_columns,
        dllm=dllm_config(config, vocab.eos_token_ids),
        hicache=build_hicache(config, runner),
        grammar=grammar_compiler(config, vocab, runner),
        overlap_schedule=not config.disable_overlap_schedule,
        weight_version=config.weight_version,
        priority=priority_order(config),
        drafter=build_drafter(config, runner),
    )


def grammar_compiler(
    config: ServerConfig, vocab: LoadedTokenizer | ModelVocab, runner: ModelRunner
) -> GrammarCompiler | None:
    """The grammar compiler of structured outputs, or None without a tokenizer. The
    grammar's vocabulary is the model's logits' width; its stop tokens are EOS."""
    if not isinstance(vocab, LoadedTokenizer):
        return None
    tokenizer, eos, special = vocab.tokenizer, vocab.eos_token_ids, vocab.special_token_ids
    width = runner.model_config.vocab_size
    json_options = JsonOptions(
        max_whitespace=config.constrained_json_max_whitespace,
        any_whitespace=not config.constrained_json_disable_any_whitespace,
    )
    return GrammarCompiler(
        lambda: tokenizer_info(tokenizer, width, eos, special),
        eos,
        json_options=json_options,
        timeout=config.grammar_compile_timeout,
    )


def dllm_config(config: ServerConfig, eos_token_ids: frozenset[int]) -> DllmConfig | None:
    """--mode dllm's settings, or None in another mode. The mask placeholder is the lowest EOS
    id (<|endoftext|>, 0, for the shipped tokenizer): see scheduler_proc/dllm.py."""
    if config.mode != "dllm":
        return None
    if not eos_token_ids:
        raise SystemExit(
            "--mode dllm masks with an EOS id, and the model's configs name none "
            "(generation_config.json eos_token_id)"
        )
    return DllmConfig(config.dllm_block_size, config.dllm_steps, min(eos_token_ids))


def build_hicache(config: ServerConfig, runner: ModelRunner) -> HiCache | None:
    """The host tier (and the storage tier when a directory is given), or None when off.
    Raises StorageError for a storage directory that cannot be used."""
    if config.hicache_host_tokens <= 0:
        return None
    mc = runner.model_config
    # Storage keys hash this in: stored KV is only ever read back by the same model.
    namespace = (
        f"{config.model_path or 'builtin'}|seed={config.model_seed}|{runner.kv.k.dtype}|"
        f"layers={mc.num_hidden_layers}|kv_heads={mc.num_key_value_heads}|head_dim={mc.head_dim}"
    )
    hicache = HiCache(runner.kv, config.hicache_host_tokens, namespace)
    if config.hicache_storage_dir is not None:
        hicache.attach_storage("file", config.hicache_storage_dir)
    return hicache


def attach_pd(
    scheduler: Scheduler, config: ServerConfig, ctx: zmq.Context[Any], poller: zmq.Poller
) -> None:
    """The scheduler's PD side for --disaggregation-mode prefill or decode, with its KV
    transfer sockets registered with the loop's poller so a fetch or a transfer wakes an
    idle scheduler. Without PD the scheduler keeps its ``Unified`` one."""
    timeout = config.disaggregation_bootstrap_timeout
    if config.disaggregation_mode == "prefill":
        endpoint = config.bootstrap_endpoint()
        try:
            server = KVFetchServer(ctx, endpoint)
        except zmq.ZMQError as exc:
            raise SystemExit(
                f"--disaggregation-bootstrap-port/endpoint: cannot bind {endpoint}: {exc}"
            ) from None
        poller.register(server.socket, zmq.POLLIN)
        scheduler.pd = PrefillKVSender(server, scheduler.kv, timeout)
        logger.info("prefill server: decode servers fetch KV at %s", endpoint)
    elif config.disaggregation_mode == "decode":
        scheduler.pd = DecodeBootstrapper(
            KVFetchClient(ctx, poller), scheduler.kv, timeout, scheduler.vocab_size
        )


def release_free_heap() -> None:
    """Hands freed heap back to the OS when the scheduler goes idle. Without it glibc keeps
    the peak of every burst, and RSS creeps up over hours of traffic although no request
    state is left (bench/memory.py measures it)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def build_or_exit(config: ServerConfig) -> Scheduler:
    try:
        scheduler = build_scheduler(config)
    except StorageError as exc:
        raise SystemExit(f"--hicache-storage-dir: {exc}") from None
    except LoraError as exc:  # an adapter named at start that cannot be served
        raise SystemExit(f"--lora-modules/--lora-paths: {exc}") from None
    logger.info("model on %s, KV pool of %d tokens", scheduler.runner.device, scheduler.kv.capacity)
    if scheduler.hicache.host_capacity:
        logger.info("HiCache host tier of %d tokens", scheduler.hicache.host_capacity)
    return scheduler


class SchedulerLoop:
    """The scheduler process: its ``Scheduler``, its sockets, and what it does with each
    message between two steps (``dispatcher``: type -> handler, one row per message)."""

    def __init__(self, config: ServerConfig, scheduler: Scheduler, ctx: zmq.Context[Any]) -> None:
        self.config = config
        self.scheduler = scheduler
        self._init_sockets(config, ctx)
        attach_pd(self.scheduler, config, ctx, self.poller)
        self.reporter = SchedulerStatsReporter(self.scheduler)
        self.kv_events = attach_kv_events(config, scheduler.cache, ctx)
        self.dispatcher = TypeDispatcher(
            [
                route(TokenizedGenerateReqInput, self.scheduler.add_request),
                route(TokenizedEmbeddingReqInput, self.scheduler.add_request),
                route(AbortReq, self.on_abort),
                route(HiCacheStorageControl, self.on_storage_control),
                route(FlushCacheControl, self.on_flush_cache),
                route(PauseControl, self.on_pause),
                route(ContinueControl, self.on_continue),
                route(UpdateWeightsControl, self.on_update_weights),
                route(LoadLoraControl, self.on_lora_control),
                route(UnloadLoraControl, self.on_lora_control),
            ]
        )

    def _init_sockets(self, config: ServerConfig, ctx: zmq.Context[Any]) -> None:
        self.inbox = bind_pull(ctx, config.scheduler_input)
        self.outbox = connect_push(ctx, config.detokenizer_input)
        self.decoder: FrameDecoder[SchedulerInput] = FrameDecoder(
            SchedulerInput, logger, "scheduler input"
        )
        self.encoder = make_encoder()
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)

    def send(self, msg: msgspec.Struct) -> None:
        self.outbox.send(self.encoder.encode(msg), copy=False)

    def on_abort(self, msg: AbortReq) -> None:
        answer = self.scheduler.abort(msg)
        if answer is not None:
            self.send(answer)

    def on_storage_control(self, msg: HiCacheStorageControl) -> None:
        # Answered at once, before this step's frames: every row after the answer reflects
        # the new storage state.
        self.send(self.scheduler.storage_control(msg))

    def on_flush_cache(self, msg: FlushCacheControl) -> None:
        self.send(self.scheduler.flush_cache(msg))
        # A report at once, so /server_info and /metrics show the emptied cache: an idle
        # scheduler would send none until its next work.
        self.send(self.reporter.report(time.time()))

    def on_pause(self, msg: PauseControl) -> None:
        self.send_rollout(self.scheduler.rollout.pause(self.scheduler, msg, time.time()))

    def on_continue(self, msg: ContinueControl) -> None:
        self.send_rollout(self.scheduler.rollout.resume(self.scheduler, msg))

    def on_update_weights(self, msg: UpdateWeightsControl) -> None:
        answer = self.scheduler.rollout.update_weights(self.scheduler, msg)
        self.send_rollout([answer] if answer is not None else [])

    def on_lora_control(self, msg: LoadLoraControl | UnloadLoraControl) -> None:
        """A report first, so every API worker knows the adapters served by the time the
        asking one answers its client; then the answer."""
        answer = lora_control(self.scheduler.runner.lora, msg)
        if answer.ok:
            self.send(self.reporter.report(time.time()))
        self.send(answer)

    def send_rollout(self, answers: list[RolloutState]) -> None:
        """A report first, so every API worker knows the new state by the time the asking
        one answers its client; then the answers."""
        if answers:
            self.send(self.reporter.report(time.time()))
        for answer in answers:
            self.send(answer)

    def run(self, shutdown: ShutdownFlag) -> None:
        scheduler = self.scheduler
        while not shutdown.is_set():
            self.wait_for_input()
            for msg in self.received():
                self.dispatcher.dispatch(msg)
            for out in scheduler.step():
                encoded = self.encoder.encode(out)
                if not self.config.discard_output:
                    self.outbox.send(encoded, copy=False)
            self.send_rollout(scheduler.rollout.advance(scheduler))
            self.kv_events.after_step()  # what this iteration did to the cache, one batch
            self.maybe_report()
            scheduler.runner.threads.update(time.monotonic())

    def wait_for_input(self) -> None:
        """Blocks only when idle; with work in flight, the step takes what has arrived."""
        if self.scheduler.rollout.busy and not self.scheduler.has_work():
            self.poller.poll(ROLLOUT_POLL_MS)  # weights being read: swap them in soon after
        elif not self.scheduler.has_work():
            self.poller.poll(200)
        elif self.scheduler.only_compiling():
            self.poller.poll(GRAMMAR_POLL_MS)

    def received(self) -> Iterator[SchedulerInput]:
        """The messages that have arrived, without waiting (a frame that fails to decode is
        dropped with a warning)."""
        while True:
            try:
                frame = self.inbox.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            msg = self.decoder.decode(frame.buffer)
            if msg is not None:
                yield msg

    def maybe_report(self) -> None:
        report = self.reporter.maybe_report(time.time())
        if report is not None:
            self.send(report)
            if report.live_reqs == 0:
                release_free_heap()


def run_scheduler(config: ServerConfig) -> None:
    shutdown = ShutdownFlag.install()
    scheduler = build_or_exit(config)
    ctx = zmq.Context()
    loop = SchedulerLoop(config, scheduler, ctx)
    report_ready(ctx, config, "scheduler")
    loop.run(shutdown)
    logger.info("scheduler exiting (pid %d)", os.getpid())
    compiles_done = loop.scheduler.close(COMPILE_EXIT_WAIT)
    loop.kv_events.close()
    ctx.destroy(linger=0)
    if not compiles_done:
        logger.warning("a grammar compile is still running; exiting without it")
        exit_without_finalizing(0)
