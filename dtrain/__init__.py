"""dtrain: data-parallel training of the Transformer and a toolkit for tuning its gradient communication."""
