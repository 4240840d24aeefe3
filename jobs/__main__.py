"""`python -m jobs` is `trellis embed` (jobs.run)."""

import sys

from jobs.run import main

if __name__ == "__main__":
    sys.exit(main())
