import sys

from bootstrap.main import main

sys.exit(main())
