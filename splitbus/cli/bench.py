"""``splitbus bench bus|engine|stagger|ep|serve|scheduler|api|routing|grammar|choices|tenants|planner|client``: each
prints a table and writes JSON + PNG."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from splitbus.cli.common import say
from splitbus.env import Env
from splitbus.masking import mask_text, mask_url
from splitbus.redis_server import EmbeddedRedis

if TYPE_CHECKING:
    from splitbus.bench.planner import PlannerBenchConfig
    from splitbus.bench.serve_trace import ServeConfig, Workload

C = TypeVar("C")


def add_parser(subparsers: argparse._SubParsersAction, env: Env) -> None:
    p = subparsers.add_parser("bench", help="benchmarks (table, JSON and PNG)")
    kinds = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    adders = (
        _add_bus,
        _add_engine,
        _add_stagger,
        _add_ep,
        _add_serve,
        _add_scheduler,
        _add_api,
        _add_routing,
        _add_grammar,
        _add_choices,
        _add_tenants,
        _add_planner,
        _add_client,
    )
    for add in adders:
        add(kinds, env)


def _add_bus(kinds: argparse._SubParsersAction, env: Env) -> None:
    bus = kinds.add_parser("bus", help="Redis Streams vs a ZeroMQ baseline: request and token paths")
    bus.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default %(default)s)")
    bus.add_argument("--redis-url", default=env.redis_url, help="measure this Redis (default: start an embedded one)")
    bus.add_argument("--repeat", type=int, default=3, help="runs per measurement; medians are reported")
    bus.add_argument("--streams", type=int, default=1000, help="concurrent result streams (token path)")
    bus.add_argument("--quick", action="store_true", help="small counts, one run: checks that it works")
    bus.add_argument(
        "--redis-cluster",
        type=int,
        default=0,
        metavar="N",
        help=(
            "instead: the token path on one Redis vs an embedded cluster of N primaries (a replica each), "
            "both started here (--redis-url unused); writes bench_bus_cluster.json/png"
        ),
    )
    bus.add_argument("--api-nodes", type=int, default=3, help="with --redis-cluster: API processes (reader tags)")
    bus.add_argument("--steps", type=int, default=40, help="with --redis-cluster: engine steps per run")
    bus.add_argument(
        "--engines",
        type=int,
        default=1,
        metavar="E",
        help="with --redis-cluster: writer processes, the streams split among them, started together (default 1)",
    )
    bus.set_defaults(run=run_bus)


def _add_engine(kinds: argparse._SubParsersAction, env: Env) -> None:
    engine = kinds.add_parser("engine", help="paddle engine: prefill and decode tokens/s, KV export/import GB/s")
    engine.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default %(default)s)")
    engine.add_argument(
        "--models",
        nargs="+",
        choices=("tiny", "qwen2.5-0.5b-shape"),
        default=None,
        help="random models to measure (default: both, unless --model is given)",
    )
    engine.add_argument(
        "--model",
        type=Path,
        action="append",
        default=[],
        metavar="PATH",
        help="a real model to measure: Hugging Face folder or .gguf file (repeatable)",
    )
    engine.add_argument(
        "--served-model-name", default=None, help="its name in the table (default: a .gguf file's stem, or the folder)"
    )
    engine.add_argument(
        "--data-dir",
        type=Path,
        default=env.data_dir,
        help="where a .gguf file's converted folder is cached (default: SPLITBUS_DATA_DIR, else .splitbus)",
    )
    engine.add_argument("--runs", type=int, default=3, help="timed runs per figure; the fastest is reported")
    engine.add_argument(
        "--prefill-batches",
        type=int,
        nargs="+",
        default=[1],
        metavar="N",
        help="128-token prompts per timed prefill forward, 1-32 (default 1; e.g. 1 8 32)",
    )
    engine.add_argument(
        "--long-prompt",
        type=int,
        default=4096,
        metavar="N",
        help="also prefill one N-token prompt in a child process: its time and peak memory "
        "(default %(default)s; 0: skip)",
    )
    engine.add_argument(
        "--vs-transformers",
        action="store_true",
        help="also run the same weights in Hugging Face transformers (torch CPU, one thread): pip install "
        "'splitbus[bench-hf]'",
    )
    engine.set_defaults(run=run_engine)


def _add_stagger(kinds: argparse._SubParsersAction, env: Env) -> None:
    stagger = kinds.add_parser("stagger", help="naive vs staggered DP batching: rank processes and a simulation")
    stagger.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default %(default)s)")
    stagger.add_argument("--sim-ranks", type=int, nargs="*", default=[8, 16, 64], help="simulated group sizes")
    stagger.add_argument("--process-ranks", type=int, default=4, help="rank processes (0: skip)")
    stagger.add_argument("--duration", type=float, default=6.0, help="seconds of arrivals per simulated trace")
    stagger.add_argument(
        "--process-duration", type=float, default=10.0, help="seconds of arrivals per trace sent to the rank processes"
    )
    stagger.add_argument("--seed", type=int, default=1)
    stagger.add_argument(
        "--process-repeats",
        type=int,
        default=3,
        help="runs of each trace per mode on the rank processes; TTFTs are pooled (default %(default)s)",
    )
    stagger.set_defaults(run=run_stagger)


def _add_ep(kinds: argparse._SubParsersAction, env: Env) -> None:
    ep = kinds.add_parser("ep", help="EP + PD: naive vs staggered prefill groups with decode groups")
    ep.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default %(default)s)")
    ep.add_argument(
        "--backend", choices=("simulation", "processes", "both"), default="both", help="what to run (default both)"
    )
    ep.add_argument("--sim-ranks", type=int, nargs="+", default=[8, 16, 64], help="simulated group sizes (P and D)")
    ep.add_argument("--process-ranks", type=int, default=4, help="ranks of the prefill group and of the decode group")
    ep.add_argument("--loads", nargs="+", choices=("low", "moderate", "high"), default=["low", "moderate", "high"])
    ep.add_argument("--duration", type=float, default=6.0, help="seconds of arrivals per simulated trace")
    ep.add_argument(
        "--process-duration", type=float, default=10.0, help="seconds of arrivals per trace sent to the processes"
    )
    ep.add_argument("--runs", type=int, default=3, help="runs per mode on the processes, pooled (default %(default)s)")
    ep.add_argument("--seed", type=int, default=1)
    ep.add_argument(
        "--engine",
        choices=("sim", "paddle"),
        default="sim",
        help="paddle: real MoE compute with --ep (processes, --runs seeds) and the sim's model calibrated from it",
    )
    ep.add_argument(
        "--stagger-max-wait-ms",
        type=float,
        default=None,
        help="the stagger window's bound, scaled with the processes' costs (default: the scheduler's default)",
    )
    ep.set_defaults(run=run_ep)


def _add_serve(kinds: argparse._SubParsersAction, env: Env) -> None:
    serve = kinds.add_parser(
        "serve", help="Poisson arrivals against the HTTP API: TTFT, ITL, E2E latency, throughput (vLLM's field names)"
    )
    serve.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default %(default)s)")
    serve.add_argument(
        "--base-url",
        default=None,
        help=(
            "measure this deployment "
            "(default: start splitbus up --engine sim and compare it with the engine driven directly)"
        ),
    )
    serve.add_argument("--api-key", default="", help="Bearer key for --base-url")
    serve.add_argument(
        "--redis-url",
        default=None,
        help="--base-url's Redis, whose memory (INFO memory) is reported; a user allowed INFO (default: "
        "SPLITBUS_REDIS_URL, else the admin of the embedded Redis in --data-dir)",
    )
    serve.add_argument("--data-dir", type=Path, default=env.data_dir, help="splitbus up's data folder")
    serve.add_argument("--model", default="tiny", help="served model name (default %(default)s)")
    serve.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[10.0, 25.0, 50.0],
        help="requests/s, one run each; inf: all at once (not used by --vs-direct-http)",
    )
    serve.add_argument("--num-prompts", type=int, default=200, help="requests per run (default %(default)s)")
    serve.add_argument(
        "--max-concurrency",
        type=int,
        default=512,
        help="requests in flight at most (default %(default)s; --vs-direct-http uses its own levels)",
    )
    serve.add_argument("--input-len", type=int, default=128, help="mean prompt tokens (default %(default)s)")
    serve.add_argument("--output-len", type=int, default=64, help="mean output tokens (default %(default)s)")
    serve.add_argument(
        "--range-ratio", type=float, default=0.5, help="lengths uniform in len*(1±ratio) (default %(default)s)"
    )
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument(
        "--vs-direct-http",
        type=int,
        nargs="*",
        default=None,
        metavar="C",
        help="compare splitbus with the sim engine behind its own OpenAI HTTP server, all requests at once, "
        "at each max concurrency C (default 1 16 64); --request-rate and --max-concurrency are not used, "
        "and --dataset trace is refused (its arrival times are its point)",
    )
    _add_serve_workloads(serve)
    serve.set_defaults(run=run_serve)


def _add_serve_workloads(serve: argparse.ArgumentParser) -> None:
    """``bench serve``'s ``--dataset`` and its settings, ``--goodput`` and ``--policy``."""
    serve.add_argument(
        "--dataset",
        nargs="+",
        default=["random"],
        metavar="KIND",
        help="random (default), prefix, multiturn, or trace FILE (a Mooncake JSONL trace)",
    )
    add = serve.add_argument
    add("--prefix-groups", type=int, default=8, help="prefix: groups, each with its own prefix (default %(default)s)")
    add("--prefix-len", type=int, default=512, help="prefix: shared prefix tokens per group (default %(default)s)")
    add("--questions-per-group", type=int, default=8, help="prefix: requests per group (default %(default)s)")
    add("--question-len", type=int, default=64, help="prefix: tokens of each question (default %(default)s)")
    add("--conversations", type=int, default=8, help="multiturn: conversations (default %(default)s)")
    add("--turns", type=int, default=4, help="multiturn: turns per conversation (default %(default)s)")
    add("--turn-len", type=int, default=64, help="multiturn: new prompt tokens per turn (default %(default)s)")
    add("--system-len", type=int, default=0, help="multiturn: system prompt tokens before turn 1 (default 0)")
    add("--time-scale", type=float, default=1.0, help="trace: arrival times × this (default %(default)s)")
    add("--block-size", type=int, default=16, help="KV block tokens for the ideal hit ratio (default %(default)s)")
    add("--goodput", nargs="+", default=[], metavar="METRIC:MS", help="bounds: ttft:MS tpot:MS e2el:MS")
    add(
        "--policy",
        default="",
        help="compare scheduler policies, MODE[:ARG...] comma-separated, one splitbus up each (sim engine)",
    )
    add("--up-arg", action="append", default=[], help="with --policy: an argument for splitbus up (repeatable)")
    add(
        "--dispatch",
        default="scheduler",
        help="who places requests in the stack, comma-separated, one splitbus up each, side by side: scheduler, api"
        " (default %(default)s)",
    )


def _add_scheduler(kinds: argparse._SubParsersAction, env: Env) -> None:
    sched = kinds.add_parser(
        "scheduler", help="scheduler processes placing on many registered sim workers: latency and decisions/s"
    )
    sched.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default %(default)s)")
    sched.add_argument("--redis-url", default=env.redis_url, help="measure this Redis (default: start an embedded one)")
    sched.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[64],
        help="registered workers, half prefill, half decode; one run per count and setting (default 64)",
    )
    sched.add_argument(
        "--replicas", type=int, nargs="*", default=[1, 2], help="scheduler processes, one run each (default 1 2)"
    )
    sched.add_argument(
        "--api-dispatchers",
        type=int,
        nargs="*",
        default=[],
        help="API processes placing requests themselves (splitbus api --dispatch api), one run each (default none)",
    )
    sched.add_argument("--rate", type=float, default=500.0, help="paced arrivals, requests/s (default %(default)s)")
    sched.add_argument("--paced-requests", type=int, default=5000)
    sched.add_argument("--flood-requests", type=int, default=20000)
    sched.add_argument(
        "--decisions",
        type=int,
        default=20000,
        help="in-process decisions timed per worker count, columns vs rows (0: skip; default %(default)s)",
    )
    sched.set_defaults(run=run_scheduler)


def _add_api(kinds: argparse._SubParsersAction, env: Env) -> None:
    api = kinds.add_parser(
        "api", help="many concurrent streams through one API (N processes): tokens/s, resets, Redis connections"
    )
    api.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default %(default)s)")
    api.add_argument("--redis-url", default=env.redis_url, help="measure this Redis (default: start an embedded one)")
    api.add_argument("--streams", type=int, default=1000, help="concurrent streaming requests (default %(default)s)")
    api.add_argument("--tokens", type=int, default=256, help="tokens per stream (default %(default)s)")
    api.add_argument(
        "--step-ms", type=float, default=20.0, help="a token per stream every this many ms (default %(default)s)"
    )
    api.add_argument(
        "--client-processes", type=int, default=2, help="processes holding the streams (default %(default)s)"
    )
    api.add_argument(
        "--api-workers",
        type=int,
        nargs="+",
        default=[1],
        metavar="N",
        help="the API's processes (splitbus api --workers N): one run per N, e.g. 1 2 4 $(nproc) (default 1)",
    )
    api.set_defaults(run=run_api)


def _add_routing(kinds: argparse._SubParsersAction, env: Env) -> None:
    routing = kinds.add_parser(
        "routing", help="the KV index: scoring latency, event ingest, hit ratio after lost events (simulated)"
    )
    add = routing.add_argument
    add("--out", type=Path, default=Path("bench-results"), help="output folder (default %(default)s)")
    add("--workers", type=int, default=16, help="workers in the index, scoring and ingest (default %(default)s)")
    add("--prompt-tokens", type=int, default=16384, help="scoring: the prompt's tokens (default %(default)s)")
    add(
        "--repeat",
        type=int,
        default=3,
        help="runs of each scoring and ingest measurement: scoring pools them, ingest reports the median (default 3)",
    )
    add("--seed", type=int, default=1, help="the prompt, the loads and the first simulated seed (default 1)")
    add("--seeds", type=int, default=10, help="recovery: simulated seeds, pooled (default %(default)s)")
    add("--quick", action="store_true", help="small counts, one run, one short simulation: checks that it works")
    routing.set_defaults(run=run_routing)


def _add_grammar(kinds: argparse._SubParsersAction, env: Env) -> None:
    grammar = kinds.add_parser("grammar", help="structured output: a worker's cost per token (mask, apply, advance)")
    add = grammar.add_argument
    add("--model", type=Path, required=True, help="model folder or .gguf file whose vocabulary is measured")
    add("--data-dir", type=Path, default=env.data_dir, help="where a .gguf file is converted (default %(default)s)")
    add("--out", type=Path, default=Path("bench-results"), help="output folder (default %(default)s)")
    add("--runs", type=int, default=20, help="runs of each workload (default %(default)s)")
    add(
        "--batches",
        type=int,
        nargs="*",
        default=[8, 32],
        metavar="B",
        help="decode batch sizes at which one constrained request is set beside unconstrained ones, "
        "on the paddle engine (default 8 32; none: skip)",
    )
    add("--batch-runs", type=int, default=3, help="runs at each batch size, fresh batches each (default %(default)s)")
    add("--batch-steps", type=int, default=8, help="timed step pairs in each batch run (default %(default)s)")
    grammar.set_defaults(run=run_grammar)


def _add_choices(kinds: argparse._SubParsersAction, env: Env) -> None:
    choices = kinds.add_parser(
        "choices", help="n > 1: one request of n choices vs n requests of one, side by side (P's prefills, wall time)"
    )
    add = choices.add_argument
    add("--model", type=Path, default=None, help="model folder or .gguf file (default: up's tiny random model)")
    add("--data-dir", type=Path, default=env.data_dir, help="where a .gguf file is converted (default %(default)s)")
    add("--out", type=Path, default=Path("bench-results"), help="output folder (default %(default)s)")
    add("--n", type=int, default=4, help="choices of (a)'s response, requests of (b)'s (default %(default)s)")
    add("--pairs", type=int, default=10, help="measured pairs, one response of each side (default %(default)s)")
    add("--prompt-tokens", type=int, default=256, help="tokens of every prompt (default %(default)s)")
    add("--max-tokens", type=int, default=1, help="tokens of each choice; 1: it ends on P (default %(default)s)")
    add("--seed", type=int, default=0, help="seeds the prompts and the sampling (default %(default)s)")
    add("--engine", choices=("paddle", "sim"), default="paddle", help="up's worker engine (default %(default)s)")
    choices.set_defaults(run=run_choices)


def _add_tenants(kinds: argparse._SubParsersAction, env: Env) -> None:
    tenants = kinds.add_parser(
        "tenants", help="one tenant flooding beside two steady ones: limits on vs off, each tenant's TTFT and refusals"
    )
    add = tenants.add_argument
    add("--out", type=Path, default=Path("bench-results"), help="output folder (default %(default)s)")
    add("--duration", type=float, default=30.0, help="seconds of arrivals in each of the 5 runs (default %(default)s)")
    add("--prompt-tokens", type=int, default=256, help="tokens of every prompt (default %(default)s)")
    add("--output-tokens", type=int, default=16, help="max_tokens of every request (default %(default)s)")
    add(
        "--prefill-us-per-token",
        type=float,
        default=400.0,
        help="the sim engine's prefill cost, which sets the fleet's capacity (default %(default)s)",
    )
    add("--flood", type=float, default=5.0, help="a's rate, times the capacity (default %(default)s)")
    add("--steady", type=float, default=0.3, help="b's and c's rates, each, times the capacity (default %(default)s)")
    add("--a-rps", type=float, default=0.1, help="a's rps limit, times the capacity (default %(default)s)")
    add(
        "--queued-prefill-tokens",
        type=int,
        default=512,
        help="the scheduler's --max-queued-prefill-tokens, in every run (0: no bound; default %(default)s)",
    )
    add(
        "--prefill-batch-tokens",
        type=int,
        default=256,
        help="the workers' --max-prefill-tokens, in every run (0: their default; default %(default)s)",
    )
    add("--request-timeout", type=float, default=10.0, help="the fleet's --request-timeout (default %(default)s)")
    add("--seed", type=int, default=0, help="seeds the arrivals and the prompts (default %(default)s)")
    tenants.set_defaults(run=run_tenants)


def _add_planner(kinds: argparse._SubParsersAction, env: Env) -> None:
    from splitbus.planner.autoscale import Bounds
    from splitbus.planner.predictors import PREDICTORS

    planner = kinds.add_parser(
        "planner", help="fixed P:D fleets vs the planner's autoscaled one on a 3x rate step (simulated 8B on H100)"
    )
    add = planner.add_argument
    add("--out", type=Path, default=Path("bench-results"), help="output folder (default %(default)s)")
    add("--rate", type=float, default=20.0, help="arrivals/s of the first and last thirds (default %(default)s)")
    add("--peak", type=float, default=3.0, help="the middle third's rate, times --rate (default %(default)s)")
    add("--phase-s", type=float, default=300.0, help="seconds of each third (default %(default)s)")
    add("--ttft-slo-ms", type=float, default=500.0, help="TTFT target (default %(default)s)")
    add("--itl-slo-ms", type=float, default=20.0, help="mean ITL target of each request (default %(default)s)")
    add("--interval-s", type=float, default=5.0, help="the planner's interval (default %(default)s)")
    add("--predictor", choices=sorted(PREDICTORS), default="last", help="the planner's (default %(default)s)")
    add(
        "--autoscale",
        type=Bounds.parse,
        default="1:8",
        metavar="MIN:MAX",
        help="workers of each role, as up --autoscale takes them (default %(default)s)",
    )
    add("--max-fleet", type=int, default=10, help="fixed fleets swept: every P:D with P + D <= this (default 10)")
    add("--max-decode", type=int, default=4, help="... and D <= this (default %(default)s)")
    add("--start-delay-s", type=float, default=30.0, help="from a worker's ask to serving (default %(default)s)")
    add("--seeds", type=int, default=3, help="seeded traces, each run on every fleet (default %(default)s)")
    add("--seed", type=int, default=1, help="the first seed (default %(default)s)")
    planner.set_defaults(run=run_planner)


def _add_client(kinds: argparse._SubParsersAction, env: Env) -> None:
    client = kinds.add_parser(
        "client", help="the bus's hot Redis operations through each Redis client (redis-py, valkey-glide), side by side"
    )
    add = client.add_argument
    add("--out", type=Path, default=Path("bench-results"), help="output folder (default %(default)s)")
    add(
        "--redis-url",
        default=None,
        help="measure this Redis, idle: the wakes count its blocked clients, so another client blocking there "
        "spoils them; its user may run INFO (default: start an embedded one)",
    )
    add("--rounds", type=int, default=5, help="rounds, every client in each (default %(default)s)")
    add("--calls", type=int, default=2000, help="timed calls of each operation a round (default %(default)s)")
    add("--wakes", type=int, default=200, help="timed wake-ups of each read kind a round (default %(default)s)")
    add("--pipeline", type=int, default=32, help="XADDs in one pipeline (default %(default)s)")
    add("--step-streams", type=int, default=8, help="result streams one write_step call writes (default %(default)s)")
    add(
        "--clients",
        nargs="+",
        default=["bus-connect", "bus-settings", "redis-py", "redis-py-pure", "glide"],
        metavar="CLIENT",
        help="some of bus-connect (redis-py as the bus connects), bus-settings (the same on redis-py's default pool), "
        "redis-py (bare), redis-py-pure (its Python parser), glide (valkey-glide, where importable); default: all",
    )
    add(
        "--glide-path",
        type=Path,
        default=None,
        help="a folder valkey-glide was installed into (pip install --target), searched after the environment's own",
    )
    add("--quick", action="store_true", help="one small round: checks that it works")
    client.set_defaults(run=run_client)


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[str]:
    if url:
        _check_reachable(url)
        yield url
        return
    with (
        tempfile.TemporaryDirectory(prefix="splitbus-bench-") as data,
        EmbeddedRedis(Path(data), appendonly=False) as server,
    ):
        yield server.admin_url  # the api bench counts connections with CLIENT LIST, which the splitbus user lacks


def _check_reachable(url: str) -> None:
    """A clear message and exit status 2 for a --redis-url that does not answer, not a traceback."""
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        say(f"splitbus bench: cannot reach Redis at {mask_url(url)}: {mask_text(str(exc))}")
        raise SystemExit(2) from None
    finally:
        client.close()


def _config(kind: str, build: Callable[[], C]) -> C | None:
    """A benchmark's config from its options, or None once the reason they are invalid is said."""
    try:
        return build()
    except ValueError as exc:
        say(f"splitbus bench {kind}: {exc}")
        return None


class _Run:
    """Progress lines stamped with the elapsed time, and the common end of every benchmark:
    machine facts, JSON, PNG, the table, where the files went."""

    def __init__(self, name: str, out: Path) -> None:
        self.name, self.out = name, out
        self.started = time.monotonic()

    def progress(self, line: str) -> None:
        say(f"[{time.monotonic() - self.started:5.1f}s] {line}")

    def finish(
        self,
        result: dict[str, Any],
        plot: Callable[[dict[str, Any], Path], None],
        table: Callable[[dict[str, Any]], str],
    ) -> int:
        from splitbus.bench import report

        result["machine"] = report.machine()
        json_path, png_path = self.out / f"bench_{self.name}.json", self.out / f"bench_{self.name}.png"
        report.write_json(result, json_path)
        plot(result, png_path)
        say(table(result))
        say(f"wrote {json_path} and {png_path} in {time.monotonic() - self.started:.0f}s")
        return 0


def run_bus(args: argparse.Namespace, env: Env) -> int:
    from splitbus.bench import report
    from splitbus.bench.bus import BusBenchConfig, run_bus_bench

    if args.redis_cluster:
        return run_bus_cluster(args)
    if args.engines != 1:  # the plain token path has one producer: say so rather than ignore it
        say("splitbus bench bus: --engines needs --redis-cluster N")
        return 2
    cfg = BusBenchConfig(repeat=args.repeat, streams=args.streams)
    if args.quick:
        cfg = BusBenchConfig(
            requests=500, paced_requests=200, streams=min(args.streams, 50), steps=5, paced_steps=5, repeat=1
        )
    run = _Run("bus", args.out)
    with _redis(args.redis_url) as url:
        result = run_bus_bench(url, cfg, progress=run.progress)
    result["redis"] = "external" if args.redis_url else "embedded"
    return run.finish(result, report.bus_plot, report.bus_table)


def run_bus_cluster(args: argparse.Namespace) -> int:
    """``bench bus --redis-cluster N``: its own servers (one Redis, then a cluster), its own files."""
    from splitbus.bench import report
    from splitbus.bench.bus_cluster import ClusterBenchConfig, run_cluster_bench

    streams, steps, repeat = (min(args.streams, 30), 3, 1) if args.quick else (args.streams, args.steps, args.repeat)
    config = _config(
        "bus", lambda: ClusterBenchConfig(args.redis_cluster, streams, steps, args.api_nodes, repeat, args.engines)
    )
    if config is None:
        return 2
    run = _Run("bus_cluster", args.out)
    result = run_cluster_bench(config, progress=run.progress)
    return run.finish(result, report.bus_cluster_plot, _bus_cluster_table)


def _bus_cluster_table(result: dict[str, Any]) -> str:
    """The cluster table, and what the cluster carries over one Redis with the same writers."""
    from splitbus.bench import report

    config = result["config"]
    return (
        f"{report.bus_cluster_table(result)}\n{config['engines']} writer process(es) on every setup: placed tags "
        f"on {config['primaries']} primaries carry {result['placed_over_one_primary']:.2f}x one primary's tokens/s"
    )


def run_engine(args: argparse.Namespace, env: Env) -> int:
    from splitbus.gpu_ops import device

    device.prepare(1)
    from splitbus.bench import report
    from splitbus.bench.engine import Extras, run_engine_bench
    from splitbus.bench.engine_hf import MissingTransformers

    problem = _engine_args_problem(args)
    if problem:
        say(f"splitbus bench engine: {problem}")
        return 2
    try:
        folders = _engine_folders(args)
    except ValueError as exc:  # ModelFilesError among them: the path, and what is wrong with it
        say(f"splitbus bench engine: {exc}")
        return 2
    randoms = args.models if args.models is not None else ([] if args.model else ["tiny", "qwen2.5-0.5b-shape"])
    run = _Run("engine", args.out)
    batches = list(dict.fromkeys(args.prefill_batches))
    extras = Extras(args.long_prompt, args.vs_transformers)
    try:
        result = run_engine_bench(randoms, args.runs, run.progress, folders, batches, extras)
    except MissingTransformers as exc:
        say(f"splitbus bench engine: {exc}")
        return 2
    return run.finish(result, report.engine_plot, report.engine_table)


def _engine_args_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with bench engine's numbers, said before any model is built; None: nothing."""
    if any(not 1 <= b <= 32 for b in args.prefill_batches):
        return "--prefill-batches must be between 1 and 32 (32 x 128 tokens: the engine's bound)"
    if args.long_prompt < 0:
        return "--long-prompt must be 0 (skip) or a number of tokens"
    return None


def _engine_folders(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """(served name, folder to load) of each --model: a .gguf file converted (or found in the cache)."""
    from splitbus.model_files.resolve import resolve_model, served_name

    if args.served_model_name and len(args.model) != 1:
        raise ValueError("--served-model-name needs exactly one --model")
    return [(served_name(path, args.served_model_name), resolve_model(path, args.data_dir, say)) for path in args.model]


def run_stagger(args: argparse.Namespace, env: Env) -> int:
    from splitbus.bench import report
    from splitbus.bench.stagger import EmptyTrace, StaggerBenchConfig, run_stagger_bench

    config = _config(
        "stagger",
        lambda: StaggerBenchConfig(
            tuple(args.sim_ranks),
            args.process_ranks,
            args.duration,
            args.process_duration,
            args.seed,
            args.process_repeats,
        ),
    )
    if config is None:
        return 2
    run = _Run("stagger", args.out)
    try:
        result = run_stagger_bench(config, progress=run.progress)
    except EmptyTrace as exc:
        say(f"splitbus bench stagger: {exc}")
        return 2
    return run.finish(result, report.stagger_plot, report.stagger_table)


def run_ep(args: argparse.Namespace, env: Env) -> int:
    from splitbus.bench import report

    if args.engine == "paddle":
        return run_ep_paddle(args)
    from splitbus.bench.ep import BACKENDS, EmptyTrace, EpBenchConfig, run_ep_bench

    config = _config(
        "ep",
        lambda: EpBenchConfig(
            BACKENDS if args.backend == "both" else (args.backend,),
            tuple(args.sim_ranks),
            args.process_ranks,
            args.duration,
            args.process_duration,
            args.runs,
            tuple(args.loads),
            args.seed,
            **({} if args.stagger_max_wait_ms is None else {"max_wait_s": args.stagger_max_wait_ms / 1e3}),
        ),
    )
    if config is None:
        return 2
    run = _Run("ep", args.out)
    try:
        result = run_ep_bench(config, progress=run.progress)
    except EmptyTrace as exc:
        say(f"splitbus bench ep: {exc}")
        return 2
    return run.finish(result, report.ep_plot, report.ep_table)


def run_ep_paddle(args: argparse.Namespace) -> int:
    from splitbus.bench import ep_paddle

    seeds = tuple(range(args.seed, args.seed + args.runs))
    duration = args.process_duration if args.process_duration != 10.0 else 15.0  # real compute: longer by default
    config = _config("ep", lambda: ep_paddle.PaddleEpConfig(args.process_ranks, tuple(args.loads), seeds, duration))
    if config is None:
        return 2
    run = _Run("ep_paddle", args.out)
    return run.finish(ep_paddle.run_paddle_ep_bench(config, run.progress), ep_paddle.plot, ep_paddle.table)


def run_serve(args: argparse.Namespace, env: Env) -> int:
    from splitbus.bench import report
    from splitbus.bench.serve import TargetError
    from splitbus.bench.workloads import TraceError

    if refused := _serve_refusal(args):
        say(f"splitbus bench serve: {refused}")
        return 2
    config = _config("serve", lambda: _serve_config(args))
    if config is None:
        return 2
    run = _Run("serve", args.out)
    try:
        result = _serve_result(config, args, env, run.progress)
    except (TargetError, TraceError) as exc:
        say(f"splitbus bench serve: {exc}")
        return 2
    try:
        finished = run.finish(result, report.serve_plot, report.serve_table)
    finally:
        within = _within_ideal(result["runs"])  # said even where writing the results failed
    return finished or within


def _serve_refusal(args: argparse.Namespace) -> str:
    """Why these options do not go together ("": they do)."""
    if args.policy and args.base_url:
        return "--policy starts its own splitbus up for each policy; it does not take --base-url"
    return "" if args.vs_direct_http is None else _vs_direct_http_refusal(args)


def _vs_direct_http_refusal(args: argparse.Namespace) -> str:
    """Why ``--vs-direct-http`` does not go with these options ("": it does)."""
    if args.policy or args.base_url:
        return "--vs-direct-http starts its own servers; it takes neither --policy nor --base-url"
    if any(c < 1 for c in args.vs_direct_http):
        return "--vs-direct-http's max concurrencies must be >= 1"
    if args.dataset[0] == "trace":
        return "--vs-direct-http sends every request at once: it does not take --dataset trace (arrival times)"
    return ""


def _serve_result(
    config: ServeConfig, args: argparse.Namespace, env: Env, progress: Callable[[str], None]
) -> dict[str, Any]:
    """``bench serve``'s result: against the engine's own HTTP server with ``--vs-direct-http``,
    else as ``run_serve_bench`` measures."""
    from splitbus.bench.serve import VS_DIRECT_HTTP_LEVELS, run_serve_bench, run_vs_direct_http

    if args.vs_direct_http is not None:
        return run_vs_direct_http(config, tuple(args.vs_direct_http) or VS_DIRECT_HTTP_LEVELS, progress)
    return run_serve_bench(config, args.base_url, args.api_key, progress, _serve_redis(args, env))


def _within_ideal(runs: list[dict[str, Any]]) -> int:
    """1, each reason said, if a run found more of its prompts cached than its ideal allows (its
    figures flatter the server: the results are written, for a look, but the run fails)."""
    from splitbus.bench.workloads import above_ideal

    excesses = above_ideal(runs)
    for excess in excesses:
        say(f"splitbus bench serve: FAILED: {excess}")
    return 1 if excesses else 0


def _serve_config(args: argparse.Namespace) -> ServeConfig:
    from splitbus.bench.serve_trace import ServeConfig
    from splitbus.bench.workloads import parse_goodput

    _check_policies(args.policy)
    workload = _serve_workload(args)
    rates = tuple(args.request_rate)[: 1 if workload.dataset == "trace" else None]  # a trace sets its own times
    return ServeConfig(
        rates, args.num_prompts, args.max_concurrency, args.input_len, args.output_len, args.range_ratio,
        args.model, args.seed, workload, tuple(parse_goodput(args.goodput).items()),
        tuple(p for p in args.policy.split(",") if p), tuple(args.up_arg),
        tuple(d for d in args.dispatch.split(",") if d),
    )  # fmt: skip


def _check_policies(given: str) -> None:
    from splitbus.placement import policies

    unknown = [p for p in given.split(",") if p and p.split(":")[0] not in policies.names()]
    if unknown:
        raise ValueError(f"--policy {', '.join(unknown)}: a policy is one of {', '.join(policies.names())}")


def _serve_workload(args: argparse.Namespace) -> Workload:
    """``--dataset`` and its settings; a trace file is read whole here, so that a bad line is
    reported before anything starts."""
    from splitbus.bench.serve_trace import Workload
    from splitbus.bench.workloads import read_trace

    dataset, *files = args.dataset
    if len(files) != (dataset == "trace"):
        raise ValueError("--dataset takes random, prefix, multiturn or trace FILE")
    workload = Workload(
        dataset, args.prefix_groups, args.prefix_len, args.questions_per_group, args.question_len,
        args.conversations, args.turns, args.turn_len, files[0] if files else None, args.time_scale, args.block_size,
        args.system_len,
    )  # fmt: skip
    if files:
        read_trace(Path(files[0]))
    return workload


def _serve_redis(args: argparse.Namespace, env: Env) -> str | None:
    """The Redis whose memory ``bench serve --base-url`` reports (None: not reported)."""
    from splitbus.redis_server import embedded_url

    if not args.base_url:
        return None  # it starts its own system and reads that one's
    return args.redis_url or env.redis_url or embedded_url(args.data_dir / "redis", admin=True)


def run_scheduler(args: argparse.Namespace, env: Env) -> int:
    from splitbus.bench import report
    from splitbus.bench.scheduler import SchedulerBenchConfig, SchedulerStalled, run_scheduler_bench

    config = _config(
        "scheduler",
        lambda: SchedulerBenchConfig(
            tuple(args.workers),
            tuple(args.replicas),
            tuple(args.api_dispatchers),
            args.rate,
            args.paced_requests,
            args.flood_requests,
            decisions=args.decisions,
        ),
    )
    if config is None:
        return 2
    run = _Run("scheduler", args.out)
    try:
        with _redis(args.redis_url) as url:
            result = run_scheduler_bench(url, config, progress=run.progress)
    except SchedulerStalled as exc:
        say(f"splitbus bench scheduler: {exc}; the schedulers' own errors, if any, are above")
        return 1
    return run.finish(result, report.scheduler_plot, report.scheduler_table)


def run_api(args: argparse.Namespace, env: Env) -> int:
    from splitbus.bench import report
    from splitbus.bench.api_load import ApiBenchConfig, run_api_bench

    config = _config(
        "api",
        lambda: ApiBenchConfig(args.streams, args.tokens, args.step_ms, args.client_processes, tuple(args.api_workers)),
    )
    if config is None:
        return 2
    run = _Run("api", args.out)
    with _redis(args.redis_url) as url:
        result = run_api_bench(url, config, progress=run.progress)
    return run.finish(result, report.api_plot, report.api_table)


def run_routing(args: argparse.Namespace, env: Env) -> int:
    from splitbus.bench import report
    from splitbus.bench.routing import RoutingBenchConfig, run_routing_bench

    options = {"workers": args.workers, "prompt_tokens": args.prompt_tokens, "seed": args.seed}
    if not args.quick:
        options.update(repeat=args.repeat, seeds=args.seeds)
    make = RoutingBenchConfig.quick if args.quick else RoutingBenchConfig
    config = _config("routing", lambda: make(**options))
    if config is None:
        return 2
    run = _Run("routing", args.out)
    result = run_routing_bench(config, progress=run.progress)
    return run.finish(result, report.routing_plot, report.routing_table)


def run_grammar(args: argparse.Namespace, env: Env) -> int:
    from splitbus.bench import report
    from splitbus.bench.grammar import run_grammar_bench, vocab_rows
    from splitbus.bench.grammar_batch import BatchBenchConfig
    from splitbus.model_files.resolve import resolve_model, served_name
    from splitbus.tokenization import ModelTokenizer

    if args.runs < 1:
        say("splitbus bench grammar: --runs must be at least 1")
        return 2
    batch = _config("grammar", lambda: BatchBenchConfig(tuple(args.batches), args.batch_runs, args.batch_steps))
    if batch is None:
        return 2
    try:
        folder = resolve_model(args.model, args.data_dir, say)
        tokenizer = ModelTokenizer.load(folder, served_name(args.model, None))
    except ValueError as exc:  # ModelFilesError among them: the path, and what is wrong with it
        say(f"splitbus bench grammar: {exc}")
        return 2
    run, rows = _Run("grammar", args.out), vocab_rows(folder, tokenizer)
    result = run_grammar_bench(tokenizer, rows, args.runs, progress=run.progress)
    if batch.batches:
        from splitbus.bench.grammar_batch import run_batch

        result["batch"] = run_batch(folder, tokenizer, rows, batch, progress=run.progress)
    return run.finish(result, report.grammar_plot, report.grammar_table)


def run_choices(args: argparse.Namespace, env: Env) -> int:
    from splitbus.bench import report
    from splitbus.bench.choices import BenchFailed, ChoicesBenchConfig, run_choices_bench

    config = _config(
        "choices",
        lambda: ChoicesBenchConfig(args.n, args.pairs, args.prompt_tokens, args.max_tokens, args.seed, args.engine),
    )
    if config is None:
        return 2
    try:
        model = _choices_model(args)
    except ValueError as exc:  # ModelFilesError among them: the path, and what is wrong with it
        say(f"splitbus bench choices: {exc}")
        return 2
    run = _Run("choices", args.out)
    try:
        result = run_choices_bench(config, *model, progress=run.progress)
    except BenchFailed as exc:
        say(f"splitbus bench choices: {exc}")
        return 1
    return run.finish(result, report.choices_plot, report.choices_table)


def run_tenants(args: argparse.Namespace, env: Env) -> int:
    from splitbus.bench import report
    from splitbus.bench.tenants import TenantsBenchConfig, run_tenants_bench

    config = _config(
        "tenants",
        lambda: TenantsBenchConfig(
            duration_s=args.duration,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            prefill_us_per_token=args.prefill_us_per_token,
            flood=args.flood,
            steady=args.steady,
            a_rps=args.a_rps,
            queued_prefill_tokens=args.queued_prefill_tokens,
            prefill_batch_tokens=args.prefill_batch_tokens,
            request_timeout_s=args.request_timeout,
            seed=args.seed,
        ),
    )
    if config is None:
        return 2
    run = _Run("tenants", args.out)
    with tempfile.TemporaryDirectory(prefix="splitbus-bench-tenants-") as folder:
        result = run_tenants_bench(config, Path(folder), run.progress)
    return run.finish(result, report.tenants_plot, report.tenants_table)


def run_planner(args: argparse.Namespace, env: Env) -> int:
    from splitbus.bench import planner

    config = _config("planner", lambda: _planner_config(args))
    if config is None:
        return 2
    run = _Run("planner", args.out)
    return run.finish(planner.run_planner_bench(config, run.progress), planner.plot, planner.table)


def run_client(args: argparse.Namespace, env: Env) -> int:
    if args.glide_path is not None:
        import sys

        sys.path.append(str(args.glide_path))  # last: the environment's own packages win over the folder's copies
    from splitbus.bench import client

    clients = tuple(args.clients)
    options = {"rounds": args.rounds, "calls": args.calls, "wakes": args.wakes, "pipeline": args.pipeline}
    if args.quick:
        config = _config("client", lambda: client.ClientBenchConfig.quick(clients))
    else:
        config = _config(
            "client", lambda: client.ClientBenchConfig(**options, step_streams=args.step_streams, clients=clients)
        )
    if config is None:
        return 2
    run = _Run("client", args.out)
    with _redis(args.redis_url) as url:
        result = client.run_client_bench(url, config, run.progress)
    return run.finish(result, client.plot, client.table)


def _planner_config(args: argparse.Namespace) -> PlannerBenchConfig:
    from splitbus.bench.planner import PlannerBenchConfig
    from splitbus.bench.planner_sim import H100_8B, TraceConfig

    if args.seeds < 1:
        raise ValueError("--seeds must be at least 1")
    return PlannerBenchConfig(
        trace=TraceConfig(rate=args.rate, peak=args.peak, phase_s=args.phase_s),
        costs=replace(H100_8B, start_delay_s=args.start_delay_s),
        ttft_slo_s=args.ttft_slo_ms / 1e3,
        itl_slo_s=args.itl_slo_ms / 1e3,
        seeds=tuple(range(args.seed, args.seed + args.seeds)),
        interval_s=args.interval_s,
        predictor=args.predictor,
        min_workers=args.autoscale.low,
        max_workers=args.autoscale.high,
        max_fleet=args.max_fleet,
        max_decode=args.max_decode,
    )


def _choices_model(args: argparse.Namespace) -> tuple[Path | None, str | None]:
    """``--model``'s folder (a .gguf file converted once, into ``--data-dir``, not into each run's
    fresh ``up``) and its served name; (None, None) for up's tiny model."""
    from splitbus.model_files.resolve import resolve_model, served_name

    if args.model is None:
        return None, None
    return resolve_model(args.model, args.data_dir, say), served_name(args.model, None)
