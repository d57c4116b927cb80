"""Usage errors of the command line: one line on stderr naming the command and its help, exit
code 2, before torch or hivemind is imported (``p2pdiloco.cli._parse``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from p2pdiloco.cli import main


@pytest.mark.parametrize("argv,line", [
    (["node", "run", "--bogus"],
     "p2pdiloco node run: unrecognized arguments: --bogus (see p2pdiloco node run --help)"),
    (["node", "run", "--port", "x"],
     "p2pdiloco node run: argument --port: invalid int value: 'x' (see p2pdiloco node run --help)"),
    (["node", "status", "--bogus"],
     "p2pdiloco node status: unrecognized arguments: --bogus (see p2pdiloco node status --help)"),
    (["node"], "p2pdiloco node: the following arguments are required: {run,status} (see p2pdiloco node --help)"),
    ([], "p2pdiloco: the following arguments are required: COMMAND (see p2pdiloco --help)"),
    (["demo", "--nodes", "x"], "p2pdiloco demo: argument --nodes: invalid int value: 'x' (see p2pdiloco demo --help)"),
    (["demo", "--nodes", "0"], "p2pdiloco demo: argument --nodes: must be above 0, got 0 (see p2pdiloco demo --help)"),
    (["demo", "--duration", "-1"],
     "p2pdiloco demo: argument --duration: must be above 0, got -1 (see p2pdiloco demo --help)"),
])
def test_a_usage_error_is_one_line_naming_the_command(argv, line, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    out, err = capsys.readouterr()
    assert exit_.value.code == 2 and out == "" and err == line + "\n"


def test_help_node_status_and_bad_settings_do_not_import_torch_or_hivemind(tmp_path):
    """``--help``, ``node status``, a bad setting of ``node run`` or of the demo, and ``run show``
    of a missing file answer without torch or hivemind (settings load without them)."""
    probe = ("import sys; from p2pdiloco.cli import main\n"
             "d = sys.argv[1]\n"
             "for argv in (['--help'], ['node', 'status', '--data-dir', d], ['node', 'run', '--set', 'outer.lr=fast'],\n"
             "             ['demo', '--set', 'outer.fragments=0'], ['run', 'show', d + '/none.manifest']):\n"
             "    try:\n        print('exit', main(argv))\n    except SystemExit as e:\n        print('exit', e.code)\n"
             "print(sorted(m for m in ('torch', 'hivemind') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=60)
    lines = out.stdout.strip().splitlines()
    assert [ln for ln in lines if ln.startswith("exit")] == ["exit 0", "exit 1", "exit 2", "exit 2", "exit 2"], out
    assert lines[-1] == "[]", out
    assert f"p2pdiloco: run show: '{tmp_path}/none.manifest' is neither a manifest file" in out.stderr, out


def test_ctrl_c_inside_exec_of_a_string_still_exits_130():
    """A KeyboardInterrupt raised inside a string ``exec`` (dataclasses build methods that way,
    so a Ctrl+C during an import can land there) and handled by ``main`` must not end the
    process by SIGINT under ``python -m`` (CPython's unhandled-interrupt flag; seen as exit -2
    in tests/test_stop.py's Ctrl+C 0.5 s into ``node run``)."""
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-m", "tests.interrupt_in_exec"], capture_output=True, text=True,
                         timeout=60, cwd=root)
    assert (out.returncode, out.stderr) == (130, "p2pdiloco: interrupted\n"), out
