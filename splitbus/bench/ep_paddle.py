"""``splitbus bench ep --engine paddle``: naive vs staggered prefill placement on real MoE compute.

The benchmark writes its own checkpoint (a Mixtral of 32 experts, hidden 256, 4 layers, top-2,
seeded), then:

1. **Calibration**: the ranks of one expert-parallel group (processes, gloo on loopback) run
   forwards of equal size on every rank; each forward's time and the time inside its exchanges
   (``ExpertGroup.exchange_s``) give the sim engine's cost model as measured: prefill seconds per
   token, a decode step's fixed and per-sequence cost, and the all-to-all's fixed and per-token
   cost.
2. **Processes**: ``splitbus up --engine paddle --prefill 1 --prefill-dp N --decode 1 --decode-dp N
   --ep`` with naive placement (``--no-stagger``, no alignment) and with staggering, on the same
   seeded Poisson trace per load and seed (each request's prompt its own random tokens, so no
   prefix cache flatters either side); the modes take turns going first.
3. **The model**: the discrete-event simulation (``ep_sim``) of the same traces with the
   calibrated costs as measured, to say how far the model and the processes agree (the processes
   share the cores with a second group, the API and the scheduler; the calibration's group ran
   alone).

Per rank: its forwards, its idle forwards and the time in steps where it ran an idle forward (the
compute staggering exists to cut: under EP an idle rank's forward joins every exchange and can do
nothing else).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from splitbus.bench.ep import ProcessRuns, row
from splitbus.bench.ep_sim import EpSimulation
from splitbus.bench.stagger import ALIGN_MS, MAX_WAIT_S, MODES, RANK_COUNTERS, _replay, _trace
from splitbus.bench.stagger_sim import TraceRequest
from splitbus.bench.system import LocalSystem
from splitbus.bus.core.keys import Keys
from splitbus.bus.roles import Role
from splitbus.worker.engines.sim import SimConfig

MODEL = {"hidden": 256, "layers": 4, "experts": 32, "per_token": 2}
"""The benchmark's checkpoint (a Mixtral): big enough that a step's compute dominates."""
LOAD_SHARES = {"low": 0.1, "moderate": 0.5, "high": 0.8}
"""Each load's arrival rate, as a share of the prefill group's estimated capacity (``capacity``)."""
CPU_SHARE = 0.25
"""The share of the calibration's speed a rank of the benchmark's system is taken to get: the
calibration runs one group of N ranks alone, the system two (with the API and the scheduler) on
the same cores. A first run on 2 cores saw naive TTFT p50 past 3 s at half the calibration's
capacity, so a quarter it is. Only the loads' rates use it: the simulation runs the costs as
measured, so that the gap between it and the processes is shown, not tuned away."""
DECODE_BATCHES = (1, 4, 16, 64)
PREFILL_TOKENS = (64, 256, 1024)
CALIBRATION_REPEATS = 5
ROLES = (Role.PREFILL, Role.DECODE)
PER_RANK_COUNTERS = ("steps", "idle_forwards", "idle_time_us", "idle_forward_us")
"""Per rank, over a trace: group steps, idle forwards, time in the steps it idled (barrier
included), time inside its idle forwards (the compute EP makes an idle rank spend)."""
COSTS = ("prefill_s_per_token", "decode_step_s", "decode_s_per_seq", "a2a_s", "a2a_s_per_token")
"""The sim costs the calibration measures (the rest keep their defaults)."""


@dataclass(frozen=True)
class PaddleEpConfig:
    ranks: int = 4
    """Ranks of the prefill group and of the decode group."""
    loads: tuple[str, ...] = tuple(LOAD_SHARES)
    seeds: tuple[int, ...] = (1, 2, 3)
    """One trace per load and seed: the spread between seeds is the run-to-run spread."""
    duration_s: float = 15.0
    """Seconds of arrivals per trace."""

    def __post_init__(self) -> None:
        if self.ranks < 2 or not self.seeds or self.duration_s <= 0:
            raise ValueError("--process-ranks must be >= 2, with a seed and a positive --process-duration")
        if not self.loads or any(load not in LOAD_SHARES for load in self.loads):
            raise ValueError(f"--loads must be among {tuple(LOAD_SHARES)}")


def make_model(folder: Path, seed: int = 7) -> Path:
    from splitbus.gpu_ops import device

    device.prepare()
    from splitbus.worker.engines.paddle.tiny import make_tiny_model

    keys: dict[str, object] = {"num_local_experts": MODEL["experts"], "num_experts_per_tok": MODEL["per_token"]}
    return make_tiny_model(folder, "mixtral", seed=seed, keys=keys, hidden=MODEL["hidden"], layers=MODEL["layers"])


def _calibration_rank(folder: str, port: int, rank: int, size: int, out: Any) -> None:
    """One rank of the calibration group: for each shape, the median forward and exchange seconds."""
    from splitbus.gpu_ops import device

    device.prepare()
    from splitbus.gpu_ops.expert_parallel import ExpertGroup, Rendezvous
    from splitbus.worker.engines.paddle.model import load_model

    device.select_device(1)
    model = load_model(Path(folder), (rank, size))
    group = model.group = ExpertGroup.form(Rendezvous("127.0.0.1", port, rank, size, 60))
    for kind, size_, chunks in _shapes(rank):
        model.forward(chunks)  # warm-up
        times = []
        for _ in range(CALIBRATION_REPEATS):
            began, waited = time.perf_counter(), group.exchange_s
            model.forward(chunks)
            times.append((time.perf_counter() - began, group.exchange_s - waited))
        forward, exchange = np.median(times, axis=0)
        out.put((rank, kind, size_, float(forward), float(exchange)))


def _shapes(rank: int) -> list[tuple[str, int, list[Any]]]:
    """The calibration's forwards, the same on every rank (``decode``: a batch of one-token
    sequences, ``prefill``: one prompt) or ``skewed``: rank 0 prefills a prompt while the others
    run one token, as a naive step's ranks often do; the exchange's model prices a step by its
    busiest rank, and the skewed shapes test that."""
    from splitbus.worker.engines.paddle.model import Chunk

    rng = np.random.default_rng(rank)

    def prompt(n: int) -> list[Any]:
        return [Chunk([int(t) for t in rng.integers(0, 256, n)], 0)]

    shapes = [("decode", b, [Chunk([int(t)], 0) for t in rng.integers(0, 256, b)]) for b in DECODE_BATCHES]
    shapes += [("prefill", n, prompt(n)) for n in PREFILL_TOKENS]
    return shapes + [("skewed", n, prompt(n) if rank == 0 else prompt(1)) for n in PREFILL_TOKENS]


def calibrate(folder: Path, ranks: int) -> dict[str, Any]:
    """Run the calibration group; every rank's medians, and the sim costs fitted to them."""
    from splitbus.worker.dp import free_port

    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    port = free_port("127.0.0.1")
    procs = [context.Process(target=_calibration_rank, args=(str(folder), port, r, ranks, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    points = [out.get(timeout=600) for _ in range(ranks * (len(DECODE_BATCHES) + 2 * len(PREFILL_TOKENS)))]
    for p in procs:
        p.join(60)
    rows = [dict(zip(("rank", "kind", "tokens", "forward_s", "exchange_s"), p, strict=True)) for p in points]
    costs = fit(rows)
    return {"points": rows, "costs": asdict(costs), "exchange_residuals_s": exchange_residuals(rows, costs)}


def _mean(points: list[dict[str, Any]], kind: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    """Each size of ``kind`` and ``key``'s mean over the ranks (over rank 0, the busiest, for
    ``skewed``: the others' exchange time is mostly waiting for it)."""
    mine = [p for p in points if p["kind"] == kind and (kind != "skewed" or p["rank"] == 0)]
    sizes = sorted({p["tokens"] for p in mine})
    return np.array(sizes, dtype=float), np.array([np.mean([p[key] for p in mine if p["tokens"] == s]) for s in sizes])


def fit(points: list[dict[str, Any]]) -> SimConfig:
    """The sim's costs from the calibration's medians: least-squares lines through the exchange
    seconds against the busiest rank's tokens, every shape (the all-to-all's fixed and per-token
    cost), through the decode forwards' compute (the rest) against the batch, and through the
    prefill forwards' compute against the prompt (its slope: the per-token cost)."""
    kinds = [kind for kind in ("decode", "prefill", "skewed") if any(p["kind"] == kind for p in points)]
    tokens = np.concatenate([_mean(points, kind, "exchange_s")[0] for kind in kinds])
    exchange = np.concatenate([_mean(points, kind, "exchange_s")[1] for kind in kinds])
    a2a_per_token, a2a = np.polyfit(tokens, exchange, 1)
    batch, decode_total = _mean(points, "decode", "forward_s")
    per_seq, step = np.polyfit(batch, decode_total - _mean(points, "decode", "exchange_s")[1], 1)
    prompt, prefill_total = _mean(points, "prefill", "forward_s")
    per_token = float(np.polyfit(prompt, prefill_total - _mean(points, "prefill", "exchange_s")[1], 1)[0])
    return SimConfig(
        prefill_s_per_token=max(per_token, 0.0),
        decode_step_s=max(float(step), 0.0),
        decode_s_per_seq=max(float(per_seq), 0.0),
        a2a_s=max(float(a2a), 0.0),
        a2a_s_per_token=max(float(a2a_per_token), 0.0),
    )


def exchange_residuals(points: list[dict[str, Any]], costs: SimConfig) -> dict[str, list[float]]:
    """Per shape kind, measured minus modelled exchange seconds at each size: how far the sim's
    model (fixed + per token of the busiest rank) is from the calibration's own points."""
    residuals = {}
    for kind in ("decode", "prefill", "skewed"):
        sizes, measured = _mean(points, kind, "exchange_s")
        modelled = costs.a2a_s + costs.a2a_s_per_token * sizes
        residuals[kind] = [round(float(m), 5) for m in measured - modelled]
    return residuals


def capacity(costs: SimConfig, ranks: int, cpu_share: float) -> float:
    """Requests per second the prefill group takes, estimated: every rank prefilling prompts of the
    trace's mean (544 tokens) at the calibrated cost, slowed by ``cpu_share`` (the calibration ran
    one group on the machine; the benchmark runs two, with the API and the scheduler)."""
    mean_prompt = (64 + 1024) / 2
    step = costs.prefill_s_per_token * mean_prompt + costs.a2a_s + costs.a2a_s_per_token * mean_prompt
    return ranks * cpu_share / step


class PaddleEpSystem(LocalSystem):
    """``splitbus up --engine paddle --ep`` with a prefill and a decode group of ``ranks`` each,
    naive or staggered (the scheduler's and the ranks' defaults; naive turns both off)."""

    def __init__(self, folder: Path, ranks: int, staggered: bool) -> None:
        groups = ("--prefill", "1", "--prefill-dp", str(ranks), "--decode", "1", "--decode-dp", str(ranks), "--ep")
        modes = () if staggered else ("--scheduler-arg=--no-stagger", "--worker-arg=--dp-align-ms", "--worker-arg=0")
        # Arrivals spread over a trace, with 2 ranks' worth of KV each: enough for the high load.
        kv = ("--worker-arg=--kv-cache-mb", "--worker-arg=512", "--worker-arg=--max-requests", "--worker-arg=256")
        model = ("--model", str(folder), "--served-model-name", "tiny")  # the name the replay asks for
        super().__init__("--engine", "paddle", *model, *groups, *modes, *kv)
        self.ranks = ranks
        self._wait_for_groups()

    def _wait_for_groups(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len([r for r in self.per_rank() if r["dp_epoch"]]) < 2 * self.ranks:
            if time.monotonic() > deadline:
                raise RuntimeError("the EP groups did not form: " + "".join(self.output[-20:]))
            time.sleep(0.5)

    def per_rank(self) -> list[dict[str, Any]]:
        """Each rank's role, rank and cumulative step counters, as it reports them."""
        import redis

        client = redis.Redis.from_url(self.redis_url, decode_responses=True)
        fields = ("role", "dp_rank", "dp_epoch", *RANK_COUNTERS, *PER_RANK_COUNTERS)
        ranks = []
        for worker in cast("list[str]", client.zrange(Keys().workers, 0, -1)):
            values = cast("list[str | None]", client.hmget(Keys().worker(worker), *fields))
            ranks.append({f: v if f == "role" else int(v or 0) for f, v in zip(fields, values, strict=True)})
        client.close()
        return ranks


def _prompts(seed: int, load: str) -> Callable[[TraceRequest, int], list[int]]:
    """Each request's own prompt in the trace of ``seed`` and ``load``: random tokens, drawn from
    all three, so that no prefix cache hit (within a trace, or of an earlier load's on the same
    system) flatters a run."""
    salt = list(LOAD_SHARES).index(load)

    def prompt(request: TraceRequest, index: int) -> list[int]:
        rng = np.random.default_rng([seed, salt, index])
        return [int(t) for t in rng.integers(0, 256, request.prompt_tokens)]

    return prompt


@dataclass
class Measured:
    runs: ProcessRuns = field(default_factory=ProcessRuns)
    per_rank: dict[str, list[int]] = field(default_factory=dict)
    restarted: int = 0
    """Ranks whose counters a restart reset during a trace (left out of ``per_rank`` for it)."""
    """``role:rank`` -> forwards, idle forwards and microseconds in idle steps, over the runs."""


def _measure(
    system: PaddleEpSystem,
    trace: list[TraceRequest],
    prompts: Callable[[TraceRequest, int], list[int]],
    into: Measured,
    progress: Callable[[str], None],
) -> None:
    time.sleep(2.0)  # the previous trace's drain settles into the counters
    before = {(r["role"], r["dp_rank"]): r for r in system.per_rank()}

    def snapshot() -> tuple[np.ndarray, np.ndarray]:
        ranks = system.per_rank()
        prefill, decode = ([[r[c] for c in RANK_COUNTERS] for r in ranks if r["role"] == role] for role in ROLES)
        return np.sum(prefill, axis=0), np.sum(decode, axis=0)

    first = snapshot()
    done = asyncio.run(_replay(f"{system.base_url}/v1", trace, snapshot, prompt_of=prompts))
    runs = into.runs
    runs.ttfts += done.ttfts
    runs.tpots += done.tpots
    runs.failed += len(done.failed)
    if done.failed:
        progress(f"  {len(done.failed)} of {len(trace)} requests failed; the first: {done.failed[0]}")
    runs.run_p50s.append(float(np.percentile(done.ttfts, 50)) if done.ttfts else float("nan"))
    runs.prefill += done.at_last_arrival[0] - first[0]
    runs.decode += done.at_last_arrival[1] - first[1]
    runs.tokens, runs.elapsed_s = runs.tokens + done.tokens, runs.elapsed_s + done.elapsed_s
    for rank in system.per_rank():
        was = before.get((rank["role"], rank["dp_rank"]))
        if was is None or was["dp_epoch"] != rank["dp_epoch"]:  # restarted: its counters began again
            into.restarted += 1
            continue
        moved = [rank[c] - was[c] for c in PER_RANK_COUNTERS]
        key = f"{rank['role']}:{rank['dp_rank']}"
        into.per_rank[key] = [a + b for a, b in zip(into.per_rank.get(key, [0] * len(moved)), moved, strict=True)]


def run_paddle_ep_bench(config: PaddleEpConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="splitbus-bench-ep-") as tmp:
        folder = make_model(Path(tmp) / "moe")
        progress(f"calibration: one EP group of {config.ranks} ranks, {MODEL}")
        calibration = calibrate(folder, config.ranks)
        costs = SimConfig(**calibration["costs"])
        rate = capacity(costs, config.ranks, CPU_SHARE)
        progress(f"calibrated costs {calibration['costs']}; estimated prefill capacity {rate:.2f} requests/s")
        traces = {
            (load, seed): _trace(LOAD_SHARES[load] * rate, config.duration_s, seed, f"{load}-load")
            for load in config.loads
            for seed in config.seeds
        }
        measured = _run_processes(folder, config, traces, progress)
    rows = [_process_row(mode, load, m, config, traces) for (mode, load), m in measured.items()]
    rows += [_model_row(mode, load, seed, config.ranks, costs, traces) for mode in MODES for load, seed in traces]
    return {
        "model": MODEL,
        "ranks": config.ranks,
        "duration_s": config.duration_s,
        "seeds": list(config.seeds),
        "load_shares": LOAD_SHARES,
        "rate_per_s": {load: LOAD_SHARES[load] * rate for load in config.loads},
        "calibration": calibration,
        "cpu_share": CPU_SHARE,
        "results": rows,
    }


def _run_processes(
    folder: Path,
    config: PaddleEpConfig,
    traces: dict[tuple[str, int], list[TraceRequest]],
    progress: Callable[[str], None],
) -> dict[tuple[str, str], Measured]:
    """Every seed's traces (all loads) on one system per mode; the modes take turns going first."""
    measured = {(mode, load): Measured() for mode in MODES for load in config.loads}
    for turn, seed in enumerate(config.seeds):
        for mode in MODES[::-1] if turn % 2 else MODES:
            system = PaddleEpSystem(folder, config.ranks, mode == "staggered")
            try:
                for load in config.loads:
                    progress(f"processes: {config.ranks}+{config.ranks} ranks, {mode}, {load} load, seed {seed}")
                    _measure(system, traces[(load, seed)], _prompts(seed, load), measured[(mode, load)], progress)
            finally:
                system.stop()
    return measured


def _process_row(
    mode: str, load: str, m: Measured, config: PaddleEpConfig, traces: dict[tuple[str, int], list[TraceRequest]]
) -> dict[str, Any]:
    requests = sum(len(traces[(load, seed)]) for seed in config.seeds)
    return {
        **row("paddle processes", config.ranks, load, mode, 1.0, m.runs.result(requests)),
        "failed": m.runs.failed,
        "seeds_ttft_p50_s": [round(p, 4) for p in m.runs.run_p50s],
        "per_rank": {
            k: {c: round(n / 1e6, 3) if c.endswith("_us") else n for c, n in zip(PER_RANK_COUNTERS, v, strict=True)}
            for k, v in sorted(m.per_rank.items())
        },  # fmt: skip
        "idle_step_s": round(sum(v[2] for v in m.per_rank.values()) / 1e6, 3),
        "idle_forward_s": round(sum(v[3] for v in m.per_rank.values()) / 1e6, 3),
        "ranks_restarted": m.restarted,
    }


def _model_row(
    mode: str, load: str, seed: int, ranks: int, costs: SimConfig, traces: dict[tuple[str, int], list[TraceRequest]]
) -> dict[str, Any]:
    simulated = EpSimulation(ranks, mode == "staggered", costs, MAX_WAIT_S, ALIGN_MS, seed).run(traces[(load, seed)])
    return {**row("calibrated simulation", ranks, load, mode, 1.0, simulated), "seed": seed}


def table(report: dict[str, Any]) -> str:
    """The rows (the model's per seed, averaged), then the calibration."""
    head = f"{'backend':<22} {'load':<9} {'mode':<10} {'TTFT p50':>8} {'TTFT p99':>8} {'TPOT p50':>8} "
    rows = [head + f"{'P idle':>6} {'idle s':>7} {'out tok/s':>9}"]
    for r in _by_mode(report):
        idle = "-" if r.get("idle_forward_s") is None else f"{r['idle_forward_s']:.2f}"
        rows.append(
            f"{r['backend']:<22} {r['load']:<9} {r['mode']:<10} {r['ttft_p50_s'] * 1000:>8.1f} "
            f"{r['ttft_p99_s'] * 1000:>8.1f} {r['tpot_p50_s'] * 1000:>8.2f} {r['prefill_idle_forward_ratio']:>6.3f} "
            f"{idle:>7} {r['output_throughput']:>9,.1f}"
        )
    costs = report["calibration"]["costs"]
    rows.append(
        "ms; P idle: idle forwards per prefill rank-step; idle s: seconds inside idle forwards (exchanges and "
        "experts' work for the others), every rank's added"
    )
    rows.append("calibrated: " + ", ".join(f"{k} {costs[k]:.3g}" for k in COSTS))
    return "\n".join(rows)


def _by_mode(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The process rows, and the model's rows averaged over seeds (one per load and mode)."""
    rows = [r for r in report["results"] if "seed" not in r]
    model: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in report["results"]:
        if "seed" in r:
            model.setdefault((r["load"], r["mode"]), []).append(r)
    for runs in model.values():
        numbers = {k: float(np.mean([r[k] for r in runs])) for k, v in runs[0].items() if isinstance(v, float)}
        rows.append({**runs[0], **numbers, "idle_forward_s": None})
    return rows


def plot(report: dict[str, Any], path: Path) -> None:
    """Staggered against naive (%), per load: TTFT p50, idle seconds (processes) and throughput,
    for the processes and for the calibrated model."""
    from splitbus.bench.report import _pyplot, _save

    plt = _pyplot()
    rows = _by_mode(report)
    by = {(r["backend"], r["load"], r["mode"]): r for r in rows}
    keys = sorted({(r["backend"], r["load"]) for r in rows}, key=lambda k: (k[0], list(LOAD_SHARES).index(k[1])))
    metrics = ("ttft_p50_s", "idle_forward_s", "prefill_idle_forward_ratio", "output_throughput")
    fig, axes = plt.subplots(len(metrics), 1, figsize=(max(8, len(keys) * 1.2), 3 * len(metrics)))
    for ax, metric in zip(axes, metrics, strict=True):
        change = [_change(by[k + ("staggered",)].get(metric), by[k + ("naive",)].get(metric)) for k in keys]
        good = [c < 0 if metric != "output_throughput" else c > 0 for c in change]
        ax.bar(range(len(change)), change, color=["#27ae60" if g else "#c0392b" for g in good])
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xticks(range(len(keys)), [f"{b}\n{load}" for b, load in keys], fontsize=7)
        ax.set_title(f"{metric}: staggered vs naive (%)", fontsize=9)
    ranks = report["ranks"]
    fig.suptitle(f"splitbus bench ep --engine paddle: {ranks}+{ranks} EP ranks, {report['model']}", fontsize=10)
    _save(plt, fig, path, dpi=100)


def _change(staggered: float | None, naive: float | None) -> float:
    """Staggered against naive in per cent (0 where a backend has no such figure)."""
    return 0.0 if staggered is None or naive is None else 100 * (staggered / max(naive, 1e-12) - 1)
