"""`python -m dtrain.analysis.testbed`: the testbed's command line (`dtrain.analysis.testbed.cli`)."""

import sys

from dtrain.analysis.testbed.cli import main

sys.exit(main())
