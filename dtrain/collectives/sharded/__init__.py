"""`sync.strategy: sharded`, in one place.

- `exchange`: each bucket's exchange plan (sharded, replicated or by rows; which members travel narrowed; its bytes),
  decided once from the model, read by the reducer and by the simulator;
- `reducer`: the sharded reducer that runs the plans (reduce-scatter in backward, all-gather in the next forward);
- `rows`: the split tied embedding sharded by whole rows, each lookup fetching its tokens' rows;
- `p2p`: the point-to-point exchanges both use, and the thread that completes them;
- `strategy`: the `sharded` strategy (its bucket plan) and its `GradSync` handle (the seam's sharded side: shards
  for the optimizer, the global norm, whole-model optimizer state).
"""
