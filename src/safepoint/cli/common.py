"""What the ``safepoint`` subcommands share: exit codes, rich rendering and argparse shapes.

cli.py builds the parser from the cli_* command modules and maps errors to exit codes; each command module
holds its commands' arguments next to their implementation, with the shapes defined here so an argument
reads the same in every command.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from safepoint.cli import tools, tools_read
from safepoint.errors import CheckpointError
from safepoint.store.manifest import Manifest
from safepoint.store.posix_layout import Layout

EXIT_OK = 0
EXIT_PROBLEMS = 1
EXIT_ERROR = 2


class UsageError(CheckpointError):
    """Arguments that parse but do not make sense together."""


class Command(Protocol):
    def __call__(self, args: argparse.Namespace, out: Console, err: Console) -> int: ...


# ---- rendering -----------------------------------------------------------------------------------------


def console(*, stderr: bool = False) -> Console:
    # Piped output: wide enough that long tensor names are not wrapped mid-line for grep and friends.
    width = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 200
    return Console(stderr=stderr, highlight=False, width=width)


@contextmanager
def progress(err: Console, description: str, total: int) -> Iterator[Callable[[int], None]]:
    """A byte progress bar on stderr (only on a terminal: logs and pipes stay clean)."""
    bar = Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    )
    with bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def when(t: float | None) -> str:
    return "-" if t is None else datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def metrics_text(m: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.6g}" for k, v in sorted(m.items()))


def verified(layout: Layout, step: int, err: Console) -> Manifest:
    manifest = layout.read_manifest(step)
    with progress(err, f"verifying step {step}", manifest.total_bytes) as advance:
        return tools.require_intact(layout, step, lambda _name, size: advance(size))


def load(layout: Layout, step: int, err: Console, include: tools_read.Include) -> dict[str, Any]:
    """The state of ``step`` (or the part ``include`` selects), verified first, with progress bars."""
    manifest = verified(layout, step, err)
    metadata = tools_read.read_verified_metadata(layout, step, manifest)
    with progress(err, f"reading step {step}", tools_read.planned_bytes(metadata, include)) as advance:
        return tools_read.load_state(layout, step, metadata, include, advance, manifest=manifest)


# ---- argparse shapes -------------------------------------------------------------------------------------


def command(subs: Any, name: str, func: Command, help: str, epilog: str) -> argparse.ArgumentParser:
    """A subcommand whose --help shows ``help`` and the usage examples in ``epilog``."""
    p: argparse.ArgumentParser = subs.add_parser(
        name,
        help=help,
        description=help,
        epilog="examples:\n" + epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(func=func)
    return p


def at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low``."""

    def parse(s: str) -> int:
        # ASCII digits only: int() also reads "٢", " 2 " and "2_0", which name no step or count.
        if not (s.isascii() and s.lstrip("-").isdigit()):
            raise ValueError(s)
        v = int(s)
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v

    parse.__name__ = "int"  # argparse names the type in "invalid int value: 'x'"
    return parse


STEP = at_least(0)


def add_root(p: argparse.ArgumentParser) -> None:
    p.add_argument("root", metavar="ROOT")


def add_step(p: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup) -> None:
    p.add_argument("--step", type=STEP, metavar="N", help="checkpoint step (default: the newest)")


def add_flag(p: argparse.ArgumentParser | argparse._MutuallyExclusiveGroup, name: str, help: str) -> None:
    p.add_argument(name, action="store_true", help=help)
