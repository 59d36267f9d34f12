"""``--tools FILE`` of bench/serve.py (with ``--api chat``): what tool calling costs a
serving run.

With ``--launch``, after the main run, three arms of the chat workload in ``run_rounds`` on
the same server: ``no_tools`` (a short user message, a plain answer); ``tools_none`` (every
request carries the tools in FILE with ``tool_choice: "none"``: the same long prompt, a plain
answer, the parser off); ``tools`` (``tool_choice: "required"``: each answer constrained to
calls and read by the API's tool-call parser). Tools against no tools is the whole cost of
tool calling; against ``tools_none`` it is the constraint's and the parser's, the prompt
being the same, and the difference in API CPU per streamed token is the parser's cost.
Details: bench/README.md.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from bench.serve_client import LoadConfig
from bench.serve_compare import run_rounds, same_server

NO_TOOLS, TOOLS_NONE, TOOLS = "no_tools", "tools_none", "tools"
ARMS = (NO_TOOLS, TOOLS_NONE, TOOLS)


def read_tools(text: str) -> str:
    """The tools FILE's text, checked to be a non-empty JSON list of function tools,
    compacted (one line in every request body)."""
    tools = json.loads(text)
    if not isinstance(tools, list) or not tools:
        raise ValueError("--tools FILE must hold a non-empty JSON list of tools")
    for tool in tools:
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            raise ValueError(
                '--tools FILE: every tool must be {"type": "function", "function": {...}}'
            )
    return json.dumps(tools, separators=(",", ":"))


def tools_variants(cfg: LoadConfig, tools: str) -> dict[str, LoadConfig]:
    """The chat workload of ``cfg`` without tools, with ``tools`` and tool_choice none, and
    with ``tools`` and tool_choice required."""
    return {
        NO_TOOLS: replace(cfg, tools=None),
        TOOLS_NONE: replace(cfg, tools=tools, tool_choice="none"),
        TOOLS: replace(cfg, tools=tools, tool_choice="required"),
    }


def api_us_per_token(runs: list[dict[str, Any]]) -> float | None:
    """Microseconds of API CPU per output token received in the runs' steady windows, over all
    of them together: the API's CPU is read in clock ticks (10 ms), which one short run's
    window may not reach, while the runs together do. None: no API CPU was measured."""
    cpu = [run.get("cpu") or {} for run in runs]
    api_cpu = sum(c.get("api_cpu_s") or 0.0 for c in cpu)
    tokens = sum(c.get("tokens_in_window") or 0 for c in cpu)
    return 1e6 * api_cpu / tokens if api_cpu > 0 and tokens > 0 else None


async def run_tools(
    url: str,
    cfg: LoadConfig,
    tools: str,
    rounds: int,
    prompt_set: int,
    procs: dict[str, int] | None = None,
) -> dict[str, Any]:
    """The three arms in ``run_rounds``, with the API's CPU per token, tokens per answer and
    tool calls per answer of each."""
    result = await run_rounds(
        same_server(tools_variants(cfg, tools), url, procs), rounds, prompt_set
    )
    runs = {name: [row[name] for row in result["rounds"]] for name in ARMS}
    answers = {name: max(1, sum(run["completed"] for run in r)) for name, r in runs.items()}
    return {
        "tools": len(json.loads(tools)),
        **result,
        "api_us_per_token": {name: api_us_per_token(r) for name, r in runs.items()},
        "tokens_per_answer": {
            name: sum(run["output_tokens"] for run in r) / answers[name] for name, r in runs.items()
        },
        "tool_calls_per_answer": {
            name: sum(run["tool_calls"] for run in r) / answers[name] for name, r in runs.items()
        },
    }


def fmt_tool_calling(s: dict[str, Any]) -> list[str]:
    """``run_tools``' result: each round's output tokens/s per arm, the medians, the ratios
    to no_tools and the per-arm figures."""
    w = 14
    lines = [
        f"  chat without tools, with {s['tools']} tools and tool_choice none (parser off), "
        "and required (parser on); "
        f"same server, {len(s['rounds'])} rounds (order rotated each round)",
        f"  {'round':<8}{'first':<12}" + "".join(f"{name + ' tok/s':>{w + 4}}" for name in ARMS),
    ]
    for i, row in enumerate(s["rounds"], 1):
        lines.append(
            f"  {i:<8d}{row['first']:<12}"
            + "".join(f"{row[name]['output_tokens_per_s']:{w + 4}.1f}" for name in ARMS)
        )
    lines.append(
        f"  {'median':<20}"
        + "".join(f"{s[name + '_output_tokens_per_s']:{w + 4}.1f}" for name in ARMS)
    )
    ratio = s["ratios"]
    fmt = lambda v: f"{v:.3f}x" if v is not None else "n/a"  # noqa: E731
    tools_none = (
        ratio[TOOLS] / ratio[TOOLS_NONE] if ratio[TOOLS] is not None and ratio[TOOLS_NONE] else None
    )
    lines.append(
        f"  tools/no_tools {fmt(ratio[TOOLS])}, tools_none/no_tools {fmt(ratio[TOOLS_NONE])}, "
        f"tools/tools_none {fmt(tools_none)} (the constraint and the parser alone)"
    )
    us = s["api_us_per_token"]
    lines.append(
        "  API CPU us per streamed token, over the rounds together: "
        + ", ".join(
            f"{name} {us[name]:.1f}" if us[name] is not None else f"{name} n/a" for name in ARMS
        )
    )
    per, calls = s["tokens_per_answer"], s["tool_calls_per_answer"]
    lines.append(
        "  tokens per answer: "
        + ", ".join(f"{name} {per[name]:.1f}" for name in ARMS)
        + f"; tool calls per answer ({TOOLS}) {calls[TOOLS]:.2f}"
    )
    lines.append(
        f"  errors {s['errors']}, tokens lost {s['tokens_lost']} over the comparison's runs"
    )
    return lines
