"""`rollwire` finds its subcommands through entry points without naming the server or learner
modules: every subcommand's --help answers in a fresh interpreter that never imports torch."""

from __future__ import annotations

import subprocess
import sys

from rollwire.generator.engines import ENGINES


def test_every_subcommand_help_answers_without_torch():
    code = (
        "import sys\n"
        "from rollwire.client import cli\n"
        "for argv in (['--help'], ['generator', '--help'], ['proxy', '--help'], ['learner', '--help'],"
        " ['model', 'tiny', '--help']):\n"
        "    try:\n"
        "        cli.main(argv)\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, (argv, exc.code)\n"
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--engine {" + ",".join(ENGINES.names()) + "}" in proc.stdout
    assert proc.stdout.strip().endswith("NO-TORCH")
