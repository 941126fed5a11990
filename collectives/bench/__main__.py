"""`python -m collectives.bench` (under torchrun): see `collectives.bench.cli`."""

import sys

from collectives.bench.cli import main

sys.exit(main())
