"""`python -m dtrain.analysis.report`: the report's command line (`dtrain.analysis.report.cli`)."""

import sys

from dtrain.analysis.report.cli import main

sys.exit(main())
