"""Output of benchmarks: a printed table, a JSON file and a PNG plot."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}


def write_json(report: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def _pyplot() -> Any:
    """pyplot on the file-only backend; imported here, so only plotting needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt: Any, fig: Any, path: Path, dpi: int) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def bus_table(report: dict[str, Any]) -> str:
    rows = [f"{'path':<8} {'transport':<8} {'msgs/s':>10} {'p50 µs':>9} {'p99 µs':>9}"]
    for path in ("request", "token"):
        section = report[f"{path}_path"]
        for transport in ("redis", "zeromq"):
            r = section[transport]
            rows.append(f"{path:<8} {transport:<8} {r['msgs_per_s']:>10,.0f} {r['p50_us']:>9,.0f} {r['p99_us']:>9,.0f}")
        rows.append(f"{path:<8} {'ratio':<8} {section['ratio']:>10.2f}   (Redis msgs/s / ZeroMQ msgs/s)")
    return "\n".join(rows)


def bus_plot(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    paths = ("request", "token")
    colors = {"redis": "#c0392b", "zeromq": "#2980b9"}
    for ax, (metric, title) in zip(
        axes,
        (
            ("msgs_per_s", "throughput, flat out (msgs/s)"),
            ("p50_us", "latency p50, paced (µs)"),
            ("p99_us", "latency p99, paced (µs)"),
        ),
        strict=True,
    ):
        for offset, transport in ((-0.2, "redis"), (0.2, "zeromq")):
            values = [report[f"{p}_path"][transport][metric] for p in paths]
            bars = ax.bar(
                [i + offset for i in range(len(paths))], values, width=0.4, label=transport, color=colors[transport]
            )
            ax.bar_label(bars, fmt="{:,.0f}", fontsize=8)
        ax.set_xticks(range(len(paths)), [f"{p} path" for p in paths])
        ax.set_title(title)
        if metric != "msgs_per_s":  # µs on the request path, tens of ms on the token path
            ax.set_yscale("log")
    axes[0].legend()
    cfg = report["config"]
    fig.suptitle(
        f"splitbus bench bus: Redis Streams vs ZeroMQ asyncio PUSH/PULL "
        f"(token path: {cfg['streams']} streams; paced at {cfg['paced_request_rate']:.0f} req/s and "
        f"{cfg['streams'] / cfg['paced_step_interval_s']:,.0f} tok/s)",
        fontsize=10,
    )
    _save(plt, fig, path, dpi=110)


def engine_table(report: dict[str, Any]) -> str:
    extra = tuple(f"prefill_b{b}_tok_s" for b in report.get("prefill_batches", [1]) if b != 1)
    cols = (
        "prefill_tok_s",
        *extra,
        "decode_b1_tok_s",
        "decode_b8_tok_s",
        "decode_b32_tok_s",
        "kv_export_gb_s",
        "kv_import_gb_s",
    )
    w = _name_width(report["results"])
    rows = [f"{'model':<{w}} {'params M':>8} " + " ".join(f"{c:>17}" for c in cols)]
    for r in report["results"]:
        rows.append(f"{r['model']:<{w}} {r['params_m']:>8} " + " ".join(f"{r[c]:>17,}" for c in cols))
    for r in report["results"]:
        costs = [(b, r.get(f"decode_b{b}_logprobs5_cost_pct")) for b in (1, 8, 32)]
        shown = ", ".join(f"b{b} {c:+.1f} %" for b, c in costs if c is not None)
        rows.append(f"{r['model']}: a decode step with logprobs K=5 against greedy sampling alone: {shown}")
        rows += _engine_extra_lines(r)
    rows += _engine_vs_hf_rows(report["results"])
    return f"device {report['device']}, {report['threads']} thread(s)\n" + "\n".join(rows)


def _engine_extra_lines(r: dict[str, Any]) -> list[str]:
    """The sampled-decode cost and the long prompt of one model, where the run measured them."""
    lines = []
    if "decode_b32_sampled_t1_step_ms" in r:
        lines.append(
            f"{r['model']}: a decode step at b32, greedy {r['decode_b32_greedy_step_ms']} ms, temperature 1 "
            f"{r['decode_b32_sampled_t1_step_ms']} ms ({r['decode_b32_sampled_t1_cost_pct']:+.1f} %)"
        )
    if "long_prompt_ms" in r:
        peak = r["long_prompt_peak_mib"]
        lines.append(
            f"{r['model']}: a {r['long_prompt_tokens']:,}-token prompt: {r['long_prompt_ms']:,} ms "
            f"({r['long_prompt_tok_s']:,} tok/s), peak RSS "
            + (f"+{peak:,} MiB" if peak is not None else "not measured (no /proc/self/clear_refs)")
            + f" over {r['long_prompt_rss_after_load_mib']:,} MiB after load (one layer's whole-prompt fp32 "
            f"score matrix: {r['long_prompt_score_matrix_mib']:,} MiB)"
        )
    return lines


def _name_width(results: list[dict[str, Any]]) -> int:
    """The model column's width: 20, or the longest name (a .gguf file's stem runs longer)."""
    return max([20, *(len(r["model"]) for r in results)])


ENGINE_VS_HF = ("prefill", "decode_b1", "decode_b8", "decode_b32")
"""The figures ``--vs-transformers`` measures on both sides, as tokens/s."""


def _engine_vs_hf_rows(results: list[dict[str, Any]]) -> list[str]:
    """paddle against transformers, tokens/s, with paddle's multiple of it (> 1: paddle faster)."""
    compared = [r for r in results if "hf_prefill_tok_s" in r]
    if not compared:
        return []
    w = _name_width(compared)
    rows = ["", f"{'model':<{w}} {'side':<12} " + " ".join(f"{k + ' tok/s':>17}" for k in ENGINE_VS_HF)]
    for r in compared:
        rows.append(f"{r['model']:<{w}} {'paddle':<12} " + " ".join(f"{r[k + '_tok_s']:>17,}" for k in ENGINE_VS_HF))
        rows.append(
            f"{'':<{w}} {'transformers':<12} " + " ".join(f"{r['hf_' + k + '_tok_s']:>17,}" for k in ENGINE_VS_HF)
        )
        rows.append(
            f"{'':<{w}} {'paddle / hf':<12} " + " ".join(f"{r['vs_hf_' + k + '_x']:>16}x" for k in ENGINE_VS_HF)
        )
    return rows


def engine_plot(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()

    results = report["results"]
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.4), squeeze=False)
    labels = ["prefill 128", "decode b1", "decode b8", "decode b32"]
    for ax, r in zip(axes[0], results, strict=True):
        hf = "hf_prefill_tok_s" in r
        width, offset = (0.4, 0.2) if hf else (0.8, 0.0)
        values = [r[f"{k}_tok_s"] for k in ENGINE_VS_HF]
        bars = ax.bar([i - offset for i in range(4)], values, width=width, label="paddle", color="#16a085")
        ax.bar_label(bars, fmt="{:,.0f}", fontsize=8)
        if hf:
            theirs = [r[f"hf_{k}_tok_s"] for k in ENGINE_VS_HF]
            bars = ax.bar([i + offset for i in range(4)], theirs, width=width, label="transformers", color="#7f8c8d")
            ax.bar_label(bars, fmt="{:,.0f}", fontsize=8)
            ax.legend(fontsize=8)
        ax.set_xticks(range(4), labels)
        ax.set_title(_engine_plot_title(r), fontsize=8)
    fig.suptitle(f"splitbus bench engine on {report['device']} ({report['threads']} thread)", fontsize=10)
    _save(plt, fig, path, dpi=110)


def _engine_plot_title(r: dict[str, Any]) -> str:
    """A model's panel title: tokens/s, and the figures that are not tokens/s."""
    lines = [
        f"{r['model']} ({r['params_m']}M params): tokens/s",
        f"KV export {r['kv_export_gb_s']} GB/s, import {r['kv_import_gb_s']} GB/s",
    ]
    if "decode_b32_sampled_t1_cost_pct" in r:
        lines.append(f"b32 step at temperature 1: {r['decode_b32_sampled_t1_cost_pct']:+.1f} % over greedy")
    if r.get("long_prompt_peak_mib") is not None:
        lines.append(
            f"{r['long_prompt_tokens']:,}-token prompt: {r['long_prompt_ms'] / 1000:.1f} s, "
            f"peak +{r['long_prompt_peak_mib']:,.0f} MiB"
        )
    return "\n".join(lines)


def stagger_table(report: dict[str, Any]) -> str:
    rows = [
        f"{'backend':<11} {'ranks':>5} {'costs':>5} {'load':<9} {'mode':<10} {'idle fwd':>8} {'+drain':>7} "
        f"{'idle time':>9} {'util':>5} {'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'tok/s':>9}"
    ]
    for r in report["results"]:
        rows.append(
            f"{r['backend']:<11} {r['ranks']:>5} {'x' + format(r['cost_scale'], 'g'):>5} {r['load']:<9} "
            f"{r['mode']:<10} {r['idle_forward_ratio']:>8.4f} "
            f"{r.get('idle_forward_ratio_all_steps', float('nan')):>7.4f} {r['idle_time_ratio']:>9.4f} "
            f"{r['step_utilization']:>5.2f} {r['ttft_p50_s'] * 1000:>11.1f} {r['ttft_p99_s'] * 1000:>11.1f} "
            f"{r['throughput_tok_s']:>9,.0f}"
        )
    rows.append(
        "idle fwd, idle time, util: over the steps that start by the last arrival; +drain: idle fwd over all steps"
    )
    for r in report["results"]:
        if r.get("runs_ttft_p50_s"):
            rows.append(
                f"  processes {r['load']:<9} {r['mode']:<10} TTFT p50 of each run, ms: "
                f"{', '.join(f'{p * 1000:.1f}' for p in r['runs_ttft_p50_s'])}"
            )
    return "\n".join(rows)


def _stagger_key(r: dict[str, Any]) -> tuple[str, int, float, str]:
    return r["backend"], r["ranks"], r["cost_scale"], r["load"]


def stagger_plot(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    keys = _stagger_keys(report["results"])
    by = {(*_stagger_key(r), r["mode"]): r for r in report["results"]}
    labels = _stagger_labels(keys)
    fig, axes = plt.subplots(5, 1, figsize=(max(10, len(keys) * 0.9), 16))
    # The first two of the five axes: the TTFT changes and the runs' spread fill the rest below.
    for ax, (metric, title) in zip(
        axes,
        (
            ("idle_forward_ratio", "idle forwards per rank-step"),
            ("idle_time_ratio", "share of rank time in idle forwards"),
        ),
        strict=False,
    ):
        _stagger_bars(ax, [[by[k + (mode,)][metric] for k in keys] for mode in ("naive", "staggered")])
        ax.set_xticks(range(len(keys)), labels, fontsize=7)
        ax.set_title(title, fontsize=9)
    for ax, metric in zip(axes[2:4], ("ttft_p50_s", "ttft_p99_s"), strict=True):
        _stagger_change(ax, [by[k + ("staggered",)][metric] / by[k + ("naive",)][metric] for k in keys])
        ax.set_xticks(range(len(keys)), labels, fontsize=7)
        ax.set_title(f"{metric[:4].upper()} {metric[5:8]}: staggered vs naive (%)", fontsize=9)
    _process_runs_plot(axes[4], [r for r in report["results"] if r.get("runs_ttft_p50_s")])
    axes[0].legend()
    fig.suptitle(
        f"splitbus bench stagger: naive vs staggered on the same Poisson trace (seed {report['seed']})", fontsize=10
    )
    _save(plt, fig, path, dpi=100)


def _stagger_keys(results: list[dict[str, Any]]) -> list[tuple[str, int, float, str]]:
    """The configurations in plotting order: scaled costs first, by ranks, processes before the sim, by load."""
    loads = ["low", "moderate", "high"]
    return sorted(
        {_stagger_key(r) for r in results},
        key=lambda k: (k[2] == 1, k[1], k[0] != "processes", loads.index(k[3])),
    )


def _stagger_labels(keys: list[tuple[str, int, float, str]]) -> list[str]:
    return [f"{'proc' if b == 'processes' else 'sim'} {n}r x{scale:g}\n{load}" for b, n, scale, load in keys]


def _stagger_bars(ax: Any, values: list[list[float]]) -> None:
    """Naive's and staggered's values side by side, one pair per configuration."""
    for (offset, mode, color), bars in zip(
        ((-0.2, "naive", "#7f8c8d"), (0.2, "staggered", "#27ae60")), values, strict=True
    ):
        ax.bar([i + offset for i in range(len(bars))], bars, width=0.4, label=mode, color=color)


def _stagger_change(ax: Any, ratios: list[float]) -> None:
    """Staggered against naive in per cent, green where it is lower."""
    change = [100 * (ratio - 1) for ratio in ratios]
    ax.bar(range(len(change)), change, color=["#27ae60" if c < 0 else "#c0392b" for c in change])
    ax.axhline(0, color="black", linewidth=0.5)


def _process_runs_plot(ax: Any, rows: list[dict[str, Any]]) -> None:
    """Each run's TTFT p50 on the rank processes: how far one run moves from the next."""
    loads = [load for load in ("low", "moderate", "high") if any(r["load"] == load for r in rows)]
    for offset, mode, color in ((-0.1, "naive", "#7f8c8d"), (0.1, "staggered", "#27ae60")):
        points = _run_points(rows, mode, loads, offset)
        ax.scatter([x for x, _ in points], [y for _, y in points], color=color, label=mode, s=18)
    ax.set_xticks(range(len(loads)), loads, fontsize=8)
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title("rank processes: TTFT p50 of each run (the table pools all runs' requests)", fontsize=9)
    if rows:
        ax.legend(fontsize=7)


def _run_points(rows: list[dict[str, Any]], mode: str, loads: list[str], offset: float) -> list[tuple[float, float]]:
    """(load's position + offset, TTFT p50 in ms) of each run of ``mode``."""
    return [
        (loads.index(r["load"]) + offset, p * 1000) for r in rows if r["mode"] == mode for p in r["runs_ttft_p50_s"]
    ]


def serve_table(report: dict[str, Any]) -> str:
    rows = [
        f"{'path':<12} {'rate':>6} {'done':>5} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'TPOT p50':>9} {'ITL p50':>8} {'ITL p99':>8} {'E2E p99':>9}  (ms)"
    ]
    for r in report["runs"]:
        rows.append(
            f"{r['path']:<12} {_run_label(r):>6} {r['completed']:>5} {r['request_throughput']:>7.1f} "
            f"{r['output_throughput']:>9,.0f} "
            f"{_ms(r['median_ttft_ms'], 9)} {_ms(r['p99_ttft_ms'], 9)} {_ms(r['median_tpot_ms'], 9)} "
            f"{_ms(r['median_itl_ms'], 8)} {_ms(r['p99_itl_ms'], 8)} {_ms(r['p99_e2el_ms'], 9)}"
        )
        if r["failed"]:
            rows.append(f"          {r['failed']} failed: {'; '.join(r.get('errors', []))}")
        if "prefix_hit_ratio" in r:
            rows.append(_cache_row(r))
        if r.get("redis_memory_per_request_bytes") is not None:
            rows.append(_redis_memory_row(r))
    by_dispatch = report.get("hops_ms_by_dispatch") or {"scheduler": report.get("hops_ms", {})}
    for dispatch, hops in by_dispatch.items():
        for name, hop in hops.items():
            rows.append(
                f"  idle system, --dispatch {dispatch}, {name}: p50 {hop['p50']:.2f} ms, p90 {hop['p90']:.2f} ms"
            )
    rows += _step_rows(report)
    if floor := report.get("http_floor_ttft_ms"):
        rows.append(
            f"  idle, the HTTP floor (this client and one HTTP server with nothing behind it, bench/http_floor.py): "
            f"TTFT p50 {floor['p50']:.2f} ms, p90 {floor['p90']:.2f} ms; in the first and last hops above, and in "
            "the TTFT added below (the direct engine has no HTTP)"
        )
    for o in report.get("overhead", []):
        rows.append(
            f"added by {o.get('path', 'splitbus')} {_overhead_where(o)}: "
            f"TTFT p50 {_ms(o['added_median_ttft_ms'], 0, '+')} ms, "
            f"mean {_ms(o['added_mean_ttft_ms'], 0, '+')}, "
            f"p99 {_ms(o['added_p99_ttft_ms'], 0, '+')}; per token (TPOT) p50 {_ms(o['added_median_tpot_ms'], 0, '+')} "
            f"ms, mean {_ms(o['added_mean_tpot_ms'], 0, '+')}, "
            f"p99 {_ms(o['added_p99_tpot_ms'], 0, '+')}; ITL p50 {_ms(o['added_median_itl_ms'], 0, '+')} ms, p99 "
            f"{_ms(o['added_p99_itl_ms'], 0, '+')}"
        )
    return "\n".join(rows)


def _step_rows(report: dict[str, Any]) -> list[str]:
    """Each hop's steps to the microsecond (``hop_trace.table``'s lines), per dispatch."""
    by_dispatch: dict[str, list[dict[str, Any]]] = report.get("hop_steps_us_by_dispatch") or {}
    return [
        f"    --dispatch {dispatch}, {line['hop'] or 'all'}: {line['what']}: "
        f"p50 {line['p50_us']:,.0f} us, p90 {line['p90_us']:,.0f} us"
        for dispatch, lines in by_dispatch.items()
        for line in lines
    ]


def _overhead_where(row: dict[str, Any]) -> str:
    """Over what, and where: the rate (over the engine driven in-process), or the max concurrency
    over another baseline (``--vs-direct-http``: the engine behind its own HTTP server)."""
    if "max_concurrency" in row:
        return f"over {row.get('baseline', 'direct')} at max concurrency {row['max_concurrency']}"
    return f"at {row['request_rate']} req/s"


def _run_label(run: dict[str, Any]) -> str:
    """A run's place in a series: its max concurrency where the series varies it, else its rate."""
    return f"c={run['max_concurrency']}" if "max_concurrency" in run else str(run["request_rate"])


def _cache_row(run: dict[str, Any]) -> str:
    """The prefix hit ratio beside the workload's ideal, and the goodput where bounds were given."""
    row = f"          prefix hit ratio {run['prefix_hit_ratio']:.1%} (ideal {run['ideal_prefix_hit_ratio']:.1%})"
    if run.get("request_goodput") is not None:
        row += f", goodput {run['request_goodput']:.2f} req/s"
    return row


def _redis_memory_row(run: dict[str, Any]) -> str:
    start, end = run["redis_used_memory_start_bytes"], run["redis_used_memory_end_bytes"]
    return (
        f"          Redis used_memory: {start / 2**20:.1f} MiB at the start, {end / 2**20:.1f} MiB at the end, "
        f"{run['redis_memory_per_request_bytes']:+,.0f} B per request still held at the end"
    )


def _ms(value: float | None, width: int, sign: str = "") -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{sign}{width}.2f}"


def _rate_order(rate: str) -> float:
    """Offered rates (or ``c=N`` max concurrencies) in order, ``inf`` last; a trace's run (its own
    times) after them."""
    try:
        return float(rate.removeprefix("c="))
    except ValueError:
        return math.inf


def serve_plot(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    colors = plt.get_cmap("viridis")
    rates = sorted({_run_label(r) for r in report["runs"]}, key=_rate_order)
    # Three of the four axes: the fourth, below, plots throughput.
    for ax, (metric, title) in zip(
        axes.flat, (("ttft", "TTFT"), ("itl", "inter-token latency"), ("e2el", "end-to-end latency")), strict=False
    ):
        for run in report["runs"]:
            color = colors(rates.index(_run_label(run)) / max(1, len(rates) - 1) * 0.85)
            _serve_cdf(ax, run, run["cdf_ms"][metric], color)
        ax.set_xscale("log")
        ax.set_xlabel("ms")
        ax.set_title(f"{title} CDF")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    _serve_throughput(axes.flat[3], report["runs"])
    fig.suptitle(f"splitbus bench serve: {report['target']}", fontsize=10)
    _save(plt, fig, path, dpi=100)


def _serve_cdf(ax: Any, run: dict[str, Any], values: list[float], color: Any) -> None:
    """One run's CDF of one latency (nothing for none): dashed for the direct engine."""
    if values:
        ax.plot(
            values,
            [i / (len(values) - 1) for i in range(len(values))],
            "--" if run["path"].startswith("direct") else "-",
            color=color,
            label=f"{run['path']} {_run_label(run)}" + ("" if "max_concurrency" in run else " req/s"),
        )


def _serve_throughput(ax: Any, runs: list[dict[str, Any]]) -> None:
    """Output tokens/s against completed requests/s, one line per path, each point labelled with its rate."""
    for path_name in dict.fromkeys(r["path"] for r in runs):  # splitbus, direct, http, splitbus:<policy>
        marker = "s--" if path_name.startswith("direct") else "o-"
        of_path = [r for r in runs if r["path"] == path_name]
        if of_path:
            ax.plot(
                [r["request_throughput"] for r in of_path],
                [r["output_throughput"] for r in of_path],
                marker,
                label=path_name,
            )
            for r in of_path:
                ax.annotate(_run_label(r), (r["request_throughput"], r["output_throughput"]), fontsize=7)
    ax.set_xlabel("completed requests/s")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs offered rate (labels)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def scheduler_table(report: dict[str, Any]) -> str:
    rows = [
        f"{'placed by':<20} {'workers':>7} {'paced req/s':>11} {'p50 ms':>7} {'p99 ms':>7} {'p99.9 ms':>8} "
        f"{'max ms':>7} {'flood decisions/s':>18}"
    ]
    for r in report["results"]:
        p, f = r["paced"], r["flood"]
        rows.append(
            f"{_placed_by(r):<20} {r['workers']:>7} {p['achieved_rate']:>11.0f} {p['p50_ms']:>7.2f} "
            f"{p['p99_ms']:>7.2f} {p['p99.9_ms']:>8.2f} {p['max_ms']:>7.1f} {f['decisions_per_s']:>18,.0f}"
        )
        for phase, counts in (("paced", p), ("flood", f)):
            if counts["placed"] < counts["requests"]:
                rows.append(f"         {phase}: only {counts['placed']} of {counts['requests']} requests were placed")
    if report.get("decisions"):
        rows += ["", f"{'one decision, in-process':<26} {'workers':>7} {'p50 µs':>8} {'p99 µs':>8} {'mean µs':>8}"]
        for d in report["decisions"]:
            for placer in ("columns", "rows"):
                t = d[placer]
                rows.append(
                    f"{placer:<26} {d['workers']:>7} {t['p50_us']:>8.1f} {t['p99_us']:>8.1f} {t['mean_us']:>8.1f}"
                )
            if not d["same_choices"]:
                rows.append(f"         {d['workers']} workers: columns and rows chose differently (a defect)")
    return "\n".join(rows)


def _placed_by(result: dict[str, Any]) -> str:
    kind = "API dispatcher(s)" if result.get("dispatch") == "api" else "scheduler(s)"
    return f"{result['replicas']} {kind}"


def scheduler_plot(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()

    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in report["results"]:
        values = r["paced"]["cdf_ms"]
        cdf.plot(
            values,
            [i / (len(values) - 1) for i in range(len(values))],
            label=f"{_placed_by(r)}, {r['workers']} workers: p99 {r['paced']['p99_ms']:.2f} ms",
        )
    cdf.axvline(1.0, color="grey", linestyle=":", label="target p99 1 ms")
    cdf.set_xscale("log")
    cdf.set_xlabel("ms from the request's XADD to its task in a worker's stream")
    cdf.set_title(f"latency at {report['config']['rate']:g} requests/s")
    cdf.legend(fontsize=8)
    cdf.grid(alpha=0.3)
    kinds = {"api": "API"}
    labels = [
        f"{r['replicas']} {kinds.get(r.get('dispatch', ''), 'sched.')}\n{r['workers']} w." for r in report["results"]
    ]
    values = [r["flood"]["decisions_per_s"] for r in report["results"]]
    drawn = bars.bar(labels, values, color="#2980b9")
    bars.bar_label(drawn, fmt="{:,.0f}")
    bars.axhline(10_000, color="grey", linestyle=":", label="target 10,000/s (one process)")
    bars.axhline(20_000, color="black", linestyle=":", label="target 20,000/s (two)")
    bars.set_title(f"decisions/s, {report['config']['flood_requests']:,} requests at once")
    bars.legend(fontsize=8)
    fig.suptitle("splitbus bench scheduler", fontsize=10)
    _save(plt, fig, path, dpi=100)


def api_table(report: dict[str, Any]) -> str:
    first = report["runs"][0]
    rows = [
        f"{first['streams']} concurrent streams of {report['config']['tokens']} tokens (offered "
        f"{first['offered_tokens_per_s']:,.0f} tokens/s); {report['cpus']} cores, somaxconn {report['somaxconn']}",
        f"{'API processes':>13} {'completed':>9} {'resets':>6} {'tokens/s':>9} {'Redis conns':>11} "
        f"{'commands':>9} {'cmd/token':>9} {'load 1m':>7}",
    ]
    for r in report["runs"]:
        rows += [_api_row(r)] + ([f"  errors with {r['api_workers']}: {r['errors']}"] if r["errors"] else [])
    return "\n".join(rows)


def _api_row(r: dict[str, Any]) -> str:
    """One process count's run: the columns of ``api_table``'s header."""
    counts = f"{r['api_workers']:>13} {r['completed']:>9} {r['resets']:>6} {r['tokens_per_s']:>9,.0f}"
    redis = (
        f"{r['api_redis_connections_peak']:>11} {r['redis_commands']:>9,} {_optional(r['redis_commands_per_token']):>9}"
    )
    return f"{counts} {redis} {r['load_average_1m']:>7.2f}"


def api_plot(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()

    runs = report["runs"]
    labels = [f"{r['api_workers']} proc." for r in runs]  # text: bare numbers are taken as categories, with a warning
    fig, (tput, resets) = plt.subplots(1, 2, figsize=(10, 4))
    bars = tput.bar(labels, [r["tokens_per_s"] for r in runs], color="#27ae60")
    tput.bar_label(bars, fmt="{:,.0f}")
    tput.axhline(40000, color="grey", linestyle=":", label="target 40,000")
    tput.set_title("tokens/s delivered")
    tput.set_xlabel("API processes (--workers)")
    tput.legend(fontsize=8)
    bars = resets.bar(labels, [r["resets"] for r in runs], color="#c0392b")
    resets.bar_label(bars)
    resets.set_ylim(0, max(1, *(r["resets"] for r in runs)) * 1.2)
    resets.set_title("streams reset by the server")
    resets.set_xlabel("API processes (--workers)")
    fig.suptitle(
        f"splitbus bench api: {runs[0]['streams']} concurrent streams (offered {runs[0]['offered_tokens_per_s']:,.0f} "
        f"tokens/s); {report['cpus']} cores, somaxconn {report['somaxconn']}",
        fontsize=10,
    )
    _save(plt, fig, path, dpi=100)


def ep_table(report: dict[str, Any]) -> str:
    rows = [
        f"{'backend':<11} {'ranks':>5} {'costs':>5} {'load':<9} {'mode':<10} {'TTFT p50':>8} {'TTFT p99':>8} "
        f"{'TPOT p50':>8} {'P idle':>6} {'P idle s':>8} {'D idle':>6} {'D idle s':>8} {'D imbal':>7} {'out tok/s':>9}"
    ]
    for r in report["results"]:
        imbalance = "-" if r["decode_step_imbalance"] is None else f"{r['decode_step_imbalance']:.3f}"
        rows.append(
            f"{r['backend']:<11} {r['ranks']:>5} {'x' + format(r['cost_scale'], 'g'):>5} {r['load']:<9} "
            f"{r['mode']:<10} {r['ttft_p50_s'] * 1000:>8.1f} {r['ttft_p99_s'] * 1000:>8.1f} "
            f"{r['tpot_p50_s'] * 1000:>8.2f} {r['prefill_idle_forward_ratio']:>6.3f} "
            f"{_optional(r['prefill_idle_compute_s']):>8} {r['decode_idle_forward_ratio']:>6.3f} "
            f"{_optional(r['decode_idle_compute_s']):>8} {imbalance:>7} {r['output_throughput']:>9,.0f}"
        )
    rows.append(
        "ms; P/D idle: idle forwards per prefill/decode rank-step; P/D idle s: seconds of compute in idle forwards "
        "per run; D imbal: busiest/mean decode rank compute per step"
    )
    return "\n".join(rows)


def _optional(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}"


def ep_plot(report: dict[str, Any], path: Path) -> None:
    """Staggered vs naive, per configuration: the change (%) of each headline metric."""
    plt = _pyplot()
    keys = sorted(
        {_stagger_key(r) for r in report["results"]},
        key=lambda k: (k[0] != "processes", k[2] == 1, k[1], ("low", "moderate", "high").index(k[3])),
    )
    by = {(*_stagger_key(r), r["mode"]): r for r in report["results"]}
    labels = [f"{'proc' if b == 'processes' else 'sim'} {n}+{n} x{scale:g}\n{load}" for b, n, scale, load in keys]
    metrics = ("ttft_p50_s", "ttft_p99_s", "prefill_idle_compute_s", "output_throughput")
    fig, axes = plt.subplots(len(metrics), 1, figsize=(max(10, len(keys) * 0.9), 3.2 * len(metrics)))
    for ax, metric in zip(axes, metrics, strict=True):
        _ep_change(ax, metric, [(by[k + ("staggered",)][metric], by[k + ("naive",)][metric]) for k in keys])
        ax.set_xticks(range(len(keys)), labels, fontsize=7)
        ax.set_title(f"{metric}: staggered vs naive (%)", fontsize=9)
    fig.suptitle(f"splitbus bench ep: EP + PD, naive vs staggered prefill (seed {report['seed']})", fontsize=10)
    _save(plt, fig, path, dpi=100)


def _ep_change(ax: Any, metric: str, pairs: list[tuple[float, float]]) -> None:
    """Staggered against naive in per cent, green where it is better (lower, but higher throughput)."""
    change = [100 * (staggered / max(naive, 1e-12) - 1) for staggered, naive in pairs]
    good = [c < 0 if metric != "output_throughput" else c > 0 for c in change]
    ax.bar(range(len(change)), change, color=["#27ae60" if g else "#c0392b" for g in good])
    ax.axhline(0, color="black", linewidth=0.5)


def bus_cluster_table(report: dict[str, Any]) -> str:
    rows = [
        f"{'setup':<36} {'tokens/s':>10} {'cmds/token':>10} {'busiest':>8}  shares by primary (reader tag -> primary)"
    ]
    for s in report["setups"]:
        shares = " ".join(f"{share:.0%}" for share in s["primary_shares"])
        tags = ", ".join(f"{r['tag']}->{r['primary']}" for r in s["readers"])
        rows.append(
            f"{s['name']:<36} {s['tokens_per_s']:>10,.0f} {s['commands_per_token']:>10.3f} "
            f"{s['busiest_share']:>8.0%}  {shares} ({tags})"
        )
    verdict = "met" if report["target_met"] else "not met"
    rows.append(f"target: busiest primary <= {report['target_busiest_share']:.0%} of commands (placed tags): {verdict}")
    return "\n".join(rows)


def bus_cluster_plot(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()

    setups = report["setups"]
    names = [s["name"].replace(", ", "\n") for s in setups]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    bars = left.bar(range(len(setups)), [s["tokens_per_s"] for s in setups], color="#c0392b")
    left.bar_label(bars, fmt="{:,.0f}", fontsize=8)
    left.set_xticks(range(len(setups)), names, fontsize=8)
    left.set_title("token path, flat out (tokens/s)")
    for i, s in enumerate(setups):  # one stacked bar per setup: each primary's share
        bottom = 0.0
        for p, share in enumerate(s["primary_shares"]):
            right.bar(
                i,
                share,
                bottom=bottom,
                color=f"C{p}",
                edgecolor="white",
                label=f"primary {p}" if i == len(setups) - 1 else None,
            )
            bottom += share
    right.axhline(report["target_busiest_share"], color="black", linestyle="--", linewidth=1, label="target (busiest)")
    right.set_xticks(range(len(setups)), names, fontsize=8)
    right.set_title("each primary's share of the commands")
    right.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    cfg = report["config"]
    fig.suptitle(
        f"splitbus bench bus --redis-cluster {cfg['primaries']}: {cfg['streams']} streams, "
        f"{cfg['api_nodes']} API nodes, {cfg['steps']} steps x {cfg['repeat']} runs",
        fontsize=10,
    )
    _save(plt, fig, path, dpi=110)


ROUTING_WINDOWS = {
    "before_loss": "before the loss",
    "during_loss": "during the loss",
    "resync_to_1s": "resync .. +1 s",
    "1s_to_2s": "+1 s .. +2 s",
    "1s_to_end": "+1 s .. end",
}


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def routing_table(report: dict[str, Any]) -> str:
    return "\n".join(
        [
            *_routing_scoring_rows(report["scoring"]),
            *_routing_ingest_rows(report["ingest"]),
            *_routing_recovery_rows(report["recovery"]),
            f"load average (1, 5, 15 min): {report['load_average']['start']} at the start, "
            f"{report['load_average']['end']} at the end",
        ]
    )


def _routing_scoring_rows(s: dict[str, Any]) -> list[str]:
    from splitbus.bench.routing import SCORING_NAMES

    r = s["results"]
    rows = [
        f"scoring: {s['prompt_tokens']:,}-token prompt ({s['chain_blocks']:,} blocks), {s['workers']} workers holding "
        f"it to depths 0..{s['chain_blocks']}, {s['other_blocks_per_worker']:,} other blocks each; "
        f"{r['hash']['n']:,} fresh requests, gc off while timed",
        f"  {'measure':<40} {'p50 µs':>9} {'p99 µs':>9} {'max µs':>9}",
    ]
    for key, name in SCORING_NAMES.items():
        rows.append(f"  {name:<40} {r[key]['p50_us']:>9,.1f} {r[key]['p99_us']:>9,.1f} {r[key]['max_us']:>9,.1f}")
    target, sent, fresh = s["target_us"], r["place_sent"]["p99_us"], r["place_fresh"]["p99_us"]
    rows.append(
        f"  target p99 <= {target:,.0f} µs for the decision, chain sent by the API: {_met(sent <= target)} "
        f"({sent:,.0f} µs); hashed by the scheduler: {_met(fresh <= target)} ({fresh:,.0f} µs)"
    )
    return rows


def _routing_ingest_rows(s: dict[str, Any]) -> list[str]:
    names = {"apply": "KvIndex.apply (decoded batches)", "redis": "Redis: XREAD + decode + apply"}
    rows = [
        f"ingest: {s['workers']} workers, {s['cached_blocks_per_worker']:,} cached blocks each; a batch (an engine "
        f"step) = BlockRemoved(8) + BlockStored(8); median of {len(s['results']['apply']['runs_events_per_s'])} run(s)",
        f"  {'path':<40} {'batches/s':>11} {'events/s':>11} {'hashes/s':>12}",
    ]
    for key, name in names.items():
        r = s["results"][key]
        rows.append(f"  {name:<40} {r['batches_per_s']:>11,} {r['events_per_s']:>11,} {r['hashes_per_s']:>12,}")
    redis = s["results"]["redis"]
    rows.append(
        f"  Redis: every batch published first (publishing not timed), then {redis['batches']:,} batches read in "
        f"{redis['polls']} poll(s), {redis['seconds']:.3f} s ({redis['process_cpu_s']:.3f} s of this process's CPU)"
    )
    target = s["target_events_per_s"]
    verdicts = ", ".join(
        f"{key} {_met(ok)} ({s['results'][key]['events_per_s']:,})" for key, ok in s["target_met"].items()
    )
    rows.append(f"  target >= {target:,.0f} events/s on one core: {verdicts}")
    return rows


def _routing_recovery_rows(s: dict[str, Any]) -> list[str]:
    cfg, seeds = s["config"], s["seeds"]
    lost = "all workers'" if cfg["lost"] == "all" else "one worker's"
    resyncs = [row["resync_s"] for row in seeds]
    rows = [
        f"recovery (simulated): {cfg['workers']} workers x {cfg['pool_blocks']} blocks, {cfg['groups']} prefixes of "
        f"{cfg['prefix_tokens']} + {cfg['question_tokens']}-token questions, {cfg['rate']:g} req/s held "
        f"{cfg['service_s']:g} s; {lost} batches lost {cfg['loss_at_s']:g}-{cfg['loss_at_s'] + cfg['loss_s']:g} s",
        f"  {len(seeds)} seed(s) pooled; last resync at {min(resyncs):.2f}-{max(resyncs):.2f} s; "
        f"{sum(row['lost_batches'] for row in seeds):,} batches lost; ideal hit ratio {s['ideal_hit_ratio']:.1%}",
        f"  {'window (hit ratio)':<22} {'without loss':>12} {'with loss':>10} {'points lower':>13} {'± stderr':>9} "
        f"{'requests':>9}",
    ]
    for key, name in ROUTING_WINDOWS.items():
        w = s["windows"][key]
        stderr = "-" if w["points_lower_stderr"] is None else f"{w['points_lower_stderr']:.2f}"
        rows.append(
            f"  {name:<22} {_pct(w['without_loss']):>12} {_pct(w['with_loss']):>10} {_num(w['points_lower']):>13} "
            f"{stderr:>9} {w['requests_with_loss']:>9,}"
        )
    window = s["target_window"]
    lower = _num(s["windows"][window]["points_lower"])
    rows.append(
        f"  target: within {s['target_points']:g} points of the run without loss 1 s after the resync "
        f"({ROUTING_WINDOWS[window]}): {_met(s['target_met'])} ({lower} points lower)"
    )
    return rows


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def routing_plot(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.5), gridspec_kw={"width_ratios": [1.2, 0.8, 1.6]})
    _routing_scoring_plot(left, report["scoring"])
    _routing_ingest_plot(middle, report["ingest"])
    _routing_recovery_plot(right, report["recovery"])
    load = report["load_average"]
    fig.suptitle(
        f"splitbus bench routing: the KV index (issue 23); load average {load['start'][0]:.2f} at the start, "
        f"{load['end'][0]:.2f} at the end",
        fontsize=10,
    )
    _save(plt, fig, path, dpi=100)


def _routing_scoring_plot(ax: Any, s: dict[str, Any]) -> None:
    from splitbus.bench.routing import SCORING

    labels = ["hash chain", "overlaps", "place\n(chain sent)", "place\n(hashed here)", "place\n(memoized)"]
    for offset, (metric, color) in ((-0.2, ("p50_us", "#2980b9")), (0.2, ("p99_us", "#c0392b"))):
        values = [s["results"][key][metric] for key in SCORING]
        bars = ax.bar([i + offset for i in range(len(SCORING))], values, width=0.4, color=color, label=metric[:3])
        ax.bar_label(bars, fmt="{:,.0f}", fontsize=7)
    ax.axhline(s["target_us"], color="black", linestyle="--", linewidth=1, label="target p99")
    ax.set_yscale("log")
    ax.set_xticks(range(len(SCORING)), labels, fontsize=8)
    ax.set_title(f"scoring a {s['prompt_tokens']:,}-token prompt, {s['workers']} workers (µs)", fontsize=9)
    ax.legend(fontsize=7)


def _routing_ingest_plot(ax: Any, s: dict[str, Any]) -> None:
    keys = ("apply", "redis")
    bars = ax.bar(range(2), [s["results"][k]["events_per_s"] for k in keys], color=["#8e44ad", "#c0392b"])
    ax.bar_label(bars, fmt="{:,.0f}", fontsize=8)
    ax.axhline(s["target_events_per_s"], color="black", linestyle="--", linewidth=1, label="target")
    ax.set_xticks(range(2), ["KvIndex.apply", "Redis: XREAD\n+ decode + apply"], fontsize=8)
    ax.set_title("event ingest, one process (events/s)", fontsize=9)
    ax.legend(fontsize=7)


def _routing_recovery_plot(ax: Any, s: dict[str, Any]) -> None:
    cfg = s["config"]
    for name, color in (("without_loss", "#2980b9"), ("with_loss", "#c0392b")):
        points = [(b["t_s"], b["hit_ratio"]) for b in s["runs"][name]["series"] if b["hit_ratio"] is not None]
        ax.plot(
            [t for t, _ in points],
            [r for _, r in points],
            color=color,
            label=name.replace("_", " "),
            drawstyle="steps-post",
        )
    ax.axvspan(cfg["loss_at_s"], cfg["loss_at_s"] + cfg["loss_s"], color="#f39c12", alpha=0.2, label="batches lost")
    resync = statistics.mean(row["resync_s"] for row in s["seeds"])
    ax.axvline(resync, color="black", linewidth=1, label="resync (mean)")
    ax.axvline(resync + 1, color="black", linestyle=":", linewidth=1, label="resync + 1 s")
    ax.set_ylim(0, 1)
    ax.set_xlabel("simulated time (s)")
    ax.set_title(
        f"hit ratio per {cfg['bucket_s']:g} s, {len(s['seeds'])} seed(s) pooled (ideal {s['ideal_hit_ratio']:.0%})",
        fontsize=9,
    )
    ax.legend(fontsize=7, loc="lower right")


def grammar_table(report: dict[str, Any]) -> str:
    r = report
    lines = [
        f"structured output on {r['model']} ({r['vocab_size']} tokens, logit rows {r['vocab_rows']}), "
        f"{r['runs']} runs; llguidance's tokenizer built in {r['tokenizer_build_s']:.2f} s (once per model)",
        f"{'workload':<12} {'tokens':>6} {'compile':>8} {'build':>7}   us a token: "
        f"{'mask':>6} {'apply':>6} {'advance':>7} {'total':>6} {'p99':>6} {'max':>7}",
    ]
    for name, w in r["workloads"].items():
        lines.append(
            f"{name:<12} {w['tokens']:>6} {w['compile_ms']:>6.1f}ms {w['build_ms']:>5.1f}ms   {'':11} "
            f"{w['mask_us']['mean']:>6.1f} {w['apply_us']['mean']:>6.1f} {w['advance_us']['mean']:>7.1f} "
            f"{w['total_us']['mean']:>6.1f} {w['total_us']['p99']:>6.1f} {w['total_us']['max']:>7.1f}"
        )
    total_ms = r["workloads"]["json_schema"]["total_us"]["mean"] / 1000
    lines.append(f"json_schema: {total_ms:.3f} ms a token; target <= {r['target_ms']} ms: {_met(r['target_met'])}")
    return "\n".join(lines + (_grammar_batch_rows(r["batch"]) if "batch" in r else []))


def _grammar_batch_rows(batch: dict[str, Any]) -> list[str]:
    lines = [
        f"a decode batch on the paddle engine ({batch['model']}), {batch['runs']} runs x {batch['steps']} step pairs: "
        f"(a) every request unconstrained, (b) one of them under {batch['workload']}'s grammar",
        f"{'B':>3} {'(a) ms':>9} {'(b) ms':>9} {'(b)-(a)':>9} {'%':>7}   {'(a) p10-p90 ms':>17} "
        f"{'paired p10/p50/p90 ms':>24}  within (a)'s spread",
    ]
    for row in batch["results"]:
        a, b, paired = row["a_ms"], row["b_ms"], row["paired_diff_ms"]
        spread = f"{a['p10']:.2f}-{a['p90']:.2f}"
        pairs = f"{paired['p10']:+.2f}/{paired['p50']:+.2f}/{paired['p90']:+.2f}"
        lines.append(
            f"{row['batch']:>3} {a['p50']:>9.2f} {b['p50']:>9.2f} {row['diff_ms']:>+9.3f} {row['diff_pct']:>+6.2f}%   "
            f"{spread:>17} {pairs:>24}  {'yes' if row['within_spread'] else 'NO'}"
        )
    return lines


def grammar_plot(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()

    batch = report.get("batch")
    fig, axes = plt.subplots(1, 2 if batch else 1, figsize=(13 if batch else 8, 4), squeeze=False)
    _grammar_tokens_plot(axes[0][0], report)
    if batch:
        _grammar_batch_plot(axes[0][1], batch)
    fig.suptitle(f"splitbus bench grammar: {report['model']}, {report['vocab_size']} tokens", fontsize=10)
    _save(plt, fig, path, dpi=100)


def _grammar_tokens_plot(ax: Any, report: dict[str, Any]) -> None:
    names = list(report["workloads"])
    bottom = [0.0] * len(names)
    for part, color in (("mask", "#2980b9"), ("apply", "#27ae60"), ("advance", "#e67e22")):
        values = [report["workloads"][n][f"{part}_us"]["mean"] for n in names]
        ax.bar(names, values, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    top = 1.5 * max(report["target_ms"] * 1000, *bottom)  # a preempted token's p99 would flatten the bars
    p99 = [report["workloads"][n]["total_us"]["p99"] for n in names]
    ax.scatter(names, [min(v, 0.97 * top) for v in p99], color="black", marker="_", s=400, label="p99 (total)")
    for name, value in zip(names, p99, strict=True):
        ax.annotate(f"p99 {value:,.0f}", (name, min(value, 0.97 * top)), textcoords="offset points", xytext=(0, 5))
    ax.set_ylim(0, top)
    ax.axhline(report["target_ms"] * 1000, color="grey", linestyle=":", label=f"target {report['target_ms']} ms")
    ax.set_ylabel("microseconds a token (mean)")
    ax.set_title("a constrained request's own cost a token", fontsize=9)
    ax.legend(fontsize=8)


def _grammar_batch_plot(ax: Any, batch: dict[str, Any]) -> None:
    """Each side's p10-p50-p90 step time as a percentage of (a)'s median: whether (b) sits inside (a)'s spread."""
    for offset, side, color, label in (
        (-0.1, "a_ms", "#7f8c8d", "(a) all unconstrained"),
        (0.1, "b_ms", "#c0392b", "(b) one constrained"),
    ):
        xs, ys, low, high = [], [], [], []
        for i, row in enumerate(batch["results"]):
            base, s = row["a_ms"]["p50"], row[side]
            xs.append(i + offset)
            ys.append((s["p50"] / base - 1) * 100)
            low.append((s["p50"] - s["p10"]) / base * 100)
            high.append((s["p90"] - s["p50"]) / base * 100)
        ax.errorbar(xs, ys, yerr=[low, high], fmt="o", color=color, capsize=6, label=f"{label}: p50, p10-p90")
    for i, row in enumerate(batch["results"]):
        ax.annotate(
            f"{row['diff_ms']:+.2f} ms of\n{row['a_ms']['p50']:.1f} ms",
            (i + 0.1, row["diff_pct"]),
            textcoords="offset points",
            xytext=(8, -4),
            fontsize=7,
        )
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xticks(range(len(batch["results"])), [f"B = {row['batch']}" for row in batch["results"]])
    ax.set_xlim(-0.6, len(batch["results"]) - 0.4)
    ax.set_ylabel("decode step time, % of (a)'s median")
    ax.set_title(
        f"a decode batch, one request under {batch['workload']}'s grammar ({batch['runs']} x {batch['steps']} pairs)",
        fontsize=9,
    )
    ax.legend(fontsize=7)


def choices_table(report: dict[str, Any]) -> str:
    cfg, n = report["config"], report["config"]["n"]
    lines = [
        f"n choices on {report['model']} ({cfg['engine']} engine, 1 P + 1 D), {cfg['pairs']} pairs, "
        f"{cfg['prompt_tokens']}-token prompts (fresh each), max_tokens {cfg['max_tokens']}",
        f"{'side':<32} {'wall p50 ms':>11} {'p90 ms':>8}   per response: {'prompts computed':>16} "
        f"{'prefills':>8} {'shared':>6} {'cached tok':>10} {'tok computed':>12}",
    ]
    labels = {"a": f"(a) one request, n = {n}", "b": f"(b) {n} requests, n = 1, at once"}
    for side, label in labels.items():
        s = report["sides"][side]
        lines.append(
            f"{label:<32} {s['wall_ms']['p50']:>11.1f} {s['wall_ms']['p90']:>8.1f}   {'':14}"
            f"{s['prompts_computed_per_response']:>16.2f} {s['prefills_done_per_response']:>8.2f} "
            f"{s['prefills_shared_per_response']:>6.2f} {s['cached_tokens_per_response']:>10.1f} "
            f"{s['prompt_tokens_computed_per_response']:>12.1f}"
        )
    paired = report["paired_diff_ms"]
    lines.append(
        f"(b)/(a) wall p50: {report['wall_ratio_b_over_a']:.2f}x; (b)-(a) in each pair, p10/p50/p90: "
        f"{paired['p10']:+.1f}/{paired['p50']:+.1f}/{paired['p90']:+.1f} ms"
    )
    lines.append(f"target (n = {n} costs one prefill: 1 prompt computed a response): {_met(report['one_prefill_met'])}")
    return "\n".join(lines)


def choices_plot(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()

    fig, (walls, prefills) = plt.subplots(1, 2, figsize=(12, 4))
    n, sides = report["config"]["n"], report["sides"]
    labels = {"a": f"(a) one request, n = {n}", "b": f"(b) {n} requests, n = 1"}
    for side, color in (("a", "#2980b9"), ("b", "#c0392b")):
        rows = sides[side]["responses"]
        walls.plot([r["pair"] + 1 for r in rows], [r["wall_ms"] for r in rows], "o-", color=color, label=labels[side])
        computed = sides[side]["prompts_computed_per_response"]
        shared = sides[side]["prefills_shared_per_response"]
        prefills.bar(labels[side], computed, color=color, label="prompts computed" if side == "a" else None)
        prefills.bar(
            labels[side], shared, bottom=computed, color="#bdc3c7", label="shared (forked)" if side == "a" else None
        )
        prefills.annotate(
            f"{computed:g} computed", (labels[side], computed), ha="center", xytext=(0, 4), textcoords="offset points"
        )
    walls.xaxis.get_major_locator().set_params(integer=True)
    prefills.set_ylim(0, n * 1.2)  # room for the legend above the bars
    walls.set_xlabel("pair")
    walls.set_ylabel("wall time of the response (ms)")
    walls.set_ylim(bottom=0)
    walls.legend(fontsize=8)
    prefills.set_ylabel("P's prefills per response")
    prefills.legend(fontsize=8)
    cfg = report["config"]
    fig.suptitle(
        f"splitbus bench choices: {report['model']}, {cfg['engine']} engine, {cfg['prompt_tokens']}-token prompts, "
        f"max_tokens {cfg['max_tokens']}, {cfg['pairs']} pairs",
        fontsize=10,
    )
    _save(plt, fig, path, dpi=100)


def tenants_table(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [
        f"tenants on {report['target']}: capacity {cfg['capacity_rps']:.2f} req/s; a at {cfg['flood']:g}x, b and c at "
        f"{cfg['steady']:g}x each (c at an earlier priority); {cfg['duration_s']:g} s a run, timeout "
        f"{cfg['request_timeout_s']:g} s; limits on: a's rps {cfg['a_rps']:g}x and early refusal",
        f"{'run':<11} {'tenant':<6} {'sent':>5} {'done':>5} {'429':>5} {'503':>5} {'failed':>6} {'lost':>4} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'out tok/s':>9}",
    ]
    for run, row in report["runs"].items():
        for tenant, s in row["tenants"].items():
            lines.append(
                f"{run:<11} {tenant:<6} {s['sent']:>5} {s['completed']:>5} {s['refused_429']:>5} {s['refused_503']:>5} "
                f"{s['failed']:>6} {s['lost']:>4} {_tenant_ms(s['ttft_p50_ms']):>9} {_tenant_ms(s['ttft_p99_ms']):>9} "
                f"{s['output_tokens_per_s']:>9.1f}"
            )
    return "\n".join([*lines, *_tenants_targets(report)])


def _tenant_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _tenants_targets(report: dict[str, Any]) -> list[str]:
    t, share = report["targets"], report["a_limit_share"]
    a = t["a_refused_early"]
    return [
        "targets:",
        *(
            f"  {x}'s TTFT p99 beside a's flood / alone: {t[f'{x}_ttft_p99_ratio']['measured']:.2f}x "
            f"(at most {t[f'{x}_ttft_p99_ratio']['bound']:g}x): {_met(t[f'{x}_ttft_p99_ratio']['met'])}"
            for x in ("b", "c")
        ),
        "  (beside a's flood / b and c without it: "
        + ", ".join(f"{x} {r:.2f}x" for x, r in t["ttft_p99_over_no_flood"].items())
        + ")",
        f"  a refused before the first byte ({a['refused']}), none failed after admission "
        f"({a['failed_after_admission']}): {_met(a['met'])}",
        f"  zero admitted requests lost (lost by run: {t['zero_lost']['lost_by_run']}): {_met(t['zero_lost']['met'])}",
        f"  a's rps limit ({share['rps_limit']:g}) held by two API nodes together: {share['admitted']} admitted, "
        f"one exact bucket admits {share['one_bucket']} of the same arrivals ({share['ratio']:.3f}; within 5 %; "
        f"at most {share['allowed']:.1f} allowed): {_met(t['limit_across_two_nodes']['met'])}",
    ]


def tenants_plot(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    fig, (ttft, outcomes) = plt.subplots(1, 2, figsize=(13, 4.5))
    runs = report["runs"]
    colors = {"a": "#c0392b", "b": "#2980b9", "c": "#27ae60"}
    labels, p50, p99, bar_colors = [], [], [], []
    for run, row in runs.items():
        for tenant, s in row["tenants"].items():
            labels.append(f"{tenant}\n{run}")
            p50.append(s["ttft_p50_ms"] or 0)
            p99.append(s["ttft_p99_ms"] or 0)
            bar_colors.append(colors[tenant])
    x = range(len(labels))
    ttft.bar(x, p99, color=bar_colors, alpha=0.45, label="p99")
    ttft.bar(x, p50, color=bar_colors, label="p50")
    ttft.set_xticks(list(x), labels, fontsize=7)
    ttft.set_yscale("log")
    ttft.set_ylabel("TTFT of completed requests (ms, log)")
    ttft.legend(fontsize=8)
    _tenant_outcomes(outcomes, runs)
    cfg = report["config"]
    fig.suptitle(
        f"splitbus bench tenants: a floods at {cfg['flood']:g}x capacity ({cfg['capacity_rps']:.1f} req/s), b and c "
        f"at {cfg['steady']:g}x each, c earlier; limits on vs off",
        fontsize=10,
    )
    _save(plt, fig, path, dpi=100)


def _tenant_outcomes(axis: Any, runs: dict[str, Any]) -> None:
    """Each tenant's requests by outcome in the runs with all three."""
    kinds = (("completed", "#27ae60"), ("refused", "#f39c12"), ("failed", "#c0392b"), ("lost", "#000000"))
    labels = [f"{t}\n{run}" for run in ("limits_on", "limits_off") for t in runs[run]["tenants"]]
    rows = [runs[run]["tenants"][t] for run in ("limits_on", "limits_off") for t in runs[run]["tenants"]]
    bottom = [0] * len(rows)
    for kind, color in kinds:
        values = [r[kind] for r in rows]
        axis.bar(labels, values, bottom=bottom, color=color, label=kind)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axis.set_yscale("symlog")
    axis.set_ylim(0, max(bottom, default=1) * 3)  # room above the tallest bar for the legend
    axis.set_ylabel("requests")
    axis.legend(fontsize=8)
