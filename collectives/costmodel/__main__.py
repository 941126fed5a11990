"""`python -m collectives.costmodel`: see `collectives.costmodel.cli`."""

from collectives.costmodel.cli import main

main()
