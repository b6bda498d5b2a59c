"""The ``safepoint`` command line: see what is in a checkpoint root, trust it, get a model out of it.

This module builds the parser and maps errors to exit codes. The commands live in cli_root.py (ls, verify,
prune), cli_inspect.py (inspect, diff) and cli_convert.py (export, import), each with its arguments; their
work is done in the tools* modules with the same modules the manager uses. ``demo`` and ``bench`` are
passed through to their own modules.

Exit codes: 0 success; 1 a checkpoint is damaged (verify found problems, or a command refused to read a
corrupt checkpoint) or, for ``diff``, the two steps differ; 2 usage errors and anything else that stopped
the command (missing root or step, a live writer holding the root, an unreadable input file).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from safepoint._version import __version__
from safepoint.cli import convert as cli_convert
from safepoint.cli import inspect as cli_inspect
from safepoint.cli import report as cli_report
from safepoint.cli import root as cli_root
from safepoint.cli.common import EXIT_ERROR, EXIT_PROBLEMS, UsageError, console
from safepoint.errors import CheckpointError, CorruptCheckpointError

# Subcommands implemented in their own modules, imported only when used; they parse their own arguments.
# name -> (module imported only when used, help). The demo sits beside the CLI, not under it.
_PASSTHROUGH = {
    "demo": (
        "safepoint.demo.main",
        "torchrun job through SIGKILL, SIGTERM, a corrupt checkpoint and 2 -> 1 ranks; bitwise check",
    ),
    "bench": (
        "safepoint.cli.bench",
        "run the benchmark suite (save/restore against plain DCP, torch.save, dd)",
    ),
}
# In the order `safepoint --help` lists them.
_COMMANDS = (
    cli_root.add_ls,
    cli_root.add_verify,
    cli_inspect.add_inspect,
    cli_convert.add_export,
    cli_convert.add_import,
    cli_root.add_prune,
    cli_inspect.add_diff,
    cli_report.add_report,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="safepoint",
        description="Inspect, verify and convert safepoint checkpoint roots.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n  safepoint ls runs/ckpt\n  safepoint verify runs/ckpt --all\n"
            "  safepoint export runs/ckpt model.safetensors --format safetensors --model-only\n\n"
            "exit codes: 0 ok; 1 a damaged checkpoint (or, for diff, differences); 2 usage or other errors.\n"
            "`safepoint COMMAND --help` for each command."
        ),
    )
    parser.add_argument("--version", action="version", version=f"safepoint {__version__}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _COMMANDS:
        add(subs)
    for name, (_module, help) in _PASSTHROUGH.items():
        subs.add_parser(name, help=help, add_help=False)
    return parser


def _passthrough(name: str, rest: list[str]) -> int:
    module = _PASSTHROUGH[name][0]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise UsageError(f"`safepoint {name}` is not available in this build ({module} is missing)") from None
    return int(mod.main(rest) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv and argv[0] in _PASSTHROUGH:
            return _passthrough(argv[0], argv[1:])
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # argparse: 2 for usage errors, 0 for --help/--version
            return e.code if isinstance(e.code, int) else EXIT_ERROR
        return int(args.func(args, console(), console(stderr=True)))
    except CorruptCheckpointError as e:
        print(f"safepoint: error: {e}", file=sys.stderr)
        return EXIT_PROBLEMS
    except CheckpointError as e:
        print(f"safepoint: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as e:
        print(
            f"safepoint: error: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", file=sys.stderr
        )
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("safepoint: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
