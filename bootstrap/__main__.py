import sys

from p2pdiloco.cli import main

sys.exit(main(["bootstrap", *sys.argv[1:]]))
