"""``splitbus bench planner``: fixed prefill:decode fleets against the planner's autoscaled one, on
the simulated fleet of ``planner_sim`` (costs of an 8B model on one H100, ``SimCosts``).

Every fixed fleet within the bound is run on each seed's trace, then the autoscaled one: the real
``splitbus.planner`` core (``Planner.step``) reads the simulated workers' counters every interval,
and its advice (counts and reasons) is acted on as ``up --autoscale`` acts on it, by its rule
(``splitbus.cli.autoscale.reconcile``): workers asked for start after the start delay; a fall the
planner measured drains one worker per role at a time, past its start grace, the least loaded
first. Each run starts from fresh state.

Reported per fleet, the seeds pooled: SLO attainment (the requests whose TTFT and mean ITL both
meet their targets; a refused request misses), worker-seconds (paid from the ask to the leave),
lost and duplicated requests; for the autoscaled fleet, how long after each rate step the
planner changed its counts and the fleet reached them. "The best fixed fleet for the average
load" is read two ways, and the targets (attainment at least the fixed fleet's, with at least 20 %
fewer worker-seconds) are judged against each: (a) the best P:D at the total the average load is
sized to (``sized_fleet``), (b) the smallest fixed fleet whose attainment is at least the
autoscaled one's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from splitbus.bench.planner_sim import (
    H100_8B,
    FleetSim,
    Registry,
    Request,
    Run,
    SimCosts,
    TraceConfig,
    TraceRequest,
    trace,
)
from splitbus.bus.planner import Advice
from splitbus.bus.roles import Role
from splitbus.planner.autoscale import Bounds

TARGET_SAVING = 0.2
"""The autoscaled fleet should use at least this share fewer worker-seconds than a fixed one."""


@dataclass(frozen=True)
class PlannerBenchConfig:
    """What ``bench planner`` runs."""

    trace: TraceConfig = field(default_factory=TraceConfig)
    costs: SimCosts = H100_8B
    ttft_slo_s: float = 0.5
    itl_slo_s: float = 0.02
    seeds: tuple[int, ...] = (1, 2, 3)
    interval_s: float = 5.0
    """The planner's interval, and the fleet's sampling period."""
    predictor: str = "last"
    min_workers: int = 1
    max_workers: int = 8
    """The autoscaled fleet's bounds, per role (``--autoscale MIN:MAX``)."""
    max_fleet: int = 10
    """Fixed fleets swept: every P:D with P, D >= 1, P + D <= this and D <= ``max_decode``."""
    max_decode: int = 4
    """Past what the trace's decode needs (1 to 2 workers at the costs' ITL), more decode workers only
    cost: bounded to keep the sweep's CPU time down (a fleet with too few prefill workers drains
    its backlog for minutes of simulated time, each decode worker stepping all along)."""

    def __post_init__(self) -> None:
        if self.ttft_slo_s <= 0 or self.itl_slo_s <= 0 or self.interval_s <= 0:
            raise ValueError("SLOs and the interval must be > 0")
        if not self.seeds:
            raise ValueError("at least one seed")
        self.bounds()  # MIN >= 1: the fleet keeps a worker of each role
        if self.max_fleet < 2 or self.max_decode < 1:
            raise ValueError("the fixed fleets need room for a prefill and a decode worker")

    def bounds(self) -> Bounds:
        """``--autoscale MIN:MAX`` as ``up`` takes it (a ValueError out of bounds)."""
        return Bounds(self.min_workers, self.max_workers)

    def fixed_fleets(self) -> list[tuple[int, int]]:
        return [
            (p, d) for p in range(1, self.max_fleet) for d in range(1, min(self.max_fleet - p, self.max_decode) + 1)
        ]


def sized_fleet(config: PlannerBenchConfig, rate: float) -> tuple[int, int]:
    """The (prefill, decode) workers a constant ``rate`` needs by arithmetic on the costs: P at 80 %
    busy on the trace's mean uncached prompt (its prefixes hit), D at the batch whose step meets
    90 % of the ITL target (or the KV cache's bound) by Little's law."""
    t, c = config.trace, config.costs
    long_share = (t.long_from + t.long_to) / 2
    prompt = t.short_tokens * (1 - long_share) + t.long_tokens * long_share
    uncached = prompt * (1 - t.shared * t.prefix_share)
    prefill = math.ceil(rate * c.prefill_s(uncached) / 0.8)
    by_itl = int((config.itl_slo_s * 0.9 - c.decode_step_s) / max(c.decode_s_per_seq, 1e-12))
    by_kv = int(0.9 * c.kv_blocks / math.ceil((prompt + t.output_mean) / c.block_size))
    batch = max(min(by_itl, by_kv, c.max_decode_batch), 1)
    decode = math.ceil(rate * t.output_mean * c.decode_s(batch) / batch)
    return max(prefill, 1), max(decode, 1)


def run_planner_bench(config: PlannerBenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    traces = {seed: trace(config.trace, seed) for seed in config.seeds}
    progress(
        f"{len(config.seeds)} seeds of {config.trace.duration_s:g} s, "
        f"{sum(map(len, traces.values())) // len(traces)} requests each; {len(config.fixed_fleets())} fixed fleets"
    )
    fixed = [_fixed(config, fleet, traces) for fleet in config.fixed_fleets()]
    progress(f"fixed fleets done; the autoscaled fleet ({config.min_workers}:{config.max_workers} per role)")
    predictors = {name: _autoscale_runs(replace(config, predictor=name), traces) for name in _predictors()}
    auto = predictors[config.predictor]
    average = sized_fleet(config, config.trace.mean_rate())
    return {
        "config": _config_row(config),
        "fixed": fixed,
        "autoscale": auto,
        "predictors": {name: _brief(run) for name, run in predictors.items()},
        "sized_for_average": {"prefill": average[0], "decode": average[1]},
        "comparisons": comparisons(fixed, auto, sum(average)),
    }


def _predictors() -> list[str]:
    from splitbus.planner.predictors import PREDICTORS

    return sorted(PREDICTORS)


def _autoscale_runs(config: PlannerBenchConfig, traces: dict[int, list[TraceRequest]]) -> dict[str, Any]:
    """The autoscaled fleet with ``config.predictor`` on every seed's trace."""
    planners = {seed: PlannerFleet(config) for seed in traces}
    runs = [_autoscaled(config, traces[seed], seed, planners[seed]) for seed in traces]
    return {
        "predictor": config.predictor,
        **summary(config, runs),
        "arrival_mape": arrival_mape([p.seen for p in planners.values()], config.trace.duration_s),
        "reaction": reactions(config, runs),
        "timeline": timeline(runs[0]),
    }


def _brief(auto: dict[str, Any]) -> dict[str, Any]:
    """A predictor's row: its fleet's figures without the timeline."""
    return {k: v for k, v in auto.items() if k != "timeline"}


def _config_row(config: PlannerBenchConfig) -> dict[str, Any]:
    return {
        **asdict(config),
        "seeds": list(config.seeds),
        "duration_s": config.trace.duration_s,
        "mean_rate": config.trace.mean_rate(),
    }


def _fixed(config: PlannerBenchConfig, fleet: tuple[int, int], traces: dict[int, Any]) -> dict[str, Any]:
    runs = [FleetSim(config.costs, fleet, None, config.interval_s, seed=seed).run(traces[seed]) for seed in traces]
    return {"prefill": fleet[0], "decode": fleet[1], **summary(config, runs)}


def _autoscaled(config: PlannerBenchConfig, requests: list[TraceRequest], seed: int, planner: PlannerFleet) -> Run:
    bounds = config.bounds()
    prefill, decode = (bounds.clamp(n) for n in sized_fleet(config, config.trace.rate))
    return FleetSim(config.costs, (prefill, decode), planner, config.interval_s, bounds, seed).run(requests)


class PlannerFleet:
    """The real planner as the fleet's controller: each interval the simulated registry (every
    worker's ``WorkerLoad``, the held requests) goes in as a ``Reading``, and the advice the
    planner would publish (its counts and their reasons, ``Advice``) comes out. Keeps each
    decision's measured and predicted arrivals."""

    def __init__(self, config: PlannerBenchConfig) -> None:
        from splitbus.planner.core import Planner, PlannerConfig

        self.planner = Planner(
            PlannerConfig(
                config.ttft_slo_s,
                config.itl_slo_s,
                interval_s=config.interval_s,
                predictor=config.predictor,
                start_delay_s=config.costs.start_delay_s,  # told as an operator would be: the fleet's own
                min_workers=config.min_workers,
                max_workers=config.max_workers,
            )
        )
        self.block_size = config.costs.block_size
        self.seen: list[tuple[float, float, float]] = []
        """(when, arrivals measured over the interval that ended then, arrivals predicted for the
        next), per second."""

    def __call__(self, registry: Registry) -> Advice:
        from splitbus.bus.records import Reserved
        from splitbus.planner.core import Reading, WorkerReading
        from splitbus.planner.service import advice

        workers = tuple(
            WorkerReading(wid, role.value, 1, self.block_size, load, Reserved()) for wid, role, load in registry.workers
        )
        decision = self.planner.step(Reading(registry.at_s, workers, 0, registry.held))
        self.seen.append((registry.at_s, decision.arrivals_rps, decision.predicted_rps))
        return advice(decision, self.planner.config)


def arrival_mape(seen: list[list[tuple[float, float, float]]], until: float) -> float | None:
    """How far each interval's prediction was from the arrivals then measured over the next, as a
    share of those (mean absolute percentage error), every seed's intervals pooled. Left out: the
    first decision, which measures nothing, and the intervals that end after ``until`` (the
    trace's end: the last requests drain, and a share of nearly nothing says nothing)."""
    errors = [
        abs(predicted - measured) / measured
        for one in seen
        for (_, _, predicted), (at, measured, _) in zip(one[1:], one[2:], strict=False)
        if measured > 0 and at <= until
    ]
    return float(np.mean(errors)) if errors else None


def summary(config: PlannerBenchConfig, runs: list[Run]) -> dict[str, Any]:
    """The seeds' requests pooled; worker-seconds the mean of the seeds'."""
    reqs = [r for run in runs for r in run.requests]
    return {
        "requests": len(reqs),
        "attainment": sum(met_slo(config, r) for r in reqs) / max(len(reqs), 1),
        "attainment_by_phase": by_phase(config, reqs),
        "worker_seconds": float(np.mean([run.worker_seconds() for run in runs])),
        "worker_seconds_by_role": {
            role.value: float(np.mean([run.worker_seconds(role) for run in runs]))
            for role in (Role.PREFILL, Role.DECODE)
        },
        "ttft_p99_s": _p99([r.ttft_s() for r in reqs]),
        "itl_p99_s": _p99([r.itl_s() for r in reqs]),
        **outcomes(reqs),
    }


def by_phase(config: PlannerBenchConfig, reqs: list[Request]) -> list[float | None]:
    """Attainment of the requests that arrived in each third (low, peak, low)."""
    phase = config.trace.phase_s
    thirds = [[r for r in reqs if k * phase <= r.trace.arrival_s < (k + 1) * phase] for k in range(3)]
    return [sum(met_slo(config, r) for r in third) / len(third) if third else None for third in thirds]


def outcomes(reqs: list[Request]) -> dict[str, int]:
    """Refused; lost (never ended: neither finished nor refused); duplicated (ended twice or more)."""
    return {
        "refused": sum(r.refused for r in reqs),
        "lost": sum(r.ends == 0 for r in reqs),
        "duplicated": sum(r.ends > 1 for r in reqs),
    }


def met_slo(config: PlannerBenchConfig, req: Request) -> bool:
    """Served once, its TTFT and its mean ITL within their targets."""
    served = req.ends == 1 and not req.refused
    return served and _within(req.ttft_s(), config.ttft_slo_s) and _within(req.itl_s(), config.itl_slo_s)


def _within(value: float | None, bound: float) -> bool:
    return value is not None and value <= bound


def _p99(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(np.percentile(known, 99)) if known else None


def reactions(config: PlannerBenchConfig, runs: list[Run]) -> dict[str, Any]:
    """After each rate step: when the planner's counts first moved the step's way, and when the
    serving fleet first matched them; the mean over the seeds (None where it never did)."""
    steps = {"up": config.trace.phase_s, "down": 2 * config.trace.phase_s}
    return {name: _reaction(runs, at, 1 if name == "up" else -1) for name, at in steps.items()}


def _reaction(runs: list[Run], at: float, sign: int) -> dict[str, Any]:
    found = [_react(run, at, sign) for run in runs]
    planner = [p for p, _ in found if p is not None]
    fleet = [f for _, f in found if f is not None]
    return {
        "planner_s": float(np.mean(planner)) if planner else None,
        "fleet_s": float(np.mean(fleet)) if fleet else None,
        "by_seed": [{"planner_s": p, "fleet_s": f} for p, f in found],
    }


def _react(run: Run, at: float, sign: int) -> tuple[float | None, float | None]:
    decided = [(s.t_s, (s.prefill, s.decode), s.desired) for s in run.samples if s.desired is not None]
    before = [d for t, _, d in decided if t <= at]
    after = decided[len(before) :]
    moved = _first([_moved(before[-1], d, sign) for _, _, d in after]) if before else None
    if moved is None:
        return None, None
    reached = _first([serving == d for _, serving, d in after[moved:]])
    return after[moved][0] - at, None if reached is None else after[moved + reached][0] - at


def _first(flags: list[bool]) -> int | None:
    return flags.index(True) if True in flags else None


def _moved(before: tuple[int, int], now: tuple[int, int], sign: int) -> bool:
    return any((n - b) * sign > 0 for b, n in zip(before, now, strict=True))


def timeline(run: Run) -> list[dict[str, Any]]:
    """One seed's samples: arrivals, the counts serving, starting, draining, desired."""
    return [
        {
            "t_s": s.t_s,
            "arrivals_rps": s.arrivals_rps,
            "prefill": s.prefill,
            "decode": s.decode,
            "starting": list(s.starting),
            "draining": list(s.draining),
            "desired": None if s.desired is None else list(s.desired),
        }
        for s in run.samples
    ]


def comparisons(fixed: list[dict[str, Any]], auto: dict[str, Any], average_total: int) -> dict[str, Any]:
    """The targets against (a) the best P:D at the average load's total and (b) the smallest fixed
    fleet at least as good as the autoscaled one (None where no fixed fleet is)."""
    at_total = [f for f in fixed if f["prefill"] + f["decode"] == average_total]
    matching = [f for f in fixed if f["attainment"] >= auto["attainment"]]
    best = max(at_total, key=lambda f: (f["attainment"], -f["worker_seconds"]), default=None)
    smallest = min(matching, key=lambda f: (f["worker_seconds"], -f["attainment"]), default=None)
    return {"average_sized": _versus(best, auto), "smallest_matching": _versus(smallest, auto)}


def _versus(fleet: dict[str, Any] | None, auto: dict[str, Any]) -> dict[str, Any] | None:
    if fleet is None:
        return None
    saving = 1 - auto["worker_seconds"] / fleet["worker_seconds"]
    attainment_met = auto["attainment"] >= fleet["attainment"]
    return {
        "fleet": f"{fleet['prefill']}:{fleet['decode']}",
        "attainment": fleet["attainment"],
        "worker_seconds": fleet["worker_seconds"],
        "saving": saving,
        "attainment_met": attainment_met,
        "saving_met": saving >= TARGET_SAVING,
        "met": attainment_met and saving >= TARGET_SAVING,
    }


def table(report: dict[str, Any]) -> str:
    cfg, auto = report["config"], report["autoscale"]
    lines = [
        f"bench planner: {len(cfg['seeds'])} seeds of {cfg['duration_s']:g} s, mean {cfg['mean_rate']:.1f} req/s "
        f"(x{cfg['trace']['peak']:g} in the middle third); TTFT <= {cfg['ttft_slo_s'] * 1000:g} ms, "
        f"ITL <= {cfg['itl_slo_s'] * 1000:g} ms",
        f"{'fleet':<10} {'attain':>7} {'worker-s':>9} {'TTFT p99':>9} {'ITL p99':>8} {'refused':>7} {'lost':>4} "
        f"{'dup':>4}  attainment by third",
    ]
    rows = [(f"{f['prefill']}:{f['decode']}", f) for f in report["fixed"]]
    rows += [(f"auto {name}", f) for name, f in report["predictors"].items()]
    lines += [_row(name, f) for name, f in rows]
    lines += [
        f"predictor {name}: next-interval arrivals off by {_pct(f['arrival_mape'])} (MAPE); "
        + _reaction_text(f["reaction"])
        for name, f in report["predictors"].items()
    ]
    lines.append(f"autoscale = auto {auto['predictor']}; its fleet against the best fixed one, read two ways:")
    labels = {"average_sized": "(a) best P:D at the average's total", "smallest_matching": "(b) smallest as good"}
    return "\n".join(lines + [_versus_line(labels[k], v, auto) for k, v in report["comparisons"].items()])


def _versus_line(label: str, v: dict[str, Any] | None, auto: dict[str, Any]) -> str:
    from splitbus.bench.report import _met

    if v is None:
        return f"{label}: no fixed fleet"
    return (
        f"{label} {v['fleet']}: attainment {v['attainment']:.2%} vs {auto['attainment']:.2%} "
        f"({_met(v['attainment_met'])}); worker-seconds {v['saving']:+.1%} fewer ({_met(v['saving_met'])})"
    )


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _row(name: str, f: dict[str, Any]) -> str:
    thirds = " / ".join(_pct(a) for a in f["attainment_by_phase"])
    return (
        f"{name:<10} {f['attainment']:>7.2%} {f['worker_seconds']:>9,.0f} {_ms(f['ttft_p99_s']):>9} "
        f"{_ms(f['itl_p99_s']):>8} {f['refused']:>7} {f['lost']:>4} {f['duplicated']:>4}  {thirds}"
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def _reaction_text(reaction: dict[str, Any]) -> str:
    parts = [f"{k}: planner {_s(v['planner_s'])}, fleet {_s(v['fleet_s'])}" for k, v in reaction.items()]
    return "after the rate steps (mean of seeds) " + "; ".join(parts)


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.0f} s"


def plot(report: dict[str, Any], path: Path) -> None:
    from splitbus.bench.report import _pyplot, _save

    plt = _pyplot()
    fig, (fleet, scatter) = plt.subplots(1, 2, figsize=(13, 4.5))
    _timeline_plot(fleet, report["autoscale"]["timeline"])
    _fleets_plot(scatter, report)
    fig.suptitle("splitbus bench planner: the planner's autoscaled fleet vs fixed P:D fleets (simulated)", fontsize=10)
    _save(plt, fig, path, dpi=100)


def _timeline_plot(ax: Any, samples: list[dict[str, Any]]) -> None:
    t = [s["t_s"] for s in samples]
    for i, (role, color) in enumerate((("prefill", "#8e44ad"), ("decode", "#16a085"))):
        ax.step(t, [s[role] for s in samples], where="post", color=color, label=f"{role} serving")
        desired = [s["desired"][i] if s["desired"] else None for s in samples]
        ax.step(t, desired, where="post", color=color, linestyle="--", label=f"{role} desired")
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("workers")
    rate = ax.twinx()
    rate.plot(t, [s["arrivals_rps"] for s in samples], color="#7f8c8d", alpha=0.5, label="arrivals/s")
    rate.set_ylabel("arrivals per second")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title("autoscaled fleet (first seed)")


def _fleets_plot(ax: Any, report: dict[str, Any]) -> None:
    fixed = report["fixed"]
    ax.scatter(
        [f["worker_seconds"] for f in fixed], [f["attainment"] for f in fixed], color="#2980b9", label="fixed P:D"
    )
    for f in fixed:
        ax.annotate(f"{f['prefill']}:{f['decode']}", (f["worker_seconds"], f["attainment"]), fontsize=6)
    colors = ("#c0392b", "#e67e22", "#27ae60", "#8e44ad")
    for (name, auto), color in zip(report["predictors"].items(), colors, strict=False):  # more names: fewer colors
        ax.scatter([auto["worker_seconds"]], [auto["attainment"]], color=color, marker="*", s=150, label=f"auto {name}")
    ax.set_xlabel("worker-seconds (mean of seeds)")
    ax.set_ylabel("SLO attainment")
    ax.legend(fontsize=8)
    ax.set_title("attainment vs cost")
