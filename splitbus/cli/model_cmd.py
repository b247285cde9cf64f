"""``splitbus make-tiny-model``: a small random model in Hugging Face layout."""

from __future__ import annotations

import argparse
from pathlib import Path

from splitbus.cli.common import say
from splitbus.env import Env


def add_parser(subparsers: argparse._SubParsersAction, env: Env) -> None:
    p = subparsers.add_parser("make-tiny-model", help="write a small random model with a byte-level tokenizer")
    p.add_argument("dir", type=Path, help="folder to write (created)")
    p.add_argument("--arch", choices=("llama", "qwen2"), default="llama")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.set_defaults(run=run)


def run(args: argparse.Namespace, env: Env) -> int:
    from splitbus.gpu_ops import device

    device.prepare()
    try:
        from splitbus.worker.engines.paddle.tiny import make_tiny_model
    except ImportError as exc:
        say(f"splitbus make-tiny-model needs the paddle extra: pip install 'splitbus[paddle]' ({exc})")
        return 2
    folder = make_tiny_model(args.dir, args.arch, args.seed, args.dtype, hidden=args.hidden, layers=args.layers)
    say(f"wrote a tiny {args.arch} model ({args.dtype}) to {folder}")
    return 0
