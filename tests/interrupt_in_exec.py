"""For tests/test_cli_usage.py, run as ``python -m tests.interrupt_in_exec`` (``-m``, as ``python
-m node run`` is): ``p2pdiloco.cli.main`` with its command replaced by one that raises
KeyboardInterrupt inside ``exec`` of a string, where a Ctrl+C lands when it arrives while a
dataclass is being built (an import). The exit code must be ``main``'s 130, not death by SIGINT."""

import sys

from p2pdiloco import cli


def _interrupted_in_exec(args) -> int:
    exec("raise KeyboardInterrupt")  # noqa: S102
    return 0


cli._main = _interrupted_in_exec
sys.exit(cli.main(["node", "status"]))
