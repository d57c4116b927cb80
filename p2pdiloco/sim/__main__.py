"""``python -m p2pdiloco.sim``: the same subcommands as ``p2pdiloco simulate``."""

import logging
import sys

from p2pdiloco.sim.cli import main

logging.basicConfig(level=logging.WARNING, format="%(levelname).1s %(name)s: %(message)s")
sys.exit(main())
