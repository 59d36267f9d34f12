"""The report of bench/serve.py: the table it prints (``format_report``) and the
``--plot`` PNG (``write_plot``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.serve_client import ENDPOINTS, ReqResult
from bench.serve_compare import MULTI, SINGLE
from bench.serve_readings import SETTLE_TIMEOUT, is_api
from bench.serve_tools import fmt_tool_calling

TARGET_RATIO = 0.95  # attached/discarded scheduler steps/s
TARGET_SAMPLING_RATIO = 0.9  # sampled/greedy output tokens/s
TARGET_LOGPROBS_RATIO = 0.9  # with top-5 logprobs / without, output tokens/s (vLLM: 0.73x)
TARGET_STRUCTURED_RATIO = 0.8  # every request constrained by a JSON schema / none, output tokens/s
TARGET_STREAMS = 256


# --- output -----------------------------------------------------------------------------------


def fmt_pcts(p: dict[str, float | None]) -> str:
    return "  ".join(
        f"{k} {v:9.1f}" if v is not None else f"{k}       n/a" for k, v in p.items() if k != "mean"
    )


def fmt_rate(label: str, rate: dict[str, Any] | None, extra: str = "") -> str:
    if not rate:
        return f"  {label:<20}{'n/a':>10}   (no scheduler reports)"
    lo, hi = rate["window_s"]
    line = (
        f"  {label:<20}{rate['steps_per_s']:10.2f}   "
        f"({rate['steps']} steps, {lo:.1f}-{hi:.1f} s{extra})"
    )
    if not rate.get("confirmed", True):
        line += (
            f"  [no report of the work done within {SETTLE_TIMEOUT:g} s: may miss the last steps]"
        )
    return line


def fmt_target(label: str, value: float | None, target: float, c: dict[str, Any]) -> str:
    """A ratio against its target, set at ``TARGET_STREAMS`` streaming clients."""
    if value is None:
        return f"  {label:<20}{'n/a':>10}"
    verdict = "PASS" if value >= target else "MISS"
    note = (
        ""
        if c["concurrency"] == TARGET_STREAMS and c["stream_ratio"] == 1.0
        else f"; target is set at {TARGET_STREAMS} streams"
    )
    return f"  {label:<20}{value:10.3f}x  target >= {target}x: {verdict}{note}"


def fmt_params(p: dict[str, Any]) -> str:
    if p["temperature"] == 0.0:
        return "temperature 0"
    return (
        f"temperature {p['temperature']:g}"
        + (f", top_p {p['top_p']:g}" if p["top_p"] is not None else "")
        + (", seeded" if p["seeded"] else "")
    )


def fmt_rounds(
    s: dict[str, Any],
    c: dict[str, Any],
    title: str,
    base: str,
    other: str,
    target: float | None,
    where: str = "same server",
) -> list[str]:
    """A ``run_rounds`` result: each round's output tokens/s and ratio, then the medians;
    the ratio against its target, if it has one."""
    label = f"{other}/{base}"
    w = max(16, len(label) + 2)
    fw, bw, ow = (
        max(10, len(base) + 2, len(other) + 2),
        max(14, len(base) + 8),
        max(15, len(other) + 8),
    )
    lines = [
        f"  {title}, {where}, {len(s['rounds'])} rounds (order swapped each round)",
        f"  {'round':<8}{'first':<{fw}}{base + ' tok/s':>{bw}}{other + ' tok/s':>{ow}}{label:>{w}}",
    ]
    for i, row in enumerate(s["rounds"], 1):
        value = f"{row['ratio']:{w - 1}.3f}x" if row["ratio"] is not None else f"{'n/a':>{w}}"
        lines.append(
            f"  {i:<8d}{row['first']:<{fw}}"
            f"{row[base]['output_tokens_per_s']:{bw}.1f}"
            f"{row[other]['output_tokens_per_s']:{ow}.1f}{value}"
        )
    value = f"{s['ratio']:{w - 1}.3f}x" if s["ratio"] is not None else f"{'n/a':>{w}}"
    lines.append(
        f"  {'median':<{8 + fw}}"
        f"{s[base + '_output_tokens_per_s']:{bw}.1f}"
        f"{s[other + '_output_tokens_per_s']:{ow}.1f}{value}"
    )
    lost = f", logprobs lost {s['logprobs_lost']}" if s["logprobs_lost"] else ""
    lines.append(
        f"  errors {s['errors']}, tokens lost {s['tokens_lost']}{lost} over the comparison's runs"
    )
    if target is not None:
        lines.append(fmt_target(label, s["ratio"], target, c))
    return lines


def fmt_num(value: float | None, width: int, digits: int) -> str:
    return f"{value:{width}.{digits}f}" if value is not None else f"{'n/a':>{width}}"


def fmt_cpu(cpu: dict[str, Any] | None) -> list[str]:
    """Each process's CPU over the steady window, the client's, and tokens per API CPU-s."""
    if cpu is None:
        return [f"  {'CPU':<20}{'n/a':>10}   (no steady window)"]
    lo, hi = cpu["window_s"]
    lines = [
        f"  CPU, steady window  {'CPU-s':>10}{'cores':>10}   "
        f"({lo:.1f}-{hi:.1f} s; cores = CPU-s / {hi - lo:.1f} s)"
    ]
    for name, p in cpu["processes"].items():
        lines.append(
            f"    {name:<18}{p['cpu_s']:10.2f}{fmt_num(p['cores'], 10, 3)}   (pid {p['pid']})"
        )
    lines.append(
        f"    {'bench client':<18}{cpu['client']['cpu_s']:10.2f}"
        f"{fmt_num(cpu['client']['cores'], 10, 3)}"
    )
    if "note" in cpu:
        lines.append(f"    {cpu['note']}")
    api = f"{cpu['api_cpu_s']:.2f}" if cpu["api_cpu_s"] is not None else "n/a"
    lines.append(
        f"  {'tokens/API CPU-s':<20}{fmt_num(cpu['tokens_per_api_cpu_s'], 10, 1)}   "
        f"({cpu['tokens_in_window']} output tokens received in the window / {api} API CPU-s)"
    )
    return lines


def fmt_api_workers(s: dict[str, Any], c: dict[str, Any]) -> list[str]:
    n = s["workers"]
    flags = (
        f"plus {' '.join(s['flags'])}"
        if s["flags"]
        else "(N = 1: no --api-workers flag, one API process as the default)"
    )
    title = (
        f"one API process against {n}: {SINGLE} = the main server; "
        f"{MULTI} = a second one, the same flags {flags}"
    )
    lines = fmt_rounds(s, c, title, SINGLE, MULTI, None, where="two servers up at once")
    for name in (SINGLE, MULTI):
        m = s["cpu"][name]
        api = (
            "  ".join(f"{k} {fmt_num(v, 0, 3)}" for k, v in m["cores"].items() if is_api(k))
            or "n/a"
        )
        lines.append(
            f"  {name:<8}API cores: {api}; "
            f"tokens/API CPU-s {fmt_num(m['tokens_per_api_cpu_s'], 0, 1)} "
            f"(medians over rounds; "
            + ", ".join(f"{k} {fmt_num(v, 0, 3)}" for k, v in m["cores"].items() if not is_api(k))
            + f", client {fmt_num(m['client_cores'], 0, 3)} cores)"
        )
    return lines


def fmt_sampling(s: dict[str, Any], c: dict[str, Any]) -> list[str]:
    title = (
        f"greedy against sampled: greedy = {fmt_params(s['params']['greedy'])}; "
        f"sampled = {fmt_params(s['params']['sampled'])}"
    )
    return fmt_rounds(s, c, title, "greedy", "sampled", TARGET_SAMPLING_RATIO)


def fmt_logprobs(s: dict[str, Any], c: dict[str, Any]) -> list[str]:
    title = f"without logprobs against top-{s['top_logprobs']} logprobs on every request"
    return fmt_rounds(s, c, title, "without", "logprobs", TARGET_LOGPROBS_RATIO)


def fmt_structured(s: dict[str, Any], c: dict[str, Any]) -> list[str]:
    title = (
        "unconstrained against every request constrained by a JSON schema "
        f"({s['schema_bytes']} bytes)"
    )
    lines = fmt_rounds(s, c, title, "unconstrained", "constrained", TARGET_STRUCTURED_RATIO)
    k = s["compile"]
    lines.append(
        f"  TTFT ms, medians of {k['trials']}: new schema {k['new_ttft_ms']:.1f}, "
        f"cached {k['cached_ttft_ms']:.1f}, unconstrained {k['unconstrained_ttft_ms']:.1f}; "
        f"a compile adds {k['compile_ms']:.1f} ms to a first request"
    )
    a = s["answers"]
    lines.append(
        f"  answers with room to end ({a['requests']}, at most {a['max_new_tokens']} tokens): "
        f"median {a['median_completion_tokens']:.0f} completion tokens, "
        f"{a['ended']} of {a['requests']} ended by the grammar"
    )
    return lines


def fmt_adapters(names: Sequence[str | None]) -> str:
    """The adapters requests go round-robin over, the base model as ``base``."""
    return ", ".join(name if name is not None else "base" for name in names)


def format_report(r: dict[str, Any]) -> str:
    c = r["config"]
    lines = [
        f"bench/serve  {r['url']}  concurrency {c['concurrency']}, "
        f"{r['requests']} requests ({r['streaming']} streaming), "
        f"prompt {c['prompt_len']}, max_new_tokens {c['max_new_tokens']}, {fmt_params(c)}"
        + (f", through {ENDPOINTS[c['api']]}" if c["api"] != "generate" else "")
        + (f", in turn over {fmt_adapters(c['lora_names'])}" if c.get("lora_names") else ""),
        f"  duration            {r['duration_s']:10.2f} s",
        f"  requests/s          {r['requests_per_s']:10.2f}",
        f"  output tokens/s     {r['output_tokens_per_s']:10.1f}",
        f"  TTFT ms             {fmt_pcts(r['ttft_ms'])}",
        f"  ITL ms              {fmt_pcts(r['itl_ms'])}",
        f"  e2e ms              {fmt_pcts(r['e2e_ms'])}",
        f"  errors              {r['errors']:10d}"
        + (f"   e.g. {r['error_examples'][0]}" if r["error_examples"] else ""),
        f"  tokens lost         {r['tokens_lost']:10d}   "
        f"({r['requests_with_lost_tokens']} requests)",
    ]
    lines.append(fmt_rate("scheduler steps/s", r.get("scheduler_steps")))
    lines += fmt_cpu(r.get("cpu"))
    d = r.get("discard")
    if d is not None:
        lines.append(
            fmt_rate(
                "discarded steps/s", d["scheduler_steps"], f", {d['requests_sent']} requests sent"
            )
        )
        lines.append(fmt_target("attached/discarded", r.get("steps_ratio"), TARGET_RATIO, c))
    s = r.get("sampling")
    if s is not None:
        lines += fmt_sampling(s, c)
    lp = r.get("logprobs")
    if lp is not None:
        lines += fmt_logprobs(lp, c)
    st = r.get("structured")
    if st is not None:
        lines += fmt_structured(st, c)
    tc = r.get("tool_calling")
    if tc is not None:
        lines += fmt_tool_calling(tc)
    w = r.get("api_workers")
    if w is not None:
        lines += fmt_api_workers(w, c)
    return "\n".join(lines)


def write_plot(path: Path, r: dict[str, Any], results: Sequence[ReqResult]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    ttft = [
        [x.ttft * 1000 for x in results if x.ok and x.ttft is not None and x.stream == st]
        for st in (True, False)
    ]
    itl = [v * 1000 for x in results if x.ok for v in x.itl]
    axes[0].hist(ttft, bins=40, stacked=True, label=["streaming", "non-streaming (= e2e)"])
    axes[0].set(title="TTFT", xlabel="ms", ylabel="requests")
    axes[0].legend()
    axes[1].hist(itl or [0.0], bins=60)
    axes[1].set(title="ITL (streaming)", xlabel="ms per token", ylabel="events")
    bin_s = max(1.0, r["duration_s"] / 60)
    nbins = int(r["duration_s"] / bin_s) + 1
    per_bin = [0] * nbins
    for x in results:
        for t, n in x.arrivals:
            per_bin[min(nbins - 1, int(t / bin_s))] += n
    axes[2].plot(
        [i * bin_s for i in range(nbins)],
        [n / bin_s for n in per_bin],
        drawstyle="steps-post",
        label="client tokens/s",
    )
    times, rates = step_rates(r.get("samples") or [])
    if rates:
        ax2 = axes[2].twinx()
        ax2.plot(times, rates, color="tab:orange", alpha=0.7)
        ax2.set_ylabel("scheduler steps/s (orange)")
    axes[2].set(title="output tokens/s over time", xlabel="s", ylabel="tokens/s")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=80)
    plt.close(fig)


def step_rates(samples: Sequence[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Steps/s between consecutive new scheduler reports, at the time each was first seen."""
    changes = [b for a, b in zip(samples, samples[1:]) if b["steps"] != a["steps"]]
    pairs = [
        (b["answered"], (b["steps"] - a["steps"]) / (b["answered"] - a["answered"]))
        for a, b in zip(changes, changes[1:])
    ]
    return [t for t, _ in pairs], [v for _, v in pairs]
