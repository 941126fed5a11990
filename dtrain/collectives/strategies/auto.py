"""`sync.strategy: auto`: the configuration is chosen by measurement while the job trains.

Not a synchronization of its own. The engine's tuner (`dtrain.engine.autotune`) ranks the candidates of `sync.tune` with
the cost model, measures the best few on the job's own training steps, and trains on with the winner, an ordinary
strategy of this registry. Registered so that a profile naming it is checked like any other (its only key is
`sync.tune`); `attach` refuses it, since a bare training loop has no tuner behind it.
"""

from __future__ import annotations

from dtrain.collectives.strategies import CLASS_RULE_KEYS, register
from dtrain.collectives.sync import StrategyFacts


@register("auto")
class AutoSearch(StrategyFacts):
    sync_keys = ("tune", *CLASS_RULE_KEYS)  # the class rules hold for every candidate
    lossless = True  # the search measures only lossless candidates unless `sync.tune.lossy`
