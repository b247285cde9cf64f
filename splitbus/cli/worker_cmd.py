"""``splitbus worker``: one prefill, decode or mixed worker."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from splitbus import tracing
from splitbus.bus.roles import Role
from splitbus.cli.common import (
    add_metrics_arguments,
    add_redis_url_argument,
    data_dir,
    redis_url,
    run_service,
    say,
    serve_metrics,
)
from splitbus.env import Env
from splitbus.worker import engines
from splitbus.worker.engines.base import GPU_MEMORY_FRACTION

if TYPE_CHECKING:
    from splitbus.tokenization import ModelTokenizer
    from splitbus.worker.config import WorkerConfig
    from splitbus.worker.engines import Engine


def add_parser(subparsers: argparse._SubParsersAction, env: Env) -> None:
    p = subparsers.add_parser("worker", help="run one worker")
    p.add_argument("--role", choices=[role.value for role in Role], required=True)  # values: argparse shows repr()
    p.add_argument("--engine", choices=engines.names(first="sim"), default="sim")
    p.add_argument(
        "--model",
        type=Path,
        required=True,
        metavar="PATH",
        help="Hugging Face model folder, or a .gguf file (converted once into a folder under DATA_DIR/models)",
    )
    p.add_argument("--served-model-name", default=None, help="default: a .gguf file's stem, or the folder name")
    add_redis_url_argument(p)
    p.add_argument("--worker-id", default=None, help="default: role, host and pid")
    p.add_argument("--max-requests", type=int, default=64, help="requests held at once (default %(default)s)")
    p.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=4096,
        help="prompt tokens in one prefill batch, at most (a longer prompt goes alone; default %(default)s)",
    )
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help=f"KV blocks of 16 tokens (default: {_kv_blocks_defaults('sim')})",
    )
    p.add_argument(
        "--kv-cache-mb",
        type=int,
        default=None,
        help="paddle: memory for the KV cache (default: 256 on the CPU; on a GPU, 90%% of what "
        "--gpu-memory-fraction leaves once the weights are loaded)",
    )
    p.add_argument(
        "--gpu-memory-fraction",
        type=_fraction,
        default=GPU_MEMORY_FRACTION,
        metavar="F",
        help="paddle: the part of its GPU's total memory this worker may take, weights and KV cache included, as "
        "vLLM's --gpu-memory-utilization (default %(default)s; `splitbus up` divides it among workers sharing a GPU)",
    )
    p.add_argument("--threads", type=int, default=1, help="paddle: math threads on the CPU (default %(default)s)")
    p.add_argument(
        "--device",
        type=_device,
        default="auto",
        help="paddle: auto (the first GPU Paddle sees, else the CPU), cpu or gpu:N (default %(default)s)",
    )
    p.add_argument("--transfer-host", default="127.0.0.1", help="address of the KV transfer server")
    p.add_argument("--transfer-port", type=int, default=0, help="port of the KV transfer server (default: free)")
    p.add_argument(
        "--transfer-advertise-host",
        default="",
        help="address peers connect to (default: --transfer-host, or the host name for 0.0.0.0)",
    )
    p.add_argument("--kv-wait", type=float, default=30.0, help="seconds to wait for the peer's KV or reservation")
    p.add_argument("--transfer-timeout", type=float, default=10.0)
    p.add_argument("--dp-group", default="", help="DP group name (with --dp-rank, --dp-size; its ranks share a --role)")
    p.add_argument("--dp-rank", type=int, default=-1)
    p.add_argument("--dp-size", type=int, default=0)
    p.add_argument(
        "--dp-align-ms",
        type=float,
        default=0.0,
        help="wait this long for the group's prefills to align (default 0: off)",
    )
    p.add_argument(
        "--dp-barrier-timeout", type=float, default=5.0, help="seconds before a missing rank breaks the group"
    )
    p.add_argument("--ep", action="store_true", help="split a MoE model's experts over the DP group (paddle)")
    p.add_argument(
        "--ep-timeout", type=float, default=10.0, help="seconds before a stuck expert exchange breaks the group"
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=0.0,
        metavar="S",
        help="SIGTERM drains: no new task, finish what is held for up to S seconds (then the rest migrates), "
        "leave, exit 0 (default 0: SIGTERM stops at once; SIGINT always does)",
    )
    engines.add_arguments(p)
    add_metrics_arguments(p)
    p.set_defaults(run=run)


def _device(text: str) -> str:
    """``--device``'s value, checked: a bad one is argparse's usage error, not a traceback."""
    from splitbus.gpu_ops.device import parse_device

    try:
        return parse_device(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fraction(text: str) -> float:
    """``--gpu-memory-fraction``'s value, checked: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a fraction of the GPU's memory in (0, 1], got {text!r}")
    return value


def _kv_blocks_defaults(first: str) -> str:
    """How each engine sizes its KV cache without --kv-blocks ("8192 for sim; ...")."""
    return "; ".join(f"{engines.get(name).kv_blocks_default} for {name}" for name in engines.names(first))


def build_config(args: argparse.Namespace, env: Env) -> WorkerConfig:
    from splitbus.bus.core.config import BusConfig
    from splitbus.model_files.resolve import resolve_model, served_name
    from splitbus.worker.config import WorkerConfig

    return WorkerConfig(
        bus=BusConfig(redis_url=redis_url(args, env), prefix=env.prefix, cell=env.cell),
        role=args.role,
        engine=args.engine,
        model_dir=resolve_model(args.model, data_dir(args, env), say),
        model_name=served_name(args.model, args.served_model_name),
        worker_id=args.worker_id or "",
        max_requests=args.max_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        transfer_host=args.transfer_host,
        transfer_port=args.transfer_port,
        transfer_advertise_host=args.transfer_advertise_host,
        kv_wait_s=args.kv_wait,
        transfer_timeout_s=args.transfer_timeout,
        dp_group=args.dp_group,
        dp_rank=args.dp_rank,
        dp_size=args.dp_size,
        dp_align_ms=args.dp_align_ms,
        dp_barrier_timeout_s=args.dp_barrier_timeout,
        ep=args.ep,
        ep_timeout_s=args.ep_timeout,
        drain_timeout_s=args.drain_timeout,
    )


def build_engine(config: WorkerConfig, tokenizer: ModelTokenizer, args: argparse.Namespace) -> Engine:
    """The engine named by the config, built by its registered type. An engine that imports
    paddle gets the CPU tuning first: it must come before paddle's import."""
    engine_type = engines.get(config.engine)
    if engine_type.capabilities.needs_paddle:
        from splitbus.gpu_ops import device

        device.prepare(args.threads)
    setup = engines.EngineSetup(
        model_dir=config.model_dir,
        tokenizer=tokenizer,
        block_size=config.block_size,
        kv_blocks=args.kv_blocks or None,
        kv_cache_bytes=None if args.kv_cache_mb is None else args.kv_cache_mb * 2**20,
        gpu_memory_fraction=args.gpu_memory_fraction,
        threads=args.threads,
        device=args.device,
        shard=(config.dp_rank, config.dp_size) if config.ep else (0, 1),
        options=engine_type.options_from(args),
    )
    return engine_type.create(setup)


def run(args: argparse.Namespace, env: Env) -> int:
    from splitbus.tokenization import ModelFilesError, ModelTokenizer
    from splitbus.worker.dp import EXIT_GROUP_BROKEN, DpStepper
    from splitbus.worker.steps import SoloStepper
    from splitbus.worker.worker import Worker

    try:
        config = build_config(args, env)
        tokenizer = ModelTokenizer.load(config.model_dir, config.model_name)
        engine = build_engine(config, tokenizer, args)
    except (ValueError, ModelFilesError) as exc:
        say(f"splitbus worker: {exc}")
        return 2
    if not serve_metrics(args, "worker"):
        return 2
    stepper = DpStepper if config.dp_size else SoloStepper
    worker = Worker(config, tokenizer, engine, stepper)
    with tracing.process("worker", {"splitbus.role": config.role}):
        code = run_service(worker, on_sigterm=worker.drain)
    if config.ep and code == EXIT_GROUP_BROKEN:
        # The engine's thread may still wait in a collective a hung rank never joins (until gloo's
        # own 30 s timeout), and the interpreter would join it at exit: what the worker owed is
        # written (handed over, deregistered) before its loop returned, so leave now.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
