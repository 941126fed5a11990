"""`sync.strategy: auto`: the configuration chosen by measurement while the job trains. `space` (what is
searched), `predict` (each candidate's step, MODELED, to prune the space), `race` (the measured race and its pick),
`search` (`OnlineSearch`, the handle `attach` gives for `auto`, registered by importing this package)."""

from dtrain.collectives.auto.search import OnlineSearch  # noqa: F401 (registers `auto`)
