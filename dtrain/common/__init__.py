"""Leaf helpers shared by every layer (errors, atomic output files, JSONL records, sizes and units, the strict
profile loader). They import nothing of `dtrain.collectives`, `dtrain.engine` or `dtrain.analysis`."""
