"""Turn raw benchmark samples into statistics, a printed table and the JSON summary.

Overhead = p(target) - p(direct) within one group (same message list reaching the mock);
"x fwd" = that overhead divided by the bare forwarder's overhead in the same group.
"""

from __future__ import annotations

from typing import Any

# Creating a small file takes 0.02-0.09 ms on this machine's disk in its fast state and 0.14-0.96
# ms while it skips recently deleted inodes (docs/performance.md, "The filesystem's slow state").
SLOW_CREATE_MS = 0.2

LABELS = {
    "direct": "direct -> mock",
    "forwarder": "bare forwarder",
    "forwarder_aiohttp": "bare forwarder, aiohttp client",
    "litellm": "LiteLLM proxy",
    "gateway": "gateway",
    "gateway_nosync": "gateway, durability=none",
    "gateway_pg": "gateway, postgres",
    "gateway_base": "gateway (baseline checkout)",
}
_ORDER = {
    "direct": 0,
    "forwarder": 1,
    "forwarder_aiohttp": 2,
    "litellm": 3,
    "gateway": 4,
    "gateway_nosync": 5,
    "gateway_pg": 6,
    "gateway_base": 7,
}


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
    base = str(LABELS.get(row["target"], row["target"]))
    if grouped and row["target"] == "direct":
        return f"{base}, same body the gateway sent"
    if grouped and row["target"] in ("forwarder", "forwarder_aiohttp", "litellm"):
        return f"{base}, same body (full history)"
    return base


def _fmt(value: float | None, sign: bool = False) -> str:
    if value is None:
        return "-"
    return f"{value:+.2f}" if sign else f"{value:.2f}"


def _overheads(r: dict[str, Any], by_target: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """p50/p99 overhead of `r` over direct, and its p50 overhead over each forwarder's."""
    out: dict[str, float | None] = {
        "overhead_p50_ms": None,
        "overhead_p99_ms": None,
        "x_forwarder_overhead": None,
        "x_aiohttp_forwarder_overhead": None,
    }
    base = by_target.get("direct")
    if base is None or r is base:
        return out
    over50 = r["stats"]["p50"] - base["stats"]["p50"]
    out["overhead_p50_ms"] = round(over50, 3)
    out["overhead_p99_ms"] = round(r["stats"]["p99"] - base["stats"]["p99"], 3)
    for key, target in (
        ("x_forwarder_overhead", "forwarder"),
        ("x_aiohttp_forwarder_overhead", "forwarder_aiohttp"),
    ):
        floor = by_target.get(target)
        if floor is None or r is floor or r["target"].startswith("forwarder"):
            continue
        floor_over = floor["stats"]["p50"] - base["stats"]["p50"]
        if floor_over > 0:
            out[key] = round(over50 / floor_over, 2)
    return out


def _latency_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    groups: dict[str, list[dict[str, Any]]] = {}
    for raw in result["latency"]:
        groups.setdefault(raw["group"], []).append(raw)
    for group, members in groups.items():
        members.sort(key=lambda r: _ORDER.get(r["target"], 9))
        for r in members:
            r["stats"] = stats_ms(r.pop("samples"))
        by_target = {r["target"]: r for r in members}
        for r in members:
            row = {
                "group": group,
                "scenario": _label(r, group != "1 message"),
                "target": r["target"],
                "sent_messages": r.get("sent_messages"),
                "n": r["stats"]["n"],
                "p50_ms": r["stats"]["p50"],
                "p99_ms": r["stats"]["p99"],
                **_overheads(r, by_target),
            }
            if "cold_first_request_ms" in r:
                row["cold_first_request_ms"] = round(r["cold_first_request_ms"], 2)
            rows.append(row)
    return rows


def _cold_rows(result: dict[str, Any], latency: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Cold first requests per gateway, each as a ratio to the baseline checkout's (same run)
    and to the gateway's own cold first request on the smallest seeded conversations."""
    smallest = next((r for r in latency if r["target"] == "gateway" and "cold_first_request_ms" in r), None)
    rows = []
    for r in result.get("cold", []):
        stats = stats_ms(r.pop("samples"))
        rows.append(
            {"size": r["size"], "target": r["target"], **{k: stats[k] for k in ("n", "p50", "min", "max")}}
        )
    base = {r["size"]: r["p50"] for r in rows if r["target"] == "gateway_base"}
    for row in rows:
        row["x_baseline"] = round(row["p50"] / base[row["size"]], 4) if base.get(row["size"]) else None
        if smallest is not None and smallest["cold_first_request_ms"]:
            row["vs_cold_of"] = smallest["group"]
            row["x_vs_cold"] = round(row["p50"] / smallest["cold_first_request_ms"], 3)
    return rows


def _stream_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for r in result["stream"]:
        r["stats"] = stats_ms(r.pop("samples"))
        r["total_stats"] = stats_ms(r.pop("total_samples"))
    by_target = {r["target"]: r for r in result["stream"]}
    for r in sorted(result["stream"], key=lambda r: _ORDER.get(r["target"], 9)):
        suffix = ", new conversation" if r["target"] == "gateway" else ""
        rows.append(
            {
                "scenario": LABELS.get(r["target"], r["target"]) + suffix,
                "target": r["target"],
                "n": r["stats"]["n"],
                "ttfc_p50_ms": r["stats"]["p50"],
                "ttfc_p99_ms": r["stats"]["p99"],
                **_overheads(r, by_target),
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


def _scaling_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target: req/s and p99 at each client count, and the ratio of req/s to the
    aiohttp forwarder's at the same count (same run); for two workers, the ratio to one and the
    most the machine's cores allow."""
    cores = (result.get("machine") or {}).get("cpus") or 0
    cells: dict[str, dict[int, dict[str, float]]] = {}
    for r in result.get("scaling", []):
        st = stats_ms(r.pop("samples"))
        cells.setdefault(r["target"], {})[r["clients"]] = {
            "req_per_s": round(r.get("req_per_s") or r["requests"] / r["seconds"], 1),
            "round_req_per_s": r.get("round_req_per_s"),
            "cpu_ms_per_request": round(r.get("cpu_seconds", 0.0) * 1000 / max(1, r["requests"]), 3),
            "others_cpu_ms_per_request": round(
                r.get("others_cpu_seconds", 0.0) * 1000 / max(1, r["requests"]), 3
            ),
            "p50_ms": st["p50"],
            "p99_ms": st["p99"],
        }
    fwd = cells.get("forwarder_aiohttp", {})
    one = cells.get("gateway", {})
    rows = []
    for target, by_clients in cells.items():
        label = SCALING_LABELS.get(target, target)
        row: dict[str, Any] = {"scenario": label, "target": target, "clients": {}}
        for clients, cell in sorted(by_clients.items()):
            fcpu = fwd.get(clients, {}).get("cpu_ms_per_request")
            cell["x_forwarder_cpu"] = round(cell["cpu_ms_per_request"] / fcpu, 2) if fcpu else None
            base = fwd.get(clients, {}).get("req_per_s")
            cell["x_aiohttp_forwarder"] = round(cell["req_per_s"] / base, 3) if base else None
            single = {"gateway_2w": one, "forwarder_aiohttp_2w": fwd}.get(target, {}).get(clients)
            if single:
                cell["x_one_worker"] = round(cell["req_per_s"] / single["req_per_s"], 3)
                # The most a second worker can give on this machine: every core busy with the
                # workers, the mock and the load generator at their CPU per request here.
                need = cell["cpu_ms_per_request"] + cell["others_cpu_ms_per_request"]
                if need > 0 and cores:
                    cell["x_one_worker_ceiling"] = round(cores * 1000 / need / single["req_per_s"], 3)
            row["clients"][str(clients)] = cell
        rows.append(row)
    return rows


SCALING_LABELS = {
    "forwarder_aiohttp": "bare forwarder, aiohttp client",
    "gateway": "gateway, 1 worker",
    "forwarder_aiohttp_2w": "bare forwarder, aiohttp client, 2 workers",
    "floor": "floor: a durable turn's file work only",
    "gateway_2w": "gateway, 2 workers",
    "gateway_base": "gateway (baseline checkout), 1 worker",
}


def _row(label: str, width: int, *cells: tuple[object, int], tail: str = "") -> str:
    """`label` padded to `width`, then each (text, right-aligned width) cell, then `tail`."""
    return f"{label:<{width}}" + "".join(f"{str(text):>{w}}" for text, w in cells) + tail


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _tracing_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The tracing-cost rows: tracing off, then on (empty when not measured)."""
    rows = []
    for raw in result.get("tracing") or []:
        stats = stats_ms(raw.pop("samples"))
        rows.append(
            {
                "scenario": "tracing on (OTLP/HTTP, loopback)" if raw["tracing"] else "tracing off",
                "n": stats["n"],
                "p50_ms": stats["p50"],
                "p99_ms": stats["p99"],
                "cpu_ms": round(raw["cpu_seconds"] * 1000 / max(1, stats["n"]), 3),
            }
        )
    return rows if len(rows) == 2 else []


def print_report(result: dict[str, Any]) -> dict[str, Any]:
    """Print the tables; return the summary (raw samples in `result` become statistics)."""
    latency = _latency_rows(result)
    stream = _stream_rows(result)
    throughput = _throughput_rows(result)
    gw = result["gateway"]
    width = max(len(r["scenario"]) for r in [*latency, *stream, *throughput]) + 2
    rule = "-" * (width + 69)
    cold_rows = _cold_rows(result, latency)
    scaling = _scaling_rows(result)
    tracing = _tracing_rows(result)
    _print_latency(latency, width, rule)
    _print_cold(cold_rows, width, rule)
    _print_streaming(stream, width, rule)
    _print_throughput(throughput, result.get("concurrency", 32), width, rule)
    _print_scaling(scaling, width, rule)
    _print_process(result, gw, width, rule)
    _print_tracing(tracing, width, rule)
    return {
        "latency": latency,
        "cold": cold_rows,
        "tracing": tracing,
        "streaming": stream,
        "throughput": throughput,
        "scaling": scaling,
        "gateway": gw,
    }


HEADS = (("n", 6), ("p50", 8), ("p99", 8), ("ovh p50", 9), ("ovh p99", 9), ("x fwd", 7), ("x aio", 7))


def _print_latency(latency: list[dict[str, Any]], width: int, rule: str) -> None:
    """The sequential non-streaming latency table."""
    print("\nLatency, sequential non-streaming requests (ms); overhead = target - direct, same messages")
    print(_row("scenario", width, ("sent", 7), *HEADS, tail="  cold"))
    group = None
    for r in latency:
        if r["group"] != group:
            group = r["group"]
            print(rule if group == "1 message" else "")
        cold = f"  {r['cold_first_request_ms']:.1f}" if "cold_first_request_ms" in r else ""
        cells = (
            (r["sent_messages"] or "-", 7),
            (r["n"], 6),
            (f"{r['p50_ms']:.2f}", 8),
            (f"{r['p99_ms']:.2f}", 8),
            (_fmt(r["overhead_p50_ms"], True), 9),
            (_fmt(r["overhead_p99_ms"], True), 9),
            (_ratio(r["x_forwarder_overhead"]), 7),
            (_ratio(r["x_aiohttp_forwarder_overhead"]), 7),
        )
        print(_row(r["scenario"], width, *cells, tail=cold))
    print(
        "sent = messages the mock received (median); ovh = target - direct; x fwd / x aio = that p50"
        " overhead / the bare httpx / aiohttp forwarder's;\ncold = median latency of the first request"
        " on a seeded conversation (the gateway loads it from disk)"
    )


def _print_cold(cold_rows: list[dict[str, Any]], width: int, rule: str) -> None:
    """The cold first request on stored conversations (when measured)."""
    if cold_rows:
        print("\nCold first request on a stored conversation not loaded yet (ms)")
        print(
            _row("scenario", width, ("msgs", 7), ("n", 6), ("p50", 8), ("min", 8), ("max", 8), ("x base", 8))
        )
        print(rule)
        for r in cold_rows:
            cells = (
                (format(r["size"], ","), 7),
                (r["n"], 6),
                (f"{r['p50']:.2f}", 8),
                (f"{r['min']:.2f}", 8),
                (f"{r['max']:.2f}", 8),
                (_ratio(r["x_baseline"]), 8),
            )
            vs = f"  {r['x_vs_cold']:.2f}x the cold {r['vs_cold_of']}" if r.get("x_vs_cold") else ""
            print(_row(str(LABELS.get(r["target"], r["target"])), width, *cells, tail=vs))
        print("x base = p50 / the baseline checkout's p50 (--baseline), same run")


def _print_streaming(stream: list[dict[str, Any]], width: int, rule: str) -> None:
    """The time-to-first-chunk table."""
    print("\nStreaming, time to first chunk (ms), 1 message")
    print(_row("scenario", width, ("", 7), *HEADS, tail="  whole stream p50"))
    print(rule)
    for r in stream:
        cells = (
            ("", 7),
            (r["n"], 6),
            (f"{r['ttfc_p50_ms']:.2f}", 8),
            (f"{r['ttfc_p99_ms']:.2f}", 8),
            (_fmt(r["overhead_p50_ms"], True), 9),
            (_fmt(r["overhead_p99_ms"], True), 9),
            (_ratio(r["x_forwarder_overhead"]), 7),
            (_ratio(r["x_aiohttp_forwarder_overhead"]), 7),
        )
        print(_row(r["scenario"], width, *cells, tail=f"  {r['full_stream_p50_ms']:.2f}"))


def _print_throughput(throughput: list[dict[str, Any]], clients: int, width: int, rule: str) -> None:
    """The throughput table at a fixed number of concurrent clients."""
    print(
        f"\nThroughput, {clients} concurrent clients, 1 message, non-streaming (all processes share the CPUs)"
    )
    print(_row("scenario", width, ("requests", 9), ("req/s", 10), ("vs direct", 11), ("p50", 8), ("p99", 8)))
    print(rule)
    for r in throughput:
        vs = "-" if r["vs_direct"] is None else f"{r['vs_direct']:.3f}"
        tp_cells = (
            (r["requests"], 9),
            (f"{r['req_per_s']:.0f}", 10),
            (vs, 11),
            (f"{r['p50_ms']:.2f}", 8),
            (f"{r['p99_ms']:.2f}", 8),
        )
        print(_row(r["scenario"], width, *tp_cells))


def _print_scaling(scaling: list[dict[str, Any]], width: int, rule: str) -> None:
    """Throughput and CPU per request by number of concurrent clients (when measured)."""
    if scaling:
        counts = sorted({c for r in scaling for c in r["clients"]}, key=int)
        print(
            "\nThroughput by concurrent clients, 1 message, non-streaming, new conversation per request:"
            " req/s (x aiohttp forwarder) p99 ms\n(targets in interleaved rounds; req/s = the median"
            " round's steady rate, between the 10th and 90th percentile of its completion times)"
        )
        print(_row("scenario", width, *((f"{c} clients", 26) for c in counts)))
        print(rule)
        for r in scaling:
            texts = []
            for c in counts:
                cell = r["clients"].get(c)
                if cell is None:
                    texts.append(("-", 26))
                    continue
                ratio = cell["x_aiohttp_forwarder"]
                shown = f"{cell['req_per_s']:.0f}"
                if ratio:
                    shown += f" (x{ratio:.2f}) {cell['p99_ms']:.0f}"
                texts.append((shown, 26))
            print(_row(r["scenario"], width, *texts))
        for two in (r for r in scaling if "x_one_worker" in next(iter(r["clients"].values()), {})):
            gains = ", ".join(
                f"{c}: x{cell['x_one_worker']:.2f}"
                + (
                    f" (cores allow x{cell['x_one_worker_ceiling']:.2f})"
                    if "x_one_worker_ceiling" in cell
                    else ""
                )
                for c, cell in two["clients"].items()
                if "x_one_worker" in cell
            )
            print(f"{two['scenario']} / 1 worker req/s: {gains}")
        print(
            _row("CPU ms per request (x forwarder's)", width),
        )
        for r in scaling:
            texts = []
            for c in counts:
                cell = r["clients"].get(c)
                cpu = "-" if cell is None else f"{cell['cpu_ms_per_request']:.2f}"
                if cell is not None and cell.get("x_forwarder_cpu"):
                    cpu += f" (x{cell['x_forwarder_cpu']:.1f})"
                texts.append((cpu, 26))
            print(_row(r["scenario"], width, *texts))
        print(_row("Mock upstream + load generator CPU ms per request, same rounds", width))
        for r in scaling:
            texts = [
                (
                    "-"
                    if (cell := r["clients"].get(c)) is None
                    else f"{cell['others_cpu_ms_per_request']:.2f}",
                    26,
                )
                for c in counts
            ]
            print(_row(r["scenario"], width, *texts))


def _print_process(result: dict[str, Any], gw: dict[str, Any], width: int, rule: str) -> None:
    """The gateway process's facts: startup, memory, the data dir's filesystem."""
    fs = result.get("filesystem") or {}
    served = format(gw["conversations_served"], ",")
    facts = [
        ("startup: process start -> /readyz 200", f"{gw['startup_to_readyz_ms']:.0f} ms"),
        ("first chat request after /readyz", f"{gw['first_request_after_ready_ms']:.0f} ms"),
        ("RSS at ready", f"{gw['rss_at_ready_mib']:.1f} MiB"),
        ("RSS after the first request", f"{gw['rss_after_first_request_mib']:.1f} MiB"),
        (f"idle RSS after {served} conversations", f"{gw['rss_idle_mib']:.1f} MiB"),
    ]
    if fs:
        facts.append(("data dir filesystem: create+write file p50", f"{fs['create_write_p50_ms']:.3f} ms"))
        if fs["create_write_p50_ms"] > SLOW_CREATE_MS:
            facts.append(("  slow state (files deleted < 1-6 min ago)", "see docs/performance.md"))
        facts.append(("data dir filesystem: fsync file+dir p50", f"{fs['fsync_file_and_dir_p50_ms']:.3f} ms"))
        if "append_fdatasync_p50_ms" in fs:
            floor = fs["append_fdatasync_p50_ms"]
            facts.append(("raw disk floor: one append + fdatasync p50", f"{floor:.3f} ms"))
            facts.append(("  = one writer, one sync per write", f"{1000 / floor:.0f} /s" if floor else "-"))
    if result.get("litellm") != "measured":
        facts.append(("LiteLLM proxy column", str(result.get("litellm"))))
    if result.get("postgres"):
        facts.append(("postgres row", str(result.get("postgres"))))
    print("\nGateway process (durability=fsync, jsonl store)")
    print(rule)
    for label, value in facts:
        print(_row(label, width, (value, 14)))
    log = gw.get("log") or {}
    if log.get("other_lines"):
        print(f"warning: the gateway logged {log['other_lines']} lines besides its access log, e.g.:")
        for line in log["examples"][:3]:
            print(f"  {line[:200]}")


def _print_tracing(tracing: list[dict[str, Any]], width: int, rule: str) -> None:
    """Tracing's cost beside the same gateway untraced (when measured)."""
    if tracing:
        print("\nTracing's cost: the same sequential turns (new conversation, 1 message), same run")
        print(_row("gateway", width, ("n", 6), ("p50 ms", 9), ("p99 ms", 9), ("CPU ms/turn", 12)))
        print(rule)
        for r in tracing:
            cells = (
                (r["n"], 6),
                (f"{r['p50_ms']:.3f}", 9),
                (f"{r['p99_ms']:.3f}", 9),
                (f"{r['cpu_ms']:.3f}", 12),
            )
            print(_row(r["scenario"], width, *cells))
        off, on = tracing
        p50 = f"p50 {on['p50_ms'] - off['p50_ms']:+.3f} ms ({on['p50_ms'] / off['p50_ms']:.2f}x)"
        cpu = f"CPU {on['cpu_ms'] - off['cpu_ms']:+.3f} ms per turn ({on['cpu_ms'] / off['cpu_ms']:.2f}x)"
        print(f"tracing on - off: {p50}, {cpu}")
