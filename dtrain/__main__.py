"""`python -m dtrain <command>`, and so `torchrun -m dtrain train ...`: the `dtrain` command (`dtrain.cli`)."""

import sys

from dtrain.cli import main

sys.exit(main())
