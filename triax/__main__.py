import sys

from triax.commands.cli import main

sys.exit(main())
