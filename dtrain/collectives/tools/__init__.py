"""The communication library's commands that read a whole profile's library sections (`dtrain.collectives.config`),
above the pieces they drive: `nccl` (`dtrain nccl`: per-class NCCL settings, the tuner plugin, NCCL's logs) and
`gpu_check` (two NCCL ranks on one GPU, both modes checked)."""
