"""``python -m pagedkv``: the command line.

Each subcommand lives in its own module, which exposes ``add_parser(subparsers)`` (registering its
arguments and ``set_defaults(func=run)``) and keeps heavy imports inside ``run``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module (relative to this package)
SUBCOMMANDS = {
    "demo": ".demo",
    "replay": ".replay",
    "mutate": ".mutate",
    "bench": ".bench",
    "e2e": ".e2e",
    "soak": ".soak",
    "fuzz": ".fuzz",
    "peers": ".peers",
    "plan": ".plan",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per subcommand."""
    from pagedkv.backends import BUILTIN

    parser = argparse.ArgumentParser(
        prog=_prog(), formatter_class=argparse.RawDescriptionHelpFormatter,
        description="pagedkv: a paged KV cache whose loop, indexed and fused read paths are proved equal.",
        epilog="what --impl (and the gate's --pagedkv-impl) can name, beside a module of your own\n"
               "(my_engine.kv:backend):\n"
               f"  kernels       {', '.join(BUILTIN)} (pagedkv's own); other projects' kernels: docs/peers.md\n"
               "  managers      pagedkv.testing.managers.own, pagedkv.testing.managers.reference\n"
               "  engine peers  pagedkv.tools.peers:vllm_cache_manager, pagedkv.tools.peers:sglang_radix_cache\n"
               "(docs/gating.md, 'Make your code a backend' and 'Gate a cache manager')")
    from pagedkv import __version__

    parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMANDS.values():
        try:
            module = importlib.import_module(module_name, __package__)
        except ModuleNotFoundError as exc:
            if exc.name != f"{__package__}{module_name}":
                raise
            continue  # optional module not present in this installation
        module.add_parser(subparsers)
    return parser


def _prog() -> str:
    """``pagedkv`` when run as the console script, ``python -m pagedkv`` otherwise."""
    import os

    return "pagedkv" if os.path.basename(sys.argv[0] or "") == "pagedkv" else "python -m pagedkv"


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns its exit status.

    The working directory goes first on ``sys.path``, as ``python -m`` puts it: the console script
    then finds the same candidates (``--impl my_engine.kv:backend`` from the repository's root).
    """
    import os

    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
