import sys

from triax.cli import main

sys.exit(main())
