#!/usr/bin/env bash
# The one-GPU check: everything dtrain can show on a single CUDA GPU in a few minutes, written under one folder.
#
#   DTRAIN_DATA_DIR=/path/to/data bash benchmarks/gpu_check.sh runs/gpu-check
#
# 1. facts: the GPU, torch, NCCL.
# 2. `dtrain nccl gpu-check`: two NCCL ranks on the one GPU, each its own NCCL host (NCCL_HOSTID: NCCL's
#    environment-variable docs), per-class
#    protocol/algorithm forced per communicator (per_group) and by dtrain's tuner plugin; NCCL's own TUNING log lines
#    parsed and checked against the requested choice.
# 3. Two-rank NCCL training of the base Transformer on the one GPU (bf16 autocast): per_class with per-class NCCL
#    settings (per_group) and the log check against the bucket plan (nccl_check.txt), then bucketed; GPU telemetry
#    in the step records, bucket timelines from CUDA events.
# 4. CUDA training steps on one rank, checkpoint averaging, beam search and sacreBLEU on test 2016.
# 4b. The same one-rank steps with torch.compile (train.compile: default): tokens/s and GPU utilization (its limit
#     leaves room for two compilations: the second batch shape compiles the model again, with dynamic shapes).
# 5. `dtrain.collectives.bench` over the two ranks with NCCL's pick (NCCL_DEBUG=INFO; with --groups 3: one to three NCCL
#    communicators all-reducing at once), two-rank ddp training and the same
#    with the tied embedding's gradient split, with the sharded strategy, with both, with the embedding sharded by
#    rows too, and with the Linear parameters all-gathered in bf16 (parameters compared), then
#    the bench with NCCL_PROTO forced to LL, LL128, Simple (socket transport: the network path's bandwidth, not
#    NVLink's).
# 6. sync.strategy: auto (attach's search in the trainer) over per-class NCCL protocols, bucket caps and sharded with
#    the split (tuning.csv: predicted and measured).
# 7. The bench's reduce-scatter and all-gather (`--collective`: nccl-tests' reduce_scatter_perf and all_gather_perf
#    tables, each row checked, #wrong) over the two NCCL ranks: the collectives `sharded` exchanges with.
# 8. Stock FSDP2 (sync.strategy: fsdp2) on NCCL, each reshard setting, the second with bf16 parameters (FSDP2's
#    mixed precision): its parameters against ddp's (fp32: equal to rounding; bf16: another forward, compared
#    only), and its checkpoint resumed under ddp.
# 9. sync.strategy: auto through `attach` in examples/plain_loop.py on NCCL: the search on the loop's own steps, its
#    candidates attached to the one model at once (only the armed one communicates), per-class NCCL protocol,
#    algorithm and CTA bounds among them (no profile applied: attach sets them on each class's communicator),
#    parameters equal on both ranks.
# 10. examples/gpt_lm.py (a GPT-style decoder, tied embedding) with auto over attach's default space on NCCL (its
#     sharded candidates included: the optimizer's state moved at each switch).
# Each part has its own time limit and the script goes on after a failed part; the exit status counts the failures.
set -uf  # -f: the part patterns below are not file globs
OUT_DIR=${1:-runs/gpu-check}
STEPS=${GPU_CHECK_STEPS:-200}        # one-rank training steps
STEPS2=${GPU_CHECK_STEPS2:-60}       # two-rank training steps per strategy
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET_S:-420}))  # every part ends by then: a lease's command limit is hard
EXTRA=${GPU_CHECK_SET:-}             # more --set overrides for every training part (a CPU rehearsal: backend gloo)
PARTS=${GPU_CHECK_PARTS:-*}          # which parts run: shell patterns, e.g. "facts bench-* train-2rank-*"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
failures=0
part() {  # part NAME LIMIT_S CMD...: run one part, its output into NAME.log and onto the terminal
    local name=$1 limit=$2 pattern selected=""; shift 2
    for pattern in $PARTS; do [[ $name == $pattern ]] && selected=1; done
    [ -n "$selected" ] || return 0
    local left=$((DEADLINE - SECONDS - 10))
    if [ "$left" -lt 20 ]; then echo "=== $name: skipped, the budget is spent"; failures=$((failures + 1)); return; fi
    [ "$limit" -le "$left" ] || limit=$left
    echo "=== $name ($(date +%T), limit ${limit}s): $*"
    local t0=$SECONDS
    # bash -c: `timeout` runs programs, and two_ranks is a function (exported below); timeout signals the whole
    # process group, so both torchruns of a stuck two-rank part go too.
    timeout --kill-after=10 "$limit" bash -c '"$@"' part "$@" >"$OUT_DIR/$name.log" 2>&1
    local rc=$?
    tail -n "${GPU_CHECK_TAIL:-25}" "$OUT_DIR/$name.log"
    echo "=== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || failures=$((failures + 1))
}
# two_ranks PORT ARGS...: `torchrun -m ARGS` as two one-rank "nodes" on the one GPU, each its own NCCL host
# (NCCL_HOSTID: NCCL's environment-variable docs)
two_ranks() {
    local port=$1; shift
    local pids=() rc=0
    for node in 0 1; do
        NCCL_HOSTID="rank$node" NCCL_SOCKET_IFNAME=lo NCCL_IB_DISABLE=1 \
            torchrun --nnodes 2 --node_rank "$node" --nproc_per_node 1 --master_addr 127.0.0.1 \
            --master_port "$port" "$@" &
        pids+=($!)
    done
    for p in "${pids[@]}"; do wait "$p" || rc=$?; done
    return $rc
}
export -f two_ranks

part facts 40 bash -c 'nvidia-smi; python3 -c "import torch; print(\"torch\", torch.__version__, \"cuda\",
    torch.version.cuda, \"nccl\", torch.cuda.nccl.version(), torch.cuda.get_device_name(0))"; nproc'

# Most telling first: a short budget still shows per-class NCCL on real communicators and real training steps.
part nccl-gpu-check 90 python3 -m dtrain nccl gpu-check --out "$OUT_DIR/nccl-gpu-check"

TRAIN="--set data.vocab_size=8000 --set train.amp=bf16 --set train.log_every=20 $EXTRA"
NOEVAL="--set train.max_steps=$STEPS2 --set train.ckpt_every=100000 --set eval.at_end=false"
# dtrain/profiles/per_group.yaml is for NVLink; over the socket transport LL is slow (docs/results.md, one H200; see
# bench-LL), so the projections go on Simple here and the rest stays.
part train-2rank-per_class 100 two_ranks 29614 -m dtrain.engine.train --profile dtrain/profiles/per_group.yaml $TRAIN \
    --set collectives.parse_log=true --set sync.classes.projection.protocol=Simple $NOEVAL \
    --run-dir "$OUT_DIR/train-2rank-per_class"
part train-2rank-bucketed 100 two_ranks 29615 -m dtrain.engine.train --profile dtrain/profiles/base.yaml $TRAIN \
    --set sync.strategy=bucketed $NOEVAL --run-dir "$OUT_DIR/train-2rank-bucketed"
part train-1rank 120 python3 -m dtrain.engine.train --profile dtrain/profiles/base.yaml $TRAIN --set train.max_steps="$STEPS" \
    --set train.ckpt_every=100 --set train.average_last=2 --set eval.batch_size=256 --run-dir "$OUT_DIR/train-1rank"

# The same steps with the model compiled (train.compile): tokens/s and GPU utilization of both in their step records
# (telemetry), against train-1rank's; no final evaluation, the comparison is the step.
part train-1rank-compiled 240 python3 -m dtrain.engine.train --profile dtrain/profiles/base.yaml $TRAIN --set train.max_steps="$STEPS" \
    --set train.compile=default --set train.ckpt_every=100000 --set eval.at_end=false \
    --run-dir "$OUT_DIR/train-1rank-compiled"

BENCH="-m dtrain.collectives.bench -b 8 -e ${GPU_CHECK_MAXBYTES:-256M} -f 4 -n 10"
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,ENV,TUNING NCCL_DEBUG_FILE="$OUT_DIR/bench-nccl.%h.%p.log" \
    part bench-nccl-pick 75 two_ranks 29611 $BENCH --path all --groups 3 --json "$OUT_DIR/bench.json" \
    --csv "$OUT_DIR/bench.csv"
part train-2rank-ddp 100 two_ranks 29613 -m dtrain.engine.train --profile dtrain/profiles/base.yaml $TRAIN $NOEVAL \
    --run-dir "$OUT_DIR/train-2rank-ddp"
# The tied embedding's split gradient on NCCL (its V-byte mask all-reduce in uint8 MAX, then each lookup's touched
# rows from inside backward), the same steps as ddp's run above: the largest parameter difference between the two
# final checkpoints.
part train-2rank-tied-split 100 two_ranks 29616 -m dtrain.engine.train --profile dtrain/profiles/base.yaml $TRAIN $NOEVAL \
    --set sync.strategy=bucketed --set sync.classes.embedding.tied_split=true \
    --run-dir "$OUT_DIR/train-2rank-tied-split"
part tied-split-vs-ddp 30 python3 -m dtrain.engine.checkpoint diff "$OUT_DIR/train-2rank-ddp" \
    "$OUT_DIR/train-2rank-tied-split"
# The sharded strategy on NCCL (point-to-point reduce-scatter in backward, all-gather in the next forward, waited
# for per module on the CUDA stream), the same steps again: its parameters against ddp's.
part train-2rank-sharded 100 two_ranks 29617 -m dtrain.engine.train --profile dtrain/profiles/base.yaml $TRAIN $NOEVAL \
    --set sync.strategy=sharded --set sync.bucket_cap_mb=2 --run-dir "$OUT_DIR/train-2rank-sharded"
part sharded-vs-ddp 30 python3 -m dtrain.engine.checkpoint diff "$OUT_DIR/train-2rank-ddp" "$OUT_DIR/train-2rank-sharded"
# Sharded with the split (the embedding replicated: its all-reduce on the world's NCCL communicator beside the
# shards' point-to-point one, its rows on the split's own), the same steps: against the bucketed split's parameters
# (equal on CPU, bit for bit) and ddp's.
part train-2rank-sharded-split 100 two_ranks 29619 -m dtrain.engine.train --profile dtrain/profiles/base.yaml $TRAIN $NOEVAL \
    --set sync.strategy=sharded --set sync.bucket_cap_mb=2 --set sync.classes.embedding.tied_split=true \
    --run-dir "$OUT_DIR/train-2rank-sharded-split"
part sharded-split-vs-split 30 python3 -m dtrain.engine.checkpoint diff "$OUT_DIR/train-2rank-tied-split" \
    "$OUT_DIR/train-2rank-sharded-split"
part sharded-split-vs-ddp 30 python3 -m dtrain.engine.checkpoint diff "$OUT_DIR/train-2rank-ddp" \
    "$OUT_DIR/train-2rank-sharded-split"
# The embedding sharded by rows too (sync.shard_tied_split: its rows reduce-scattered and fetched by each lookup as
# batched NCCL sends and receives on the split's communicator, the all-gathers in waves): the same steps, against the
# bucketed split's parameters (equal on CPU, bit for bit).
part train-2rank-sharded-rows 100 two_ranks 29624 -m dtrain.engine.train --profile dtrain/profiles/base.yaml $TRAIN $NOEVAL \
    --set sync.strategy=sharded --set sync.bucket_cap_mb=2 --set sync.classes.embedding.tied_split=true \
    --set sync.shard_tied_split=true --run-dir "$OUT_DIR/train-2rank-sharded-rows"
part sharded-rows-vs-split 30 python3 -m dtrain.engine.checkpoint diff "$OUT_DIR/train-2rank-tied-split" \
    "$OUT_DIR/train-2rank-sharded-rows"
# The sharded split with its Linear parameters all-gathered in bf16 (sync.gather_dtype: the forward's bf16 autocast
# on CUDA rounds them the same way), the same steps: against the fp32 all-gather's parameters (equal on CPU, bit for
# bit).
part train-2rank-sharded-bf16-gather 100 two_ranks 29625 -m dtrain.engine.train --profile dtrain/profiles/base.yaml $TRAIN $NOEVAL \
    --set sync.strategy=sharded --set sync.bucket_cap_mb=2 --set sync.classes.embedding.tied_split=true \
    --set sync.gather_dtype=bf16 --run-dir "$OUT_DIR/train-2rank-sharded-bf16-gather"
part sharded-bf16-gather-vs-fp32 30 python3 -m dtrain.engine.checkpoint diff "$OUT_DIR/train-2rank-sharded-split" \
    "$OUT_DIR/train-2rank-sharded-bf16-gather"
# sync.strategy: auto on NCCL: attach's search, which the trainer attaches (one model, no replica): the probe's
# steps under ddp-25, the in-job timing of the NCCL group, the prediction, and the paired race on real CUDA steps,
# over per-class NCCL protocols (per_group), bucket caps and sharded with the split (a switch to or from it moves
# Adam's state through NCCL all-gathers and lays its flat buffers out again on the GPU); tuning.csv holds the search.
AUTO_SPACE="{bucketed-2: {strategy: bucketed, bucket_cap_mb: 2}, ddp-25: {strategy: ddp, bucket_cap_mb: 25},
    proj-LL: {strategy: per_class, classes.projection.protocol: LL},
    proj-LL128: {strategy: per_class, classes.projection.protocol: LL128},
    proj-Simple: {strategy: per_class, classes.projection.protocol: Simple},
    sharded-2-split: {strategy: sharded, bucket_cap_mb: 2, classes.embedding.tied_split: true}}"
part train-2rank-auto 150 two_ranks 29618 -m dtrain.engine.train --profile dtrain/profiles/base.yaml $TRAIN $NOEVAL \
    --set sync.strategy=auto --set collectives.mode=per_group --set "sync.tune.candidates=$AUTO_SPACE" \
    --set sync.tune.top_k=6 --set sync.tune.budget_steps=50 --run-dir "$OUT_DIR/train-2rank-auto"
port=29620
for proto in LL LL128 Simple; do
    port=$((port + 1))
    NCCL_PROTO=$proto part "bench-$proto" 50 two_ranks $port $BENCH --path raw --json "$OUT_DIR/bench-$proto.json"
done
part bench-rs-ag 60 two_ranks 29627 $BENCH --collective reduce_scatter,all_gather --json "$OUT_DIR/bench-rs-ag.json"
# Stock FSDP2 on NCCL: all-gathers and reduce-scatters on its own CUDA streams (on CPU they block the computing
# thread), the same steps as ddp's; then its checkpoint continues under ddp for 10 steps.
part train-2rank-fsdp2 100 two_ranks 29628 -m dtrain.engine.train --profile dtrain/profiles/base.yaml $TRAIN $NOEVAL \
    --set sync.strategy=fsdp2 --run-dir "$OUT_DIR/train-2rank-fsdp2"
part fsdp2-vs-ddp 30 python3 -m dtrain.engine.checkpoint diff "$OUT_DIR/train-2rank-ddp" "$OUT_DIR/train-2rank-fsdp2"
part train-2rank-fsdp2-keep-bf16 100 two_ranks 29629 -m dtrain.engine.train --profile dtrain/profiles/base.yaml \
    $TRAIN $NOEVAL --set sync.strategy=fsdp2 --set sync.reshard_after_forward=false --set sync.gather_dtype=bf16 \
    --run-dir "$OUT_DIR/train-2rank-fsdp2-keep-bf16"
part fsdp2-bf16-vs-ddp 30 python3 -m dtrain.engine.checkpoint diff "$OUT_DIR/train-2rank-ddp" \
    "$OUT_DIR/train-2rank-fsdp2-keep-bf16"
part fsdp2-resumed-under-ddp 100 two_ranks 29630 -m dtrain.engine.train --profile dtrain/profiles/base.yaml $TRAIN \
    $NOEVAL --set sync.strategy=ddp --resume --set train.max_steps=$((STEPS2 + 10)) \
    --run-dir "$OUT_DIR/train-2rank-fsdp2"

# The per-class NCCL candidates are attach's own (its default space on NCCL): no profile was applied, so each class's
# communicator gets its protocol, algorithm and CTA bounds as it is created (per_group's way).
ATTACH_SPACE="{ddp-25: {strategy: ddp, bucket_cap_mb: 25}, bucketed-0.5: {strategy: bucketed, bucket_cap_mb: 0.5},
    per_class-1-LL: {strategy: per_class, bucket_cap_mb: 2, classes.projection.bucket_cap_mb: 1,
        classes.projection.protocol: LL, classes.norm_bias.bucket_cap_mb: 1, classes.norm_bias.protocol: LL,
        classes.embedding.protocol: Simple, classes.embedding.max_ctas: 16},
    per_class-2-Tree: {strategy: per_class, bucket_cap_mb: 2, classes.embedding.algorithm: Tree,
        classes.norm_bias.algorithm: Tree, classes.projection.algorithm: Tree, classes.ffn.algorithm: Tree}}"
part plain-loop-auto 60 two_ranks 29631 examples/plain_loop.py --backend nccl --strategy auto --steps 60 \
    --candidates "$ATTACH_SPACE"
# The language model with attach's default space on CUDA: planned candidates free their bucket buffers (sharded: its
# peers' chunks too) while others train and lay them out again on the GPU; the race's table and the peak host RSS.
part gpt-lm-auto 120 two_ranks 29632 examples/gpt_lm.py --backend nccl --steps 160

echo "=== done ($(date +%T)): $failures part(s) failed"
exit "$failures"
