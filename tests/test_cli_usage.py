"""Usage errors of the command line: one line on stderr naming the command and its help, exit
code 2, before torch or hivemind is imported (``p2pdiloco.cli._parse``)."""

from __future__ import annotations

import subprocess
import sys

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


def test_help_and_node_status_do_not_import_torch_or_hivemind(tmp_path):
    probe = ("import sys; from p2pdiloco.cli import main\n"
             "for argv in (['--help'], ['node', 'status', '--data-dir', sys.argv[1]]):\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             "print(sorted(m for m in ('torch', 'hivemind') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "[]", out
