"""``splitbus worker``: one prefill, decode or mixed worker."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from splitbus.cli.common import (
    add_metrics_arguments,
    add_redis_url_argument,
    redis_url,
    run_service,
    say,
    serve_metrics,
)
from splitbus.env import Env

if TYPE_CHECKING:
    from splitbus.tokenization import ModelTokenizer
    from splitbus.worker.config import WorkerConfig
    from splitbus.worker.engine import Engine
    from splitbus.worker.paddle.config import ModelConfig


def add_parser(subparsers: argparse._SubParsersAction, env: Env) -> None:
    p = subparsers.add_parser("worker", help="run one worker")
    p.add_argument("--role", choices=("prefill", "decode", "mixed"), required=True)
    p.add_argument("--engine", choices=("sim", "paddle"), default="sim")
    p.add_argument("--model", type=Path, required=True, metavar="DIR", help="Hugging Face model folder")
    p.add_argument("--served-model-name", default=None, help="default: the folder name")
    add_redis_url_argument(p)
    p.add_argument("--worker-id", default=None, help="default: role, host and pid")
    p.add_argument("--max-requests", type=int, default=64, help="requests held at once (default %(default)s)")
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=None,
        help="KV blocks of 16 tokens (default: 8192 for sim; from --kv-cache-mb for paddle)",
    )
    p.add_argument("--kv-cache-mb", type=int, default=256, help="paddle: memory for the KV cache (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="paddle: math threads on the CPU (default %(default)s)")
    p.add_argument("--transfer-host", default="127.0.0.1", help="address of the KV transfer server")
    p.add_argument("--transfer-port", type=int, default=0, help="port of the KV transfer server (default: free)")
    p.add_argument(
        "--transfer-advertise-host",
        default="",
        help="address peers connect to (default: --transfer-host, or the host name for 0.0.0.0)",
    )
    p.add_argument("--kv-wait", type=float, default=30.0, help="seconds to wait for the peer's KV or reservation")
    p.add_argument("--transfer-timeout", type=float, default=10.0)
    p.add_argument("--dp-group", default="", help="DP group name (with --dp-rank and --dp-size; --role mixed)")
    p.add_argument("--dp-rank", type=int, default=-1)
    p.add_argument("--dp-size", type=int, default=0)
    p.add_argument(
        "--dp-align-ms", type=float, default=20.0, help="wait this long for the group's prefills to align (0: off)"
    )
    p.add_argument(
        "--dp-barrier-timeout", type=float, default=5.0, help="seconds before a missing rank breaks the group"
    )
    p.add_argument("--sim-prefill-us-per-token", type=float, default=50.0)
    p.add_argument("--sim-decode-step-ms", type=float, default=4.0)
    p.add_argument(
        "--sim-decode-us-per-seq", type=float, default=100.0, help="added to a decode step per running sequence"
    )
    p.add_argument("--sim-kv-bytes-per-token", type=int, default=4096)
    p.add_argument(
        "--sim-poison-token",
        type=int,
        default=-1,
        help="fault injection: fail any step holding a prompt with this token",
    )
    p.add_argument(
        "--sim-crash-token", type=int, default=-1, help="fault injection: SIGKILL on a prompt with this token"
    )
    add_metrics_arguments(p)
    p.set_defaults(run=run)


def build_config(args: argparse.Namespace, env: Env) -> WorkerConfig:
    from splitbus.bus.config import BusConfig
    from splitbus.worker.config import SimConfig, WorkerConfig

    sim = SimConfig(
        args.sim_prefill_us_per_token / 1e6,
        args.sim_decode_step_ms / 1e3,
        args.sim_decode_us_per_seq / 1e6,
        kv_bytes_per_token=args.sim_kv_bytes_per_token,
        poison_token=args.sim_poison_token,
        crash_token=args.sim_crash_token,
    )
    return WorkerConfig(
        bus=BusConfig(redis_url=redis_url(args, env), prefix=env.prefix),
        role=args.role,
        engine=args.engine,
        model_dir=args.model,
        model_name=args.served_model_name or args.model.resolve().name,
        worker_id=args.worker_id or "",
        max_requests=args.max_requests,
        total_kv_blocks=args.kv_blocks or 8192,
        transfer_host=args.transfer_host,
        transfer_port=args.transfer_port,
        transfer_advertise_host=args.transfer_advertise_host,
        kv_wait_s=args.kv_wait,
        transfer_timeout_s=args.transfer_timeout,
        sim=sim,
        threads=args.threads,
        dp_group=args.dp_group,
        dp_rank=args.dp_rank,
        dp_size=args.dp_size,
        dp_align_ms=args.dp_align_ms,
        dp_barrier_timeout_s=args.dp_barrier_timeout,
    )


def build_engine(config: WorkerConfig, tokenizer: ModelTokenizer, args: argparse.Namespace) -> Engine:
    """The engine named by the config; paddle is imported only here, after the CPU tuning."""
    if config.engine == "sim":
        from splitbus.worker.sim import SimEngine

        return SimEngine(config.sim, tokenizer, config.total_kv_blocks, config.block_size)
    from splitbus.gpu_ops import device

    device.prepare(config.threads)
    try:
        from splitbus.worker.paddle.config import ModelConfig
        from splitbus.worker.paddle.engine import PaddleEngine
    except ImportError as exc:
        raise ValueError(f"the paddle engine needs PaddlePaddle: pip install 'splitbus[paddle]' ({exc})") from None
    blocks = args.kv_blocks or _blocks_for(ModelConfig.load(config.model_dir), args.kv_cache_mb, config.block_size)
    return PaddleEngine.load(config.model_dir, tokenizer.eos_token_ids, blocks, config.block_size, config.threads)


def _blocks_for(model: ModelConfig, megabytes: int, block_size: int) -> int:
    bytes_per_block = 2 * model.layers * model.kv_heads * model.head_dim * 4 * block_size  # K and V, fp32
    return max(2, megabytes * 1024 * 1024 // bytes_per_block)


def run(args: argparse.Namespace, env: Env) -> int:
    from splitbus.tokenization import ModelFilesError, ModelTokenizer
    from splitbus.worker.dp import DpStepper
    from splitbus.worker.stepper import SoloStepper
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
    return run_service(Worker(config, tokenizer, engine, stepper))
