"""A scheduler stopped while its grammar threads run native code exits cleanly
(scheduler_proc/sampling/grammar.py, compile_pool.py, scheduler_proc/main.py).

Python finalizes its interpreter by unwinding the daemon threads still running, and a thread
inside the tokenizer's Rust or xgrammar's C++ answers with std::terminate: the process ends
with SIGABRT instead of 0. It happened to a scheduler stopped about a second after its start,
while the grammar engine was still scanning the vocabulary. Each case runs a small script in
a fresh interpreter and reads its exit code; the native work in each is real (the shipped
tokenizer's vocabulary, real compiles), kept going long enough that the script's exit lands
inside it. Before the fix, about three exits in four aborted in the engine's case."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from tests.server_harness import REPO

PRELUDE = """
import sys, time
from pipeline.io_struct import Constraint
from pipeline.tokenizer_loader import load_tokenizer
from scheduler_proc.sampling.grammar import GrammarCompiler, tokenizer_info
from scheduler_proc.sampling.json_grammar import JsonOptions

vocab = load_tokenizer(None)
# Once here first, so the thread spends its time in the scan's native code, not in imports.
tokenizer_info(vocab.tokenizer, 32000, vocab.eos_token_ids, vocab.special_token_ids)

def info_for(seconds):
    # The vocabulary scan, again and again until ``seconds`` have passed: a build that
    # takes that long (a loaded machine, a large vocabulary).
    deadline = time.monotonic() + seconds
    while True:
        info = tokenizer_info(vocab.tokenizer, 32000, vocab.eos_token_ids, vocab.special_token_ids)
        if time.monotonic() > deadline:
            return info

def compiler(seconds):
    return GrammarCompiler(
        lambda: info_for(seconds), vocab.eos_token_ids, json_options=JsonOptions(), timeout=60.0
    )
"""

# The process ends while the engine is still being built: the interpreter waits for it.
ENGINE_STILL_BUILDING = """
compiler(1.5)
print("exiting", flush=True)
"""

# A compile that keeps running in xgrammar's C++ (real compiles, one after another, for a
# minute) holds a worker: ``close`` says so within its wait, and the process ends the way
# run_scheduler ends it then.
COMPILE_STILL_RUNNING = """
from pipeline.process_util import exit_without_finalizing
c = compiler(0.0)
schema = '{"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}'
inner = c.compile
started = []

def endless(key):
    started.append(key)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        inner(key)
    return inner(key)

c.compile = endless
c.submit(c.key(Constraint(kind="json_schema", spec=schema, param="response_format")))
while not started:
    time.sleep(0.01)
time.sleep(0.3)  # well inside the compiles
assert not c.close(0.2), "close says every worker left while one compiles"
print("exiting", flush=True)
exit_without_finalizing(0)
"""

# Idle workers leave at once: ``close`` says so, and the process finalizes as usual.
COMPILES_DONE = """
c = compiler(0.0)
key = c.key(Constraint(kind="regex", spec="[a-z]{3}", param="regex"))
c.submit(key)
deadline = time.monotonic() + 60
while not c.poll() and time.monotonic() < deadline:
    time.sleep(0.01)
assert c.close(5.0), "an idle worker did not leave"
print("exiting", flush=True)
"""


def start(body: str) -> subprocess.Popen[str]:
    script = textwrap.dedent(PRELUDE) + textwrap.dedent(body)
    return subprocess.Popen(
        [sys.executable, "-c", script],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen[str]) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out


def test_a_process_that_ends_while_the_grammar_engine_builds_exits_0() -> None:
    """Three at once: before the fix, each aborted about three times in four."""
    procs = [start(ENGINE_STILL_BUILDING) for _ in range(3)]
    for proc in procs:
        code, out = finish(proc)
        assert code == 0 and "exiting" in out, f"exit code {code}:\n{out[-3000:]}"


def test_a_compile_that_runs_on_makes_close_say_so_and_the_hard_exit_is_clean() -> None:
    began = time.monotonic()
    code, out = finish(start(COMPILE_STILL_RUNNING))
    assert code == 0 and "exiting" in out, f"exit code {code}:\n{out[-3000:]}"
    # It did not wait for the minute of compiles.
    assert time.monotonic() - began < 45


def test_idle_workers_leave_within_the_wait() -> None:
    code, out = finish(start(COMPILES_DONE))
    assert code == 0 and "exiting" in out, f"exit code {code}:\n{out[-3000:]}"
