"""The trade-off report of a set of runs (`python -m dtrain.analysis.report`, `dtrain report`): `cli` (the command and
the Markdown/HTML it writes), `sections` (a section per question, with its figures), `tables` (the tables they hold),
`scaling` (step time against the job's shape), `tuning` (`auto`'s search from tuning.csv)."""
