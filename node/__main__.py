import sys

from p2pdiloco.cli import main

sys.exit(main(["node", *sys.argv[1:]]))
