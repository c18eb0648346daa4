"""Rewrite the measured parts of docs/benchmarks.md, and its plots, from bench/results/*.json.

The document's prose is written by hand; every number in it sits between
`<!-- generated:NAME -->` and `<!-- /generated:NAME -->` and is replaced here from the JSON
that a run of the benchmarks wrote, so no figure is typed in by hand. Plots are PNG files
in docs/img/, drawn with rollwire.demo.plot (matplotlib, the `plot` extra); without it the
existing PNGs are left as they are and a note says so.
Run: .venv/bin/python bench/report.py
"""

from __future__ import annotations

import json
import os
import re
import sys

from common import RESULTS, ROOT

from rollwire.demo.plot import MISSING, Series, line_chart

DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"
COLORS = [(31, 119, 180), (214, 39, 40), (44, 160, 44), (148, 103, 189), (255, 127, 14)]

GB_PER_GIB = 2**30 / 1e9
"""Decimal gigabytes in a gibibyte: the issue's per-core bar is in GB/s, the benches measure GiB."""


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def s(spread: dict, scale: float = 1.0, digits: int = 2, unit: str = "") -> str:
    """median (min–max) of a spread."""
    f = f"{{:.{digits}f}}"
    return (
        f"{f.format(spread['median'] * scale)}{unit} "
        f"({f.format(spread['min'] * scale)}–{f.format(spread['max'] * scale)})"
    )


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def provenance(data: dict) -> str:
    m = data["machine"]
    return (
        f"Command: `{data['command']}` — run {m['date']} on {m['cpus']} CPU cores, {m['platform']}, "
        f"Python {m['python']}."
    )


def chart(name: str, series: list[Series], title: str, x_label: str) -> str:
    IMG.mkdir(parents=True, exist_ok=True)
    if line_chart(IMG / f"{name}.png", series, title, x_label) is None:
        print(f"docs/img/{name}.png left as it was: {MISSING}", file=sys.stderr)
    return f"![{title}](img/{name}.png)"


# -- sections ---------------------------------------------------------------------------------


def weight_push(d: dict) -> str:
    models = d["models"]
    sizes = table(
        [
            "shape",
            f"LoRA r={d['rank']} payload (bf16)",
            "full weights (bf16)",
            "full / LoRA bytes",
            "full-size payload pushed",
        ],
        [
            [
                label,
                f"{m['lora_bytes'] / 1e6:.1f} MB",
                f"{m['full_bytes'] / 1e9:.2f} GB",
                f"{m['full_bytes'] / m['lora_bytes']:.0f}x",
                f"r={m['full_payload']['rank']}, {m['full_payload']['bytes'] / 1e9:.3f} GB"
                if "full_payload" in m
                else "—",
            ]
            for label, m in models.items()
        ],
    )
    rows = []
    for label, m in models.items():
        for count in map(str, d["replicas"]):
            row, t = m[count], d["table"][f"{label} x{count}"]
            full = (
                s(row["full"]["served_s"]) + " s"
                if "full" in row
                else (f"{t['full_s']:.1f} s *(extrapolated)*" if t["full_s"] else "—")
            )
            rows.append(
                [
                    label,
                    count,
                    s(row["lora"]["served_s"], 1e3, 0) + " ms",
                    s(m["disk_s"], 1e3, 0) + " ms",
                    s(row["tcp_lora_s"], 1e3, 1) + " ms",
                    full,
                    f"{t['full_over_lora']:.0f}x" if t["full_over_lora"] else "—",
                    f"{t['lora_over_tcp']:.0f}x",
                    f"{t['lora_over_disk']:.1f}x",
                ]
            )
    times = table(
        [
            "shape",
            "replicas",
            "LoRA push, until all serve",
            "disk: save + load",
            "TCP copy (LoRA bytes)",
            "full weights push",
            "full / LoRA",
            "LoRA / TCP",
            "LoRA / disk",
        ],
        rows,
    )
    direct = []
    for label, m in models.items():
        one = m["1"]
        if "direct-lora" in one:
            direct.append(
                [
                    label,
                    "LoRA",
                    s(one["direct-lora"]["served_s"], 1e3, 0) + " ms",
                    s(one["lora"]["served_s"], 1e3, 0) + " ms",
                    f"{one['lora']['served_s']['median'] / one['direct-lora']['served_s']['median']:.1f}x",
                ]
            )
        if "direct-full" in one:
            direct.append(
                [
                    label,
                    "full",
                    s(one["direct-full"]["served_s"]) + " s",
                    s(one["full"]["served_s"]) + " s",
                    f"{one['full']['served_s']['median'] / one['direct-full']['served_s']['median']:.1f}x",
                ]
            )
    tcp_full = [
        [label, c, s(m[c]["tcp_full_s"], 1, 2) + " s"]
        for label, m in models.items()
        for c in map(str, d["replicas"])
        if "tcp_full_s" in m[c]
    ]
    plot = chart(
        "weight_push",
        [
            Series(
                f"{label} LoRA",
                d["replicas"],
                [m[str(c)]["lora"]["served_s"]["median"] for c in d["replicas"]],
                COLORS[i],
                markers=True,
            )
            for i, (label, m) in enumerate(models.items())
        ],
        "LoRA push until every replica serves it (s)",
        "replicas",
    )
    t = d["table"].values()
    fulls = [(k, r["full_s"], r["full_kind"]) for k, r in d["table"].items() if r["full_s"]]
    key = (
        (
            f"LoRA push until every replica serves: {min(r['lora_s'] for r in t):.2f}–{max(r['lora_s'] for r in t):.2f} s "
            f"over every shape and replica count; the full weights on the same path: "
            + "; ".join(f"{k} {v:.1f} s ({kind})" for k, v, kind in fulls if k.endswith(("x1", "x4")))
            + f". Full / LoRA time: {min(r['full_over_lora'] for r in t if r['full_over_lora']):.0f}x–"
            f"{max(r['full_over_lora'] for r in t if r['full_over_lora']):.0f}x; LoRA push / raw TCP copy: "
            f"{min(r['lora_over_tcp'] for r in t):.0f}x–{max(r['lora_over_tcp'] for r in t):.0f}x."
        )
        if fulls
        else ""
    )
    return "\n\n".join(
        [
            provenance(d) + f" LoRA pushes: median (min–max) of {d['repeats']} repeats after one untimed push; "
            f"full-size pushes: {d['full_repeats']} repeats.",
            sizes,
            times,
            "The same push straight to one replica, without the proxy (its store-and-forward through the spool):",
            table(["shape", "payload", "direct to the replica", "through the proxy", "proxy / direct"], direct),
            "Raw loopback TCP copy of the full-size payload to N receivers at once:",
            table(["shape", "receivers", "TCP copy"], tcp_full),
            key,
            plot,
        ]
    )


def proxy_overhead(d: dict) -> str:
    w = d["workload"]
    rows = []
    for load, r in d["loads"].items():
        for mode in ("direct", "proxy"):
            m = r[mode]
            rows.append(
                [
                    f"{load} ({r['workers']} in flight)",
                    mode,
                    s(m["tokens_per_s"], 1, 0),
                    s(m["p50_s"], 1e3, 1),
                    s(m["p99_s"], 1e3, 1),
                    s(m["ttft_p50_s"], 1e3, 1),
                ]
            )
    added = table(
        [
            "load",
            "added p50 latency",
            "added p99 latency",
            "added time to first token (p50)",
            "throughput proxy / direct",
        ],
        [
            [
                load,
                s(r["added_p50_s"], 1e3, 1, " ms"),
                s(r["added_p99_s"], 1e3, 1, " ms"),
                s(r["added_ttft_p50_s"], 1e3, 1, " ms"),
                s(r["throughput_ratio"], 1, 3),
            ]
            for load, r in d["loads"].items()
        ],
    )
    return "\n\n".join(
        [
            provenance(d) + f" Median (min–max) of {next(iter(d['loads'].values()))['direct']['p50_s']['n']} repeats; "
            f"groups of n={w['n']}, {w['new_tokens']} new tokens at {w['tokens_per_s_per_sample']:.0f} tokens/s per "
            f"sample (a group takes {w['ideal_request_s'] * 1e3:.0f} ms with no overhead at all).",
            table(
                ["load", "path", "tokens/s", "p50 latency (ms)", "p99 latency (ms)", "time to first token p50 (ms)"],
                rows,
            ),
            added,
        ]
    )


def scaling(d: dict) -> str:
    w = d["workload"]

    def row(first: str, r: dict) -> list[str]:
        return [
            first,
            f"{r['ideal_tokens_per_s']:.0f}",
            s(r["tokens_per_s"], 1, 0),
            s(r["efficiency"], 100, 0, " %"),
            s(r["p50_s"], 1e3, 0),
            s(r["proxy_cpu_util"], 1, 2),
            f"{r['proxy_cpu_s_per_1k_tokens']['median'] * 1e3:.1f}",
            f"{r['replicas_cpu_s_per_1k_tokens']['median'] * 1e3:.1f}",
            f"{r['client_cpu_s_per_1k_tokens']['median'] * 1e3:.1f}",
        ]

    header = [
        "",
        "ideal tokens/s",
        "tokens/s",
        "of ideal",
        "p50 latency (ms)",
        "proxy CPU (cores)",
        "proxy CPU ms / 1k tokens",
        "replicas CPU ms / 1k tokens",
        "load generator CPU ms / 1k tokens",
    ]
    by_n = table(["replicas (8 groups each)", *header[1:]], [row(n, r) for n, r in d["replicas"].items()])
    sat = d["saturation"]
    by_load = table(["groups in flight (4 replicas)", *header[1:]], [row(k, r) for k, r in sat.items()])
    best = max(sat.values(), key=lambda r: r["tokens_per_s"]["median"])
    per_k = min(r["proxy_cpu_s_per_1k_tokens"]["median"] for r in sat.values())
    cpu = {k: best[f"{k}_cpu_s_per_1k_tokens"]["median"] for k in ("proxy", "replicas", "client")}
    used = sum(cpu.values()) * best["tokens_per_s"]["median"] / 1e3
    plot = chart(
        "scaling",
        [
            Series(
                "achieved",
                [int(k) for k in sat],
                [r["tokens_per_s"]["median"] / 1e3 for r in sat.values()],
                COLORS[0],
                True,
            ),
            Series("ideal", [int(k) for k in sat], [r["ideal_tokens_per_s"] / 1e3 for r in sat.values()], COLORS[1]),
        ],
        "4 replicas: thousands of tokens/s",
        "groups in flight",
    )
    return "\n\n".join(
        [
            provenance(d) + f" Median (min–max) of {best['tokens_per_s']['n']} measurements of "
            f"{w['seconds_per_measurement']:.0f} s each; groups of n={w['n']}, {w['new_tokens']} tokens at "
            f"{w['tokens_per_s_per_sample']:.0f} tokens/s per sample.",
            by_n,
            by_load,
            f"Highest throughput here: {best['tokens_per_s']['median']:.0f} tokens/s with {best['workers']} groups in "
            f"flight, the proxy using {best['proxy_cpu_util']['median']:.2f} of a core. At its lowest measured cost "
            f"({per_k * 1e3:.1f} ms of CPU per 1,000 tokens), one proxy core relays at most about "
            f"{1 / per_k:.0f}k tokens/s (one token for each of a group's n={w['n']} samples: "
            f"{1 / per_k / w['n'] * 1e3:.0f} group steps per second). "
            f"At that highest throughput the processes used {used:.2f} cores in all (proxy "
            f"{100 * cpu['proxy'] / sum(cpu.values()):.0f} %, replicas {100 * cpu['replicas'] / sum(cpu.values()):.0f} %, "
            f"load generator {100 * cpu['client'] / sum(cpu.values()):.0f} %).",
            plot,
        ]
    )


def async_vs_sync(d: dict) -> str:
    w = d["workload"]
    rows, phases = [], []
    for mode, rs in d["runs"].items():
        p = d["per_mode"][mode]
        counts = {}
        for r in rs:
            for k, v in r["staleness"].items():
                counts[k] = counts.get(k, 0) + v
        total = sum(counts.values())
        dist = ", ".join(f"{k}: {100 * v / total:.0f} %" for k, v in sorted(counts.items()))
        stale = sum(r["dropped"].get("stale", 0) for r in rs)
        refused = sum(r["eval_requests_failed"] for r in rs)
        scored_versions = sum(r["scored_versions"] for r in rs)
        phase = {k: sorted(r["step_phase_s"][k] for r in rs)[len(rs) // 2] * 1e3 for k in ("wait", "train", "push")}
        phases.append([mode, *(f"{phase[k]:.0f}" for k in ("wait", "train", "push"))])
        rows.append(
            [
                f"{mode} (max_staleness {w['max_staleness'][mode]})",
                s(p["groups_per_s"], 1, 1),
                s(p["scored_groups_per_s"], 1, 1),
                s(p["seconds_to_target"], 1, 1, " s") if p["seconds_to_target"] else "not reached",
                s(p["accuracy_after"], 1, 2),
                dist,
                str(stale),
                f"{scored_versions} ({refused})",
            ]
        )
    ratios = table(["ratio", "median (min–max)"], [[k, s(v, 1, 2)] for k, v in d["ratios"].items()])
    plot = chart(
        "async_vs_sync",
        [
            Series(
                mode,
                [c["seconds"] for c in rs[0]["curve"]],
                [c["accuracy"] for c in rs[0]["curve"]],
                COLORS[i],
                markers=True,
            )
            for i, (mode, rs) in enumerate(d["runs"].items())
        ],
        "Held-out accuracy",
        "seconds of training",
    )
    before = [r["accuracy_before"] for rs in d["runs"].values() for r in rs]
    return "\n\n".join(
        [
            provenance(d) + f" {len(next(iter(d['runs'].values())))} runs per mode, alternating, of "
            f"{w['budget_s']:.0f} s of training each; seed {w['seed']}; {w['replicas']} replicas; held-out accuracy on "
            f"{w['eval_size']} prompts, of the newest served version at most every {w['eval_interval_s']} s "
            f"(starting policy: {min(before):.2f}); "
            f"target {w['target_accuracy']}.",
            table(
                [
                    "mode",
                    "trained groups/s",
                    "scored groups/s",
                    "time to target",
                    "final accuracy",
                    "staleness of trained groups",
                    "dropped as stale",
                    "versions scored (held-out requests refused)",
                ],
                rows,
            ),
            ratios,
            "Where a step's time went (median run, ms per step): waiting for a full batch of rollouts, the "
            "optimiser step, publishing the new adapter (awaited only in sync mode).",
            table(["mode", "wait for batch", "train", "push"], phases),
            plot,
        ]
    )


def generator_efficiency(d: dict) -> str:
    w = d["workload"]
    return "\n\n".join(
        [
            provenance(d) + f" Median (min–max) of {next(iter(d['tokens_per_s'].values()))['n']} repeats; "
            f"{w['groups']} groups of n={w['n']}, {w['new_tokens']} new tokens each, tiny model.",
            table(["mode", "tokens/s"], [[k, s(v, 1, 0)] for k, v in d["tokens_per_s"].items()]),
            table(["ratio", "median (min–max)"], [[k, s(v, 1, 2)] for k, v in d["ratios"].items()]),
        ]
    )


def spreads(node, path: str = ""):
    """Every min/median/max dict in a result, with where it sits."""
    if isinstance(node, dict):
        if {"min", "median", "max", "n"} <= set(node):
            yield path, node
            return
        for key, value in node.items():
            yield from spreads(value, f"{path}/{key}" if path else key)


def noise(results: dict[str, dict]) -> str:
    rows = []
    for name, data in results.items():
        rel = [
            ((sp["max"] - sp["min"]) / abs(sp["median"]), where, sp["n"])
            for where, sp in spreads(data)
            if sp["n"] >= 2 and sp["median"] and not any(k in where for k in ("ratio", "added", "efficiency"))
        ]
        if not rel:
            continue
        rel.sort()
        worst = rel[-1]
        rows.append(
            [
                name,
                data["machine"]["date"],
                str(len(rel)),
                f"{100 * rel[len(rel) // 2][0]:.0f} %",
                f"{100 * worst[0]:.0f} % ({worst[1]})",
            ]
        )
    return table(["benchmark", "run", "figures with repeats", "median (max − min) / median", "widest"], rows)


def http_overhead(d: dict) -> str:
    w = d["workload"]
    rows, added = [], []
    for load, r in d["loads"].items():
        for door in ("grpc", "http"):
            m = r[door]
            rows.append(
                [
                    f"{load} ({r['workers']} in flight, n={r['n']})",
                    door,
                    s(m["tokens_per_s"], 1, 0),
                    s(m["p50_s"], 1e3, 1),
                    s(m["p99_s"], 1e3, 1),
                    s(m["ttft_p50_s"], 1e3, 1),
                    s(m["proxy_cpu_ms_per_sample"], 1, 2) if "proxy_cpu_ms_per_sample" in m else "",
                ]
            )
        added.append(
            [
                load,
                s(r["added_p50_s"], 1e3, 1, " ms"),
                s(r["added_p99_s"], 1e3, 1, " ms"),
                s(r["added_ttft_p50_s"], 1e3, 1, " ms"),
                s(r["throughput_ratio"], 1, 3),
            ]
        )
    first = next(iter(d["loads"].values()))
    return "\n\n".join(
        [
            provenance(d) + f" Median (min–max) of {first['grpc']['p50_s']['n']} repeats; {w['new_tokens']} new tokens "
            f"at {w['tokens_per_s_per_sample']:.0f} tokens/s per sample (a group takes {w['ideal_request_s'] * 1e3:.0f} ms "
            "with no overhead at all).",
            table(
                [
                    "load",
                    "door",
                    "tokens/s",
                    "p50 latency (ms)",
                    "p99 latency (ms)",
                    "time to first token p50 (ms)",
                    "proxy CPU per sample (ms)",
                ],
                rows,
            ),
            table(
                ["load", "added p50", "added p99", "added time to first token (p50)", "throughput http / grpc"], added
            ),
        ]
    )


def follow_vs_pinned(d: dict) -> str:
    st = d["storm"]
    rows = []
    for mode, m in d["per_mode"].items():
        rows.append(
            [
                mode,
                s(m["token_staleness_mean"], 1, 3),
                s(m["token_staleness_max"], 1, 0),
                s(m["groups_per_s"], 1, 2),
                s(m["seconds_to_target"], 1, 1, " s") if m["seconds_to_target"] else "not reached",
                s(m["accuracy_after"], 100, 1, "%"),
            ]
        )
    runs = len(next(iter(d["runs"].values())))
    return "\n\n".join(
        [
            provenance(d) + f" Learning: median (min–max) of {runs} alternating runs per mode, "
            f"{d['workload']['budget_s']:.0f} s of training each, max_staleness {d['workload']['max_staleness']}.",
            table(
                [
                    "mode",
                    "token staleness (mean versions)",
                    "max",
                    "trained groups/s",
                    "time to 90% held-out",
                    "final accuracy",
                ],
                rows,
            ),
            f"Push storm ({st['tokens_per_s']['quiet']['n']} alternating repeats; {d['workload']['storm'][0]} following "
            f"groups, {d['workload']['storm'][1]} versions pushed while they run): tokens/s with pushes over without "
            f"{s(st['storm_over_quiet'], 1, 2)}; samples restarted, aborted or cut short: {st['broken_samples']}.",
        ]
    )


def vllm_vs_transformers(d: dict) -> str:
    w, e, ratio = d["workload"], d["per_engine"], d["vllm_over_transformers"]
    figures = [
        ("push_s", "adapter version pushed until served (ms)", 1e3, 1),
        ("single_ttft_s", "one group alone: time to first token (ms)", 1e3, 1),
        ("single_latency_s", "one group alone: latency (ms)", 1e3, 0),
        ("batch_tokens_per_s", f"{w['groups']} groups at once: tokens/s", 1, 0),
        ("batch_ttft_p50_s", f"{w['groups']} groups at once: time to first token p50 (ms)", 1e3, 0),
        ("batch_lora_tokens_per_s", f"{w['groups']} groups on the adapter: tokens/s", 1, 0),
        ("batch_lora_ttft_p50_s", f"{w['groups']} groups on the adapter: time to first token p50 (ms)", 1e3, 0),
    ]
    rows = [
        [label, s(e["transformers"][k], scale, digits), s(e["vllm"][k], scale, digits), s(ratio[k], 1, 2)]
        for k, label, scale, digits in figures
    ]
    start = d["startup_s"]
    return "\n\n".join(
        [
            provenance(d) + f" Median (min–max) of {w['repeats']} alternating repeats; groups of n={w['n']}, "
            f"{w['new_tokens']} new tokens each (ignore_eos, temperature 1); adapter r={w['lora_r']} on every "
            f"linear layer. Until the replica serves: transformers {start['transformers']:.0f} s, "
            f"vllm {start['vllm']:.0f} s (vLLM's start-up and first batch).",
            table(["figure", "transformers", "vllm", "vllm / transformers (same repeat)"], rows),
        ]
    )


def trl_vllm_vs_rollwire(d: dict) -> str:
    w, a, over = d["workload"], d["per_arm"], d.get("over_vllm", {})
    figures = [
        ("startup_s", "server side serving after (s)", 1, 0),
        ("steps", "optimiser steps in the budget", 1, 0),
        ("steps_per_s", "steps/s", 1, 2),
        ("weight_sync_s", "weight sync per step (ms)", 1e3, 0),
        ("generated_tokens_per_s", "generated tokens/s (TRL's rollout/generated_tok_s)", 1, 0),
        ("dropped_stale_share", "samples dropped as stale (%)", 100, 1),
        ("reward_last10", "mean reward, last 10 steps", 1, 2),
        ("accuracy_after", "held-out accuracy after (greedy)", 100, 1),
    ]
    arms = list(a)
    first = a[arms[0]]
    rows = []
    for k, label, scale, digits in figures:
        if k not in first:
            continue
        row = [label] + [s(a[arm][k], scale, digits) for arm in arms]
        row += [s(over[arm][k], 1, 2) if k in over.get(arm, {}) else "" for arm in over]
        rows.append(row)
    names = d.get("arms", {arm: arm for arm in arms})
    header = ["figure"] + [names[arm] for arm in arms] + [f"{arm} / vllm" for arm in over]
    return "\n\n".join(
        [
            provenance(d) + f" Median (min–max) of {w['repeats']} alternating runs per arm, {w['budget_s']:.0f} s "
            f"of TRL training each, TRL's max_staleness {w.get('max_staleness', 1)}; held-out accuracy before: "
            f"{100 * w['accuracy_before']:.1f}%.",
            table(header, rows),
        ]
    )


def trl_shapes(d: dict) -> str:
    """One row per cell of bench/trl_shapes.py: each figure for vLLM, rollwire, and their ratio per repeat."""
    w = d["workload"]
    figures = [
        ("steps_per_s", "steps/s", 1, 2),
        ("weight_sync_s", "sync (ms)", 1e3, 0),
        ("rollout_wait_s", "rollout wait/step (ms)", 1e3, 0),
        ("dropped_stale_share", "stale dropped (%)", 100, 0),
        ("accuracy_after", "accuracy after (%)", 100, 1),
    ]
    header = ["cell", "measured"]
    for _, label, _, _ in figures:
        header += [f"{label}: vLLM", "rollwire", "ratio"]
    rows = []
    for cell, c in d["cells"].items():
        row = [f"`{cell}`", c.get("measured", d["machine"]["date"])]
        for k, _, scale, digits in figures:
            for arm in ("vllm", "rollwire"):
                spread = c["per_arm"][arm].get(k)
                row.append(s(spread, scale, digits) if spread else "")
            ratio = c["rollwire_over_vllm"].get(k)
            row.append(s(ratio, 1, 2) if ratio else "")
        rows.append(row)
    return "\n\n".join(
        [
            provenance(d) + " Cells measured by earlier runs keep their own date (their commands are in "
            f"bench/results/trl_shapes.json). Median (min–max) of {w['repeats']} alternating runs per arm and cell, "
            f"{w['budget_s']:.0f} s of TRL training each, TRL's max_staleness {w['max_staleness']}; held-out "
            f"accuracy before: {100 * w['accuracy_before']:.1f}%. Ratios are rollwire / vLLM per repeat.",
            table(header, rows),
        ]
    )


def signed_push(d: dict) -> str:
    arms, crypto = d["arms"], d["crypto"]
    rows = [
        [arm, s(arms[arm]["served_s"], 1e3, 0, " ms"), s(arms[arm]["reply_s"], 1e3, 0, " ms")]
        for arm in ("unsigned", "signed")
    ]
    n = arms["signed"]["served_s"]["n"]
    return "\n\n".join(
        [
            provenance(d) + f" {d['payload_bytes'] / 1e6:.1f} MB through a proxy to {d['replicas']} scripted replicas, "
            f"median (min–max) of {n} pushes per arm, the arms alternating.",
            table(["arm", "push, until every replica serves", "the push call's reply"], rows),
            f"Signed over unsigned, until every replica serves: **{d['signed_over_unsigned']:.2f}x**. One Ed25519 "
            f"sign of a manifest: {crypto['sign_us']:.0f} µs; one verify (`TrustedKeys.check`): "
            f"{crypto['verify_us']:.0f} µs, once per receiver.",
        ]
    )


def proof_cost(d: dict) -> str:
    names = {"tiny": "tiny model, transformers", "1.5b": "Qwen2.5-1.5B-shaped r=16, scripted"}
    rows = []
    for arm, r in d["arms"].items():
        rows.append(
            [
                names.get(arm, arm),
                f"{r['payload_bytes'] / 1e6:.2f} MB",
                s(r["plain"], 1e3, 1, " ms"),
                s(r["probed"], 1e3, 1, " ms"),
                f"{r['share_of_push'] * 100:+.1f}%",
                f"{r['replica_proof']['mean_s'] * 1e3:.2f} ms",
            ]
        )
    sequences, prompt, continuation = d["probe"]
    n = next(iter(d["arms"].values()))["plain"]["n"]
    publisher = d["arms"].get("tiny", {}).get("publisher_probe_s")
    extra = (
        f" The publisher's own numbers for the probe (tiny model, PEFT): {publisher * 1e3:.1f} ms." if publisher else ""
    )
    return "\n\n".join(
        [
            provenance(d) + f" A proxy in front of {d['replicas']} replicas, every version signed; a probe of "
            f"{sequences} sequences of {prompt} + {continuation} tokens; median (min–max) of {n} pushes per arm, "
            "alternating with and without the probe.",
            table(
                [
                    "stack",
                    "payload",
                    "push (no probe)",
                    "push with probe",
                    "proof's share of the push",
                    "one replica's proof",
                ],
                rows,
            ),
            "A push is timed until the proxy's reply (the version committed on every replica; each replica's proof is "
            "part of its commit)." + extra,
        ]
    )


def prefix_cache(d: dict) -> str:
    rows = []
    for name, m in d["models"].items():
        shape = m["shape"]
        for t in ("1", "4", str(d["turns"])):
            on, off = m["turns"]["reuse"][t], m["turns"]["no_reuse"][t]
            ratio = on["median"] / off["median"]
            rows.append([f"{name} ({shape['prompt']}/{shape['env']}/{shape['reply']})", t, s(on, 1e3, 1, " ms"), s(off, 1e3, 1, " ms"), f"{ratio:.2f}"])  # fmt: skip
        rows.append([f"{name}: prompt tokens reused", "all", f"{m['hit_rate']:.1%}", "0%", ""])
    runs = next(iter(d["models"].values()))["turns"]["reuse"]["1"]["n"]
    return "\n\n".join(
        [
            provenance(d)
            + f" Median (min–max) of {runs} alternating episodes per arm, after one warm-up episode each.",
            table(["model (prompt/env/reply tokens)", "turn", "with reuse", "without", "ratio"], rows),
        ]
    )


def sessions(d: dict) -> str:
    load, last = d["load"], str(d["turns"])
    routes = load["routes"]
    moved = ", ".join(f"{k} {v:.0f}" for k, v in routes.items() if k not in ("first", "sticky") and v)
    lines = [
        provenance(d),
        f"Sticky routing under load: {load['sessions']} concurrent {load['turns']}-turn sessions over 2 replicas "
        f"(tiny model) in {load['seconds']:.1f} s: sticky hit rate {load['sticky_hit_rate']:.1%} "
        f"({routes['sticky']:.0f} of {sum(v for k, v in routes.items() if k != 'first'):.0f} turns after the first; "
        f"moved: {moved or 'none'}); prompt tokens reused by the replicas' prefix caches "
        f"{load['prompt_tokens_reused'] / (load['prompt_tokens_reused'] + load['prompt_tokens_computed']):.1%}; "
        f"turn latency {s(load['turn_latency_s'], 1e3, 1, ' ms')}.",
    ]
    rows = []
    for name, m in d["models"].items():
        shape = m["shape"]
        for t in ("1", "4", last):
            on, off = m["turns"]["reuse"][t], m["turns"]["no_reuse"][t]
            label = f"{name} ({shape['prompt']}/{shape['env']}/{shape['reply']})"
            rows.append([label, t, s(on, 1e3, 1, " ms"), s(off, 1e3, 1, " ms"), f"{on['median'] / off['median']:.2f}"])
    runs = next(iter(d["models"].values()))["turns"]["reuse"]["1"]["n"]
    lines.append(f"Turn latency through the proxy, median (min–max) of {runs} alternating sessions per arm:")
    lines.append(table(["model (prompt/env/reply tokens)", "turn", "with reuse", "without", "ratio"], rows))
    return "\n\n".join(lines)


def startup(d: dict) -> str:
    before, after = d["per_version"]["before"], d["per_version"]["after"]
    labels = {
        "help_s": "`rollwire --help`, spawn to exit",
        "help_cpu_s": "… its CPU seconds",
        "floor_cpu_s": "importing torch and transformers' Llama alone (CPU seconds)",
        "generator_s": "`rollwire generator` (tiny model), spawn to serving",
        "generator_cpu_s": "… its CPU seconds by then",
        "proxy_s": "`rollwire proxy` (1 replica), spawn to serving",
        "proxy_cpu_s": "… its CPU seconds by then",
        "routable_s": "the proxy serving, until it routes to the replica",
        "stop_s": "both stopped (SIGTERM to exit)",
    }
    unit = {"routable_s": (1e3, 1, " ms")}  # the rest in seconds
    rows = [
        [label, s(before[k], *unit.get(k, (1, 2, ""))), s(after[k], *unit.get(k, (1, 2, ""))),
         f"{after[k]['median'] / before[k]['median']:.2f}"]
        for k, label in labels.items()
    ]  # fmt: skip
    revs = d["revisions"]
    n = before["help_s"]["n"]
    return "\n\n".join(
        [
            provenance(d) + f" Seconds unless marked, median (min–max) of {n} alternating runs of each version "
            f"(before: `{revs['before']}`, after: `{revs['after']}`).",
            table(["from spawn", "before", "after", "after / before"], rows),
        ]
    )


RESUME_HEADER = [
    "arm",
    "client-seen time to finish (s)",
    "tokens generated twice",
    "tokens the client discarded",
    "continuation prefill tokens",
    "from the kill to the group's end (s)",
    "tokens equal the uninterrupted run's",
]


def resume_vs_restart(d: dict) -> str:
    arms, n, new = d["arms"], d["n"], d["max_new_tokens"]
    labels = {"none": "uninterrupted", "resume": "replica killed, resumed", "restart": "replica killed, restarted"}
    rows = []
    for arm in ("none", "resume", "restart"):
        a = arms[arm]
        if arm == "none":
            rows.append([labels[arm], s(a["seconds"]), "—", "—", "—", "—", "—"])
            continue
        exact = f"{a['exact']} of {a['seconds']['n']}"
        rows.append([labels[arm], s(a["seconds"]), s(a["generated_twice"], digits=0), s(a["discarded"], digits=0),
                     s(a["survivor_prefill"], digits=0), s(a["after_kill_s"]), exact])  # fmt: skip
    return "\n\n".join(
        [
            provenance(d) + f" One seeded group of {n} samples x {new} tokens over 2 replicas of the tiny model; "
            f"median (min–max) of {arms['none']['seconds']['n']} repeats per arm, the arms alternating; the replica "
            f"serving the group SIGKILLed once sample 0 held {new // 2} tokens "
            f"({s(arms['resume']['sent_before_kill'], digits=0)} of the group's {n * new} sent by then).",
            table(RESUME_HEADER, rows),
            f"Restarts seen by the client: resume arm {arms['resume']['restarts']}, restart arm "
            f"{arms['restart']['restarts']}.",
        ]
    )


def tenant_fairness(d: dict) -> str:
    """The equal-weights run, and the 1,2,1 one when its JSON is there (tenant_fairness-1-2-1)."""
    parts = [_fairness_run(d)]
    weighted = load("tenant_fairness-1-2-1")
    if weighted is not None:
        parts.append(_fairness_run(weighted))
    return "\n\n".join(parts)


def _fairness_run(d: dict) -> str:
    w, summary = d["workload"], d["summary"]
    tenants = list(w["weights"])
    header = ["proxy", "total tokens/s", *(f"{t} / its weighted share" for t in tenants), "Jain's index"]
    labels = {"flat": "flat (every token the fleet's)", "tenants": "tenants (weighted fair queueing)"}
    rows = [
        [labels[mode], s(m["total_tokens_per_s"], digits=0), *(s(m["ratio_to_share"][t]) for t in tenants),
         s(m["jain"], digits=3)]
        for mode, m in summary.items()
    ]  # fmt: skip
    weights = ", ".join(f"{t} {v:g}" for t, v in w["weights"].items())
    return "\n\n".join(
        [
            f"**Weights {weights}.** " + provenance(d) + f" One scripted replica ({w['tokens_per_s_per_sample']:g} "
            f"tokens/s per sample), {w['slots']} slots at the proxy; groups of n={w['n']} x {w['new_tokens']} tokens; "
            f"tenant A floods from {w['a_clients']} tokens, B and C from one each, {w['groups_in_flight_per_token']} "
            f"groups in flight per token; {w['window_s']:g} s windows after {w['warmup_s']:g} s of warm-up; median "
            f"(min–max) of {summary['tenants']['jain']['n']} alternating repeats.",
            table(header, rows),
        ]
    )


def multi_adapter(d: dict) -> str:
    w, tps, ratios = d["workload"], d["tokens_per_s"], d["ratios"]
    modes = ("base", "1", "2", "4", "8")
    labels = sorted({k[: -len(m)] for k in tps for m in modes if k.endswith(m) and not k.startswith("cpu ")})
    rows = []
    for label in labels:  # "" = this tree, "<ref> " = the baseline
        for m in modes:
            rows.append([f"{label or 'this tree '}{m}", s(tps[label + m], digits=0), s(tps[f"cpu {label}{m}"], digits=0),
                         s(ratios[f"{label}{m}/1"]), s(ratios[f"cpu {label}{m}/1"])])  # fmt: skip
    head = ["engine, adapters", "tokens/s", "tokens per replica CPU-second", "wall: x of 1 adapter", "CPU: x of 1"]
    return "\n\n".join(
        [
            provenance(d) + f" Median (min–max) of {tps['1']['n']} repeats; {w['groups']} groups of n={w['n']}, "
            f"{w['new_tokens']} new tokens each, all at once, on one replica of the tiny model with "
            f"{w['adapters_loaded']} adapters (r={w['lora_r']}, every linear layer) loaded"
            + (f"; the machine's load average {s(d['load_avg'], digits=1)}." if "load_avg" in d else "."),
            table(head, rows),
        ]
    )


def bulk_push(d: dict) -> str:
    plain, tls, checks = d["plain"], d.get("tls"), d["checks"]

    def rows(run: dict, label: str) -> list[list[str]]:
        out = []
        for path in ("grpc", "bulk"):
            p = run["paths"][path]
            out.append(
                [
                    label,
                    path,
                    f"{run['payload_bytes'] / 2**30:.2f} GiB",
                    s(p["push_s"], unit=" s"),
                    f"{p['relay_cpu_s_per_GiB']:.2f} s ({p['relay_GiB_per_s_per_core'] * GB_PER_GIB:.2f} GB/s)",
                    f"{p['leaf_cpu_s_per_GiB']:.2f} s",
                    f"{p['proxy_cpu_s_per_GiB']:.2f} s",
                ]
            )
        return out

    header = [
        "TLS on the replicas' hops",
        "path",
        "payload",
        "push, until both replicas serve",
        "relay: CPU per GiB (per core)",
        "leaf: CPU per GiB",
        "proxy: CPU per GiB",
    ]
    body = rows(plain, "off") + (rows(tls, "on (mutual)") if tls else [])
    load = d["load_avg"]
    parts = [
        provenance(d) + f" {d['repeats']} alternating repeats per path after one untimed push each (three on the bulk "
        "path, when its replicas reuse receive buffers), each timed push right after an untimed one by the same path; "
        "load average "
        f"{load['before'][0]:.1f} before, {load['after'][0]:.1f} after"
        + (" (other engineers' work on the same 2 cores)." if max(load["before"][0], load["after"][0]) > 3 else "."),
        table(header, body),
        f"Bulk over gRPC, push time: **{plain['bulk_over_grpc']:.2f}x** (plaintext)"
        + (f", **{tls['bulk_over_grpc']:.2f}x** (TLS)" if tls else "")
        + f". The same bytes over the same three hops as a raw TCP copy (recv_into + sendall, no checks): "
        f"{s(plain['tcp_chain_s'], unit=' s')}; the bulk push is **{plain['bulk_over_tcp']:.2f}x** that, the gRPC "
        f"push {plain['grpc_over_tcp']:.2f}x.",
        _bulk_checks(checks),
        _bulk_floor(plain, checks, d.get("cores", os.cpu_count() or 1)),
        _bulk_tls_floor(d.get("tls_alone"), checks),
    ]
    return "\n\n".join(p for p in parts if p)


def netlab_bulk(d: dict) -> str:
    """bench/push_netlab.py's run over both paths (issue 36): each mode's push until every
    replica serves, against the link time of one copy (the issue's rate is its inverse)."""
    link, modes = d["link_time_s"], d["modes"]
    counts = sorted({int(n) for mode in modes.values() for n in mode["push_s"]})

    def cell(mode: str, n: int) -> str:
        p = modes[mode]["push_s"][str(n)]
        return f"{s(p, unit=' s')}: {p['median'] / link:.2f}x the link, **{link / p['median']:.2f}x the rate**"

    def cpu(mode: str, n: int) -> str:
        runs = [r for r in d["runs"] if r["mode"] == mode and r["n"] == n]
        proxy, replicas = [r["proxy_cpu_s"] for r in runs], [r["replicas_cpu_s"] for r in runs]
        return f"{min(proxy):.2f}–{max(proxy):.2f} / {min(replicas):.2f}–{max(replicas):.2f}"

    order = [m for m in ("striped", "striped+bulk", "relay", "relay+bulk") if m in modes]
    header = ["replicas", *order, "proxy / replicas CPU s, striped+bulk"]
    rows = [
        [str(n), *(cell(m, n) for m in order), cpu("striped+bulk", n) if "striped+bulk" in modes else "–"]
        for n in counts
    ]
    load = d.get("load_avg_1m", {})
    return "\n\n".join(
        [
            provenance(d)
            + f" {d['payload_bytes'] / 1e6:.1f} MB (rank {d['rank']}), every link {d['rate_mbit']:g} Mbit/s: one copy "
            f"takes {link:.2f} s; median (min–max) of {d['repeats']} alternating repeats; load average "
            f"{load.get('before', 0):.1f} before, {load.get('after', 0):.1f} after.",
            table(header, rows),
        ]
    )


def _bulk_tls_floor(t: dict | None, checks: dict) -> str:
    """What a TLS relay must spend per GiB at least: decrypt what it receives, encrypt what it
    sends on, verify the BLAKE3 (bench/bulk_push.py's `tls_alone`, `checks_alone`)."""
    if not t:
        return ""
    blake = checks["blake3_cpu_s_per_GiB"]
    python = t["tls_decrypt_cpu_s_per_GiB"] + t["tls_encrypt_cpu_s_per_GiB"] + blake
    text = (
        f"A TLS hop on this machine: Python's `ssl` ({t['cipher']}) spends {t['tls_encrypt_cpu_s_per_GiB']:.2f} CPU s "
        f"per GiB to send and {t['tls_decrypt_cpu_s_per_GiB']:.2f} to receive over one loopback connection, so a "
        f"relay that decrypts, verifies the BLAKE3 and encrypts again spends {python:.2f} s per GiB on those alone: "
        f"{GB_PER_GIB / python:.2f} GB/s per core at best."
    )
    if "cipher_alone_GB_per_s" in t:
        crypt = GB_PER_GIB / t["cipher_alone_GB_per_s"]
        least = 2 * crypt + blake
        best = GB_PER_GIB / least
        verdict = (
            "below the 1 GB/s asked" if best < 1 else "about the 1 GB/s asked, with nothing left to move the bytes"
        )
        text += (
            f" The cipher alone (`openssl speed`, one core) runs at {t['cipher_alone_GB_per_s']:.2f} GB/s, "
            f"{crypt:.2f} s per GiB each way: with no cost besides the cipher and the BLAKE3 (kernel TLS, no copies, "
            f"no calls) a TLS relay would spend {least:.2f} s per GiB, {best:.2f} GB/s per core: {verdict}."
        )
    kernel = (
        "offered"
        if t["kernel_tls"]
        else "not built into this kernel (no `tls` in /proc/sys/net/ipv4/tcp_available_ulp)"
    )
    return text + f" Kernel TLS is {kernel}."


def _bulk_floor(plain: dict, checks: dict, cores: int) -> str:
    """What the whole push must cost on this machine's cores, however lean each stage: the raw
    copy's own CPU, plus the digests the contract asks for (the pusher's BLAKE3, and its sha256
    where it names it; the proxy's sha256 and BLAKE3; each replica's BLAKE3) and the finiteness
    scan on every receiving hop."""
    if "tcp_chain_cpu_s_per_GiB" not in plain:
        return ""
    c = {k.removesuffix("_cpu_s_per_GiB"): v for k, v in checks.items()}
    copy = plain["tcp_chain_cpu_s_per_GiB"]
    names_sha256 = plain.get("bulk_pusher_digests") != "blake3"  # runs before 12-07 04:00 named it
    pusher = c["blake3"] + (c["sha256"] if names_sha256 else 0)
    digests = pusher + c["sha256"] + c["blake3"] + 2 * c["blake3"]
    floor = (copy + digests + 3 * c["checks"]) / cores
    gib = plain["payload_bytes"] / 2**30
    raw = plain["tcp_chain_s"]["median"] / gib
    return (
        f"The floor on this machine, where the pusher, the proxy and both replicas share {cores} cores: the raw "
        f"copy itself used {copy:.2f} CPU s per GiB (all hops), the digests the contract asks for add {digests:.2f} "
        f"({'sha256 and BLAKE3' if names_sha256 else 'the BLAKE3'} at the pusher, sha256 and BLAKE3 at the proxy, "
        "BLAKE3 at each replica) and the finiteness scans "
        f"{3 * c['checks']:.2f}; over {cores} cores that is {floor:.2f} s per GiB at the very least, "
        f"**{floor / raw:.2f}x** the raw copy's {raw:.2f} s per GiB, before any control-plane work."
    )


def _bulk_checks(checks: dict) -> str:
    """The per-byte work of a hop, timed alone (bench/bulk_push.py's `checks_alone`)."""
    if "keep_copy_cpu_s_per_GiB" in checks:  # before issue 36's per-hop work: sha256, a copy, bytes-level scan
        return (
            f"What every hop must do besides moving the bytes, each timed alone here (CPU s per GiB): sha256 "
            f"{checks['sha256_cpu_s_per_GiB']:.2f}, keeping a copy in fresh memory "
            f"{checks['keep_copy_cpu_s_per_GiB']:.2f}, the payload checks (header, finiteness) "
            f"{checks['checks_cpu_s_per_GiB']:.2f}: {sum(checks.values()):.2f} s per GiB in all."
        )
    c = {k.removesuffix("_cpu_s_per_GiB"): v for k, v in checks.items()}
    least = c["blake3"] + c["reused_buffer"] + c["checks"]
    return (
        f"What a hop does besides moving the bytes, each timed alone here (CPU s per GiB): the BLAKE3 it verifies "
        f"{c['blake3']:.2f} (sha256 {c['sha256']:.2f}, where a manifest has no BLAKE3, and at the proxy beside it); "
        f"receiving into a fresh populated buffer {c['fresh_buffer']:.2f}, into a reused one {c['reused_buffer']:.2f} "
        f"(a copy, as recv_into's); the payload checks (header, finiteness) {c['checks']:.2f}: {least:.2f} s per GiB "
        "at least, with a reused buffer."
    )


SECTIONS = {
    "weight_push": weight_push,
    "proxy_overhead": proxy_overhead,
    "scaling": scaling,
    "async_vs_sync": async_vs_sync,
    "generator_efficiency": generator_efficiency,
    "http_overhead": http_overhead,
    "follow_vs_pinned": follow_vs_pinned,
    "vllm_vs_transformers": vllm_vs_transformers,
    "trl_vllm_vs_rollwire": trl_vllm_vs_rollwire,
    "trl_shapes": trl_shapes,
    "prefix_cache": prefix_cache,
    "signed_push": signed_push,
    "proof_cost": proof_cost,
    "sessions": sessions,
    "startup": startup,
    "resume_vs_restart": resume_vs_restart,
    "tenant_fairness": tenant_fairness,
    "bulk_push": bulk_push,
    "push_netlab_2000mbit_bulk_r128": netlab_bulk,
    "multi_adapter": multi_adapter,
}


def main() -> int:
    text = DOC.read_text()
    results = {name: load(name) for name in SECTIONS}
    missing = [name for name, data in results.items() if data is None]
    results = {name: data for name, data in results.items() if data is not None}
    for name, render in [("noise", lambda _: noise(results)), *SECTIONS.items()]:
        data = results.get(name, {})
        if name not in results and name != "noise":
            continue
        block = re.compile(rf"(<!-- generated:{name} -->\n).*?(<!-- /generated:{name} -->)", re.S)
        if not block.search(text):
            raise SystemExit(f"{DOC} has no <!-- generated:{name} --> block")
        text = block.sub(lambda m: m.group(1) + render(data) + "\n" + m.group(2), text)
    DOC.write_text(text)
    print(
        f"rewrote {DOC.relative_to(ROOT)}" + (f"; no results yet for {', '.join(missing)}" if missing else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
