"""python -m trellis COMMAND ...: the `trellis` console command (trellis.command)."""

import sys

from trellis.command import main

if __name__ == "__main__":
    sys.exit(main())
