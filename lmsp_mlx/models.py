"""`python -m lmsp_mlx.models`: what this machine can serve, and managing it.

    list           the model store and the mlx-lm models in the Hugging Face cache, with sizes
    pull ORG/NAME  download a Hugging Face repo (optionally @revision) into its cache, with progress
    rm NAME        remove a model from the store, or a repo (every revision) from the cache

Every listed name is what `python -m lmsp_mlx.serve --model NAME` takes."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .cli import ERROR, Parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = Parser(prog="python -m lmsp_mlx.models", description="List, pull and remove models.")
    store = argparse.ArgumentParser(add_help=False)  # --models-dir before or after the command
    store.add_argument("--models-dir", type=Path, default=argparse.SUPPRESS,
                       help="the model store (default: as the server's)")
    p.add_argument("--models-dir", type=Path, help="the model store (default: as the server's)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    sub.add_parser("list", parents=[store], help="the store's and the Hugging Face cache's models, with sizes")
    pull = sub.add_parser("pull", parents=[store], help="download a Hugging Face repo id (org/name[@revision]) "
                          "with progress")
    pull.add_argument("repo")
    rm = sub.add_parser("rm", parents=[store], help="remove a store model or a cached Hugging Face repo")
    rm.add_argument("name")
    return p.parse_args(argv)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level="INFO", format="%(message)s", stream=sys.stderr)
    from .engine import catalog, hub
    from .engine.model_store import default_models_dir

    store = args.models_dir or default_models_dir()
    if args.command == "list":
        listed = catalog.store_models(store) + catalog.hub_models()
        width = max((len(m.id) for m in listed), default=4)
        print(f"{'NAME':<{width}}  {'WHERE':<5}  {'SIZE':>9}  PATH")
        for m in listed:
            print(f"{m.id:<{width}}  {m.where:<5}  {_size(m.size_bytes):>9}  {m.path}")
        return 0
    if args.command == "pull":
        try:
            path = hub.resolve(args.repo, pulling=True)
        except hub.HubError as exc:
            print(f"{ERROR} {exc}", file=sys.stderr)
            return 2
        if not catalog.is_mlx_dir(path):
            print(f"lmsp-mlx: warning: {args.repo} has no mlx-lm weights (config.json and safetensors)", file=sys.stderr)
        print(path)
        return 0
    found = [m for m in catalog.store_models(store) + catalog.hub_models() if m.id == args.name]
    if not found:
        print(f"{ERROR} no model {args.name!r} in the store ({store}) or the Hugging Face cache",
              file=sys.stderr)
        return 2
    for m in found:
        catalog.remove(m)
        print(f"removed {m.id} ({m.where}, {_size(m.size_bytes)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
