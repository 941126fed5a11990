"""`python -m dtrain.collectives.bench` (under torchrun): see `dtrain.collectives.bench.cli`."""

import sys

from dtrain.collectives.bench.cli import main

sys.exit(main())
