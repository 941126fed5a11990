"""dtrain: data-parallel training of the Transformer ("Attention Is All You Need") and a toolkit for tuning its
gradient communication.

One namespace, four layers, each importing only those below it: `dtrain.common` (leaf helpers) <
`dtrain.collectives` (the communication library; its seam is `dtrain.collectives.attach`) < `dtrain.engine` (the
model, data and trainer) < `dtrain.analysis` (the study). The `dtrain` command (`dtrain.cli`) runs their tools.
"""

__version__ = "0.2.0"
