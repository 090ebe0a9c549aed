"""Turn raw benchmark samples into statistics, a printed table and the JSON summary.

Overhead = p(target) - p(direct) within one group (same message list reaching the mock);
"x fwd" = that overhead divided by the bare forwarder's overhead in the same group.
"""

from __future__ import annotations

from typing import Any

LABELS = {
    "direct": "direct -> mock",
    "forwarder": "bare forwarder",
    "forwarder_aiohttp": "bare forwarder, aiohttp client",
    "litellm": "LiteLLM proxy",
    "gateway": "gateway",
    "gateway_nosync": "gateway, durability=none",
}
_ORDER = {"direct": 0, "forwarder": 1, "forwarder_aiohttp": 2, "litellm": 3, "gateway": 4, "gateway_nosync": 5}


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return float("nan")
    pos = (len(sorted_values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def stats_ms(samples: list[float]) -> dict[str, float]:
    values = sorted(s * 1000 for s in samples)
    n = len(values)
    return {
        "n": n,
        "p50": round(percentile(values, 0.50), 4),
        "p90": round(percentile(values, 0.90), 4),
        "p99": round(percentile(values, 0.99), 4),
        "mean": round(sum(values) / n, 4) if n else float("nan"),
        "min": round(values[0], 4) if n else float("nan"),
        "max": round(values[-1], 4) if n else float("nan"),
    }


def _label(row: dict[str, Any], grouped: bool) -> str:
    if row.get("label"):
        return str(row["label"])
    base = LABELS.get(row["target"], row["target"])
    if grouped and row["target"] == "direct":
        return f"{base}, same body the gateway sent"
    if grouped and row["target"] in ("forwarder", "forwarder_aiohttp", "litellm"):
        return f"{base}, same body (full history)"
    return base


def _fmt(value: float | None, sign: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.2f}" if sign else f"{value:.2f}"


def _latency_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    groups: dict[str, list[dict[str, Any]]] = {}
    for raw in result["latency"]:
        groups.setdefault(raw["group"], []).append(raw)
    for group, members in groups.items():
        members.sort(key=lambda r: _ORDER.get(r["target"], 9))
        by_target = {r["target"]: r for r in members}
        for r in members:
            r["stats"] = stats_ms(r.pop("samples"))
        base = by_target.get("direct")
        fwd = by_target.get("forwarder")
        fwd_over = fwd["stats"]["p50"] - base["stats"]["p50"] if base and fwd else None
        for r in members:
            s = r["stats"]
            over50 = over99 = ratio = None
            if base is not None and r is not base:
                over50 = s["p50"] - base["stats"]["p50"]
                over99 = s["p99"] - base["stats"]["p99"]
                if fwd_over and r is not fwd:
                    ratio = over50 / fwd_over
            rows.append(
                {
                    "group": group,
                    "scenario": _label(r, group != "1 message"),
                    "target": r["target"],
                    "sent_messages": r.get("sent_messages"),
                    "n": s["n"],
                    "p50_ms": s["p50"],
                    "p99_ms": s["p99"],
                    "overhead_p50_ms": None if over50 is None else round(over50, 3),
                    "overhead_p99_ms": None if over99 is None else round(over99, 3),
                    "x_forwarder_overhead": None if ratio is None else round(ratio, 2),
                    **({"cold_first_request_ms": round(r["cold_first_request_ms"], 2)} if "cold_first_request_ms" in r else {}),
                }
            )
    return rows


def _stream_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for r in result["stream"]:
        r["stats"] = stats_ms(r.pop("samples"))
        r["total_stats"] = stats_ms(r.pop("total_samples"))
    by = {r["target"]: r for r in result["stream"]}
    base, fwd = by.get("direct"), by.get("forwarder")
    fwd_over = fwd["stats"]["p50"] - base["stats"]["p50"] if base and fwd else None
    for r in sorted(result["stream"], key=lambda r: _ORDER.get(r["target"], 9)):
        s = r["stats"]
        over50 = over99 = ratio = None
        if base is not None and r is not base:
            over50 = s["p50"] - base["stats"]["p50"]
            over99 = s["p99"] - base["stats"]["p99"]
            if fwd_over and r is not fwd:
                ratio = over50 / fwd_over
        label = LABELS.get(r["target"], r["target"]) + (", new conversation" if r["target"] == "gateway" else "")
        rows.append(
            {
                "scenario": label,
                "target": r["target"],
                "n": s["n"],
                "ttfc_p50_ms": s["p50"],
                "ttfc_p99_ms": s["p99"],
                "overhead_p50_ms": None if over50 is None else round(over50, 3),
                "overhead_p99_ms": None if over99 is None else round(over99, 3),
                "x_forwarder_overhead": None if ratio is None else round(ratio, 2),
                "full_stream_p50_ms": r["total_stats"]["p50"],
            }
        )
    return rows


def _throughput_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    direct_rps = None
    for r in sorted(result["throughput"], key=lambda r: _ORDER.get(r["target"], 9)):
        r["stats"] = stats_ms(r.pop("samples"))
        rps = r["requests"] / r["seconds"]
        r["rps"] = round(rps, 1)
        if r["target"] == "direct":
            direct_rps = rps
        rows.append(
            {
                "scenario": r.get("label") or LABELS.get(r["target"], r["target"]),
                "target": r["target"],
                "requests": r["requests"],
                "req_per_s": round(rps, 1),
                "vs_direct": round(rps / direct_rps, 3) if direct_rps else None,
                "p50_ms": r["stats"]["p50"],
                "p99_ms": r["stats"]["p99"],
            }
        )
    return rows


def print_report(result: dict[str, Any]) -> dict[str, Any]:
    """Print the tables; return the summary (raw samples in `result` become statistics)."""
    latency = _latency_rows(result)
    stream = _stream_rows(result)
    throughput = _throughput_rows(result)
    gw = result["gateway"]
    width = max(len(r["scenario"]) for r in [*latency, *stream, *throughput]) + 2
    rule = "-" * (width + 62)

    print("\nLatency, sequential non-streaming requests (ms); overhead = target - direct with the same messages")
    print(f"{'scenario':<{width}}{'sent':>7}{'n':>6}{'p50':>8}{'p99':>8}{'ovh p50':>9}{'ovh p99':>9}{'x fwd':>7}  cold")
    group = None
    for r in latency:
        if r["group"] != group:
            group = r["group"]
            print(rule if group == "1 message" else "")
        ratio = "-" if r["x_forwarder_overhead"] is None else f"{r['x_forwarder_overhead']:.2f}"
        cold = f"  {r['cold_first_request_ms']:.1f}" if "cold_first_request_ms" in r else ""
        print(
            f"{r['scenario']:<{width}}{r['sent_messages'] or '-':>7}{r['n']:>6}{r['p50_ms']:>8.2f}{r['p99_ms']:>8.2f}"
            f"{_fmt(r['overhead_p50_ms'], True):>9}{_fmt(r['overhead_p99_ms'], True):>9}{ratio:>7}{cold}"
        )

    print(
        "sent = messages the mock received (median); ovh = target - direct; x fwd = that p50 overhead /"
        " the bare (httpx) forwarder's;\ncold = median latency of the first request on a seeded"
        " conversation (the gateway loads it from disk)"
    )

    print("\nStreaming, time to first chunk (ms), 1 message")
    print(f"{'scenario':<{width}}{'':>7}{'n':>6}{'p50':>8}{'p99':>8}{'ovh p50':>9}{'ovh p99':>9}{'x fwd':>7}  whole stream p50")
    print(rule)
    for r in stream:
        ratio = "-" if r["x_forwarder_overhead"] is None else f"{r['x_forwarder_overhead']:.2f}"
        print(
            f"{r['scenario']:<{width}}{'':>7}{r['n']:>6}{r['ttfc_p50_ms']:>8.2f}{r['ttfc_p99_ms']:>8.2f}"
            f"{_fmt(r['overhead_p50_ms'], True):>9}{_fmt(r['overhead_p99_ms'], True):>9}{ratio:>7}"
            f"  {r['full_stream_p50_ms']:.2f}"
        )

    print(f"\nThroughput, {32} concurrent clients, 1 message, non-streaming (client, servers and mock share the CPUs)")
    print(f"{'scenario':<{width}}{'requests':>9}{'req/s':>10}{'vs direct':>11}{'p50':>8}{'p99':>8}")
    print(rule)
    for r in throughput:
        vs = "-" if r["vs_direct"] is None else f"{r['vs_direct']:.3f}"
        print(f"{r['scenario']:<{width}}{r['requests']:>9}{r['req_per_s']:>10.0f}{vs:>11}{r['p50_ms']:>8.2f}{r['p99_ms']:>8.2f}")

    print("\nGateway process (durability=fsync, jsonl store)")
    print(rule)
    print(f"{'startup: process start -> /readyz 200':<{width}}{gw['startup_to_readyz_ms']:>10.0f} ms")
    print(f"{'RSS at ready':<{width}}{gw['rss_at_ready_mib']:>10.1f} MiB")
    print(f"{'idle RSS after ' + format(gw['conversations_served'], ',') + ' conversations':<{width}}{gw['rss_idle_mib']:>10.1f} MiB")
    fs = result.get("filesystem") or {}
    if fs:
        print(f"{'data dir filesystem: create+write file p50':<{width}}{fs['create_write_p50_ms']:>10.3f} ms")
        print(f"{'data dir filesystem: fsync file+dir p50':<{width}}{fs['fsync_file_and_dir_p50_ms']:>10.3f} ms")
    if result.get("litellm") != "measured":
        print(f"{'LiteLLM proxy column':<{width}}{result.get('litellm')}")
    return {"latency": latency, "streaming": stream, "throughput": throughput, "gateway": gw}
