"""What every ``p2pdiloco`` command shares: logging, one line and an exit code per expected
failure (2 for configuration errors, 1 for the rest, 130 for Ctrl+C), the asyncio runner,
Ctrl+C held while native libraries load, and the argument parser's one-line usage errors."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
import typing
from collections.abc import Coroutine, Iterator
from typing import Any

from p2pdiloco.errors import ConfigError, P2PDilocoError


def setup_logging(verbose: int = 0) -> None:
    level = logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING
    level = os.environ.get("P2PDILOCO_LOG", logging.getLevelName(level)).upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("hivemind", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.getLogger().level, logging.ERROR))


def report_error(e: P2PDilocoError) -> int:
    """Print ``e`` on stderr as ``p2pdiloco: message`` (one line per problem); its exit code:
    2 for configuration errors, 1 for the rest."""
    print(f"p2pdiloco: {e}", file=sys.stderr)
    return 2 if isinstance(e, ConfigError) else 1


def interrupted() -> int:
    """Ctrl+C: one line and exit code 130 (128 + SIGINT, what a shell reports for it)."""
    print("p2pdiloco: interrupted", file=sys.stderr)
    return 130


def run_async(coro: Coroutine[Any, Any, int]) -> int:
    """Run ``coro`` on uvloop and translate our errors into one line and an exit code.

    Until ``coro`` installs its own handler, SIGINT cancels it (``asyncio.Runner``, which
    ``uvloop.run`` uses) and surfaces here as KeyboardInterrupt: an error that the interruption
    caused on the way out (a daemon that got the signal too) is reported as the interruption."""
    import asyncio  # noqa: PLC0415

    import uvloop  # noqa: PLC0415

    async def guarded() -> int:
        try:
            return await coro
        except (P2PDilocoError, OSError):
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # Ctrl+C came first
                raise asyncio.CancelledError from None
            raise

    try:
        return uvloop.run(guarded())
    except P2PDilocoError as e:
        return report_error(e)
    except OSError as e:  # a file or folder the user named (status, report, identity...) failed
        print(f"p2pdiloco: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return interrupted()


@contextlib.contextmanager
def sigint_held() -> Iterator[list[int]]:
    """Hold Ctrl+C while native libraries are imported: a SIGINT meanwhile is only recorded in
    the list yielded, and the previous handler is back afterwards. torch runs Python callbacks
    from its C++ initialisation (pybind11); a KeyboardInterrupt raised in one ends in C++
    ``terminate``: the process aborts (SIGABRT, exit -6) instead of saying one line (measured:
    Ctrl+C 1 s after ``node run`` started on a loaded machine). Off the main thread, or when
    SIGINT is not Python's default handler (ignored by ``nohup``, or a test's own), nothing is
    changed."""
    import signal  # noqa: PLC0415
    import threading  # noqa: PLC0415

    held: list[int] = []
    hold = threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if hold:
        signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield held
    finally:
        if hold:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def load_native_libraries(modules: tuple[str, ...] = ("torch", "hivemind")) -> bool:
    """Import ``modules`` (torch, hivemind) with Ctrl+C held (:func:`sigint_held`), and say whether
    it was pressed meanwhile."""
    with sigint_held() as held:
        for name in modules:
            importlib.import_module(name)
    return bool(held)


class Parser(argparse.ArgumentParser):
    """argparse with one line per usage error, naming the command and where its help is (the
    default prints the whole usage first, dozens of lines for ``node run``). Subcommands inherit
    the class (``add_subparsers`` uses the parser's own class)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")
