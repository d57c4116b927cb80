"""Running a command's coroutine: uvloop, and our errors as one line and an exit code (the
entry points: ``p2pdiloco.cli`` and ``python -m bootstrap.main``)."""

from __future__ import annotations

import sys
from collections.abc import Coroutine
from typing import Any

from p2pdiloco.errors import ConfigError, P2PDilocoError


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
