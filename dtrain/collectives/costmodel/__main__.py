"""`python -m dtrain.collectives.costmodel`: see `dtrain.collectives.costmodel.cli`."""

from dtrain.collectives.costmodel.cli import main

main()
