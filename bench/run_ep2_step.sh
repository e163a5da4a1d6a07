#!/usr/bin/env bash
# The EP 2 training-step measurements (issue #20) on a 2×H200 machine, in parts that each fit
# one device call of 10 minutes; every run is timed and skipped when the part's budget is spent.
#
#   PART=1 bash bench/run_ep2_step.sh   # step profiles of configs/olmoe_bench.yaml (16 layers, EP 2,
#                                       # 16,384 tokens a step): NCCL, NCCL + overlap_chunks 2, P2P,
#                                       # force_balance with 1 and 2 chunks; then the NCCL/P2P GPU tests
#   PART=2 bash bench/run_ep2_step.sh   # the realistic batch (8 micro-batches, 131,072 tokens a step)
#                                       # with 1 and 2 chunks, configs/mixtral_bench.yaml, and 150
#                                       # training steps of olmoe_bench for the routing per layer
#   PART=3 bash bench/run_ep2_step.sh   # the memory model's FSDP cases (bench/memory_check.py) and the
#                                       # other multi-GPU tests
#   PART=4 bash bench/run_ep2_step.sh   # after the overlap fix: 2 chunks at one and 8 micro-batches; P2P
#                                       # at 8 micro-batches (also force_balance, replicate); the NCCL/P2P
#                                       # GPU tests; mixtral_bench with P2P
#   PART=5 bash bench/run_ep2_step.sh   # with olmoe_bench's routing-health options: 100 training steps
#                                       # in the fastest layout (P2P, replicate, 8 micro-batches), the
#                                       # routing of every layer and the MFU; its step profile; the
#                                       # shipped layout's step profile
#   PART=6 bash bench/run_ep2_step.sh   # after the NCCL token rows, the expert-major rows of both
#                                       # transports and P2P's row weights (the experts weight, its
#                                       # combine keeps no rows): the 2-GPU tests, then the step
#                                       # profiles of NCCL and P2P in the bar's layout (replicate, 8
#                                       # micro-batches) and of the shipped layout
#   PART=7 bash bench/run_ep2_step.sh   # after the symmetric buffers' zeroing fix: the P2P 2-GPU tests,
#                                       # P2P in the bar's layout, the shipped layout
#   PART=8 bash bench/run_ep2_step.sh   # NCCL against P2P in the bar's layout, alternating, 2 rounds
#   PART=9 bash bench/run_ep2_step.sh   # the NCCL dispatcher's padded exchange (no host sync): its 2-GPU
#                                       # tests, then NCCL exact, NCCL padded and P2P in the bar's layout,
#                                       # alternating (needs H200s: the layout holds ~84-97 GB a GPU)
#   PART=10 bash bench/run_ep2_step.sh  # after the lazily derived MoE stats: the bar's 100-step training run
#                                       # (P2P, replicate, 8 micro-batches), then P2P's step profile beside
#                                       # the tree in .base (git archive of the commit before) when present
#   PART=11 bash bench/run_ep2_step.sh  # PART=10's A/B again in the other order (.base first), then NCCL
#                                       # with exact sizes in the same layout
#   PART=12 bash bench/run_ep2_step.sh  # the planned garbage collection (train.gc_every 50, the default)
#                                       # against Python's automatic one (0), P2P in the bar's layout,
#                                       # alternating, 2 rounds, with the per-rank table (the ranks' skew)
#   PART=13 bash bench/run_ep2_step.sh  # the P2P token rows: the 2-GPU P2P tests, then P2P in the bar's
#                                       # layout against the tree in .base (git archive 2a730b5: a row per
#                                       # pair both ways), alternating, 2 rounds, with the per-rank table
#   PART=14 bash bench/run_ep2_step.sh  # PART=13 with the branch p2p-token-dispatch in .branch (git archive:
#                                       # the way out in token rows too): both trees' P2P 2-GPU tests (the
#                                       # branch's kernel tests too), then .base, this tree and .branch in the
#                                       # bar's layout, round 1 in that order, round 2 reversed (ROUNDS, default
#                                       # "1 2"; TESTS=branch: the branch's tests only, none: no tests)
#   PART=15 bash bench/run_ep2_step.sh  # the exchange's wait for a later rank against its own time: this
#                                       # tree (twice), .branch (twice) and this tree with force_balance
#                                       # (benchmark mode: the ranks' expert work equal), P2P, bar's layout
#   PART=16 bash bench/run_ep2_step.sh  # each rank's host bound to its GPU's NUMA node (torchrun
#                                       # --numa-binding=node) against no binding, alternating, 2 rounds
#   PART=17 bash bench/run_ep2_step.sh  # the host: one profile with the launches per category and rank 0's
#                                       # CPU ops (--host-table 40), then OMP_NUM_THREADS nproc/2 against 4
#                                       # and 1 per rank, alternating, 2 rounds (PART=15/16: the late rank's
#                                       # host, not the routing, makes the exposed exchange)
#   PART=18 bash bench/run_ep2_step.sh  # the router's fused tail and the counting-sort plan (launches a
#                                       # step cut): the 2-GPU tests of tests/test_parallel.py, then the
#                                       # tree in .base (git archive of the commit before) against this tree,
#                                       # P2P in the bar's layout, alternating, 3 rounds
#   PART=19 bash bench/run_ep2_step.sh  # PART=18 with the router losses' kernel too: the router, loss and
#                                       # sort kernels' and the layer's tests on one GPU, the 2-GPU tests of
#                                       # test_parallel.py and test_train.py, then .base against this tree,
#                                       # 2 rounds
#   PART=20 bash bench/run_ep2_step.sh  # where the late rank's host loses its time (step_profile's idle-gap
#                                       # table: many short gaps or a few stalls) and more rounds of the A/B:
#                                       # this tree against .base, P2P in the bar's layout, --timed 6, 3 rounds
#                                       # (first the router, loss and sort kernels' tests on one GPU)
#   PART=21 bash bench/run_ep2_step.sh  # the host's own time: one Triton launch's host cost (bench/launch.py), then
#                                       # the host's time per step (bench/host_step.py, tiny dims: the GPU never the
#                                       # bottleneck) of this tree against .base, alternating, 2 rounds, with cProfile
#                                       # in round 1; first the kernels' tests on one GPU, last the 2-GPU tests of
#                                       # test_parallel.py
#   PART=22 bash bench/run_ep2_step.sh  # train.cuda_graph at EP 2 (P2P flags' targets on the device): the P2P
#                                       # kernels' tests, the graph's 2-GPU test and the P2P tests of
#                                       # test_parallel.py, then P2P in the bar's layout eager against
#                                       # --train.cuda_graph=true, alternating, 2 rounds (ROUNDS="1": one)
#   PART=23 bash bench/run_ep2_step.sh  # parallel.overlap_chunks with P2P (the exchange on a side stream): the
#                                       # P2P 2-GPU tests (their chunked cases now P2P's too), the graph's 2-GPU
#                                       # tests (1 and 2 chunks), then P2P graphed in the bar's layout with 1
#                                       # against 2 chunks, alternating (ROUNDS, default "1 2"), and 2 chunks eager;
#                                       # TESTS=0 skips the tests, TESTS=all runs last session's one-GPU ones too
#   PART=24 bash bench/run_ep2_step.sh  # parallel.p2p_copy=copy_engine (the token rows as blocks on the copy
#                                       # engines): probe/ce_overlap.py when present (PROBE=0 skips it), the P2P
#                                       # 2-GPU tests (both modes) and the graph's 2-GPU tests (TESTS=0 skips them),
#                                       # then P2P graphed in the bar's layout: kernels 1 chunk, copy_engine 1 and
#                                       # 2 chunks, alternating (ROUNDS, default "1 2"; ROUNDS= runs none)
#   PART=25 bash bench/run_ep2_step.sh  # after the one-program waits and the own block read in place: the P2P
#                                       # 2-GPU, graph and shared-GPU tests (TESTS=0 skips them), then PART=24's
#                                       # three graphed profiles and the copy engines at 4 micro-batches of twice
#                                       # the tokens (ROUNDS, default "1"; ROUNDS= runs none), then
#                                       # probe/tbo.py's two-micro-batch modes when present (PROBE=0 skips them)
#   PART=26 bash bench/run_ep2_step.sh  # the bar's claims again on another machine: P2P graphed in the bar's layout,
#                                       # copy_engine and kernels at 8 micro-batches and copy_engine at 4 of 8 x 2048,
#                                       # alternating (ROUNDS, default "1 2")
#   PART=27 bash bench/run_ep2_step.sh  # 100 training steps in the fastest layout measured (P2P, copy engines,
#                                       # replicate, graphed, 4 micro-batches of 8 x 2048): MFU and every
#                                       # layer's load max/mean
#
# Each profile appends its table to $OUT/step_profile_ep2.md; the closing table has one row per run
# (step ms and MFU without the profiler, peak memory, exposed all-to-all % of the profiled step, the
# worst layer's load max/mean at the end). $OUT defaults to /tmp/run_ep2.
set -uo pipefail
cd "$(dirname "$0")/.."
# half the cores each for the 2 ranks: a 2026-11-27 machine showed nproc 8, where 8 threads each
# oversubscribed it (its steps were host-bound)
export OUT=${OUT:-/tmp/run_ep2} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=$(( $(nproc) > 2 ? $(nproc) / 2 : 1 ))
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRITON_CACHE_AUTOTUNING=1  # later launches reuse the first one's autotuning
BUDGET=${BUDGET:-570}
# the bar's layout (#20): P2P, replicated dense weights, 8 micro-batches (131,072 tokens a step)
BAR="--parallel.dispatcher=p2p --parallel.data_parallel=replicate --train.grad_accum=8"
PART=${PART:-1}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader

left() { echo $((BUDGET - SECONDS)); }
slug() { echo "$1" | tr -c 'a-zA-Z0-9\n' _; }  # a run's label as a file name

# prof LABEL NEED_S CONFIG [step_profile args and --section.key=value overrides]
prof() {
    local label=$1 need=$2 config=$3 start=$SECONDS
    shift 3
    if [ "$(left)" -lt "$need" ]; then echo "[skipped: $label, $(left) s left]"; return; fi
    local log="$OUT/$(slug "$label").log"
    timeout "$(left)" python3 -m torch.distributed.run --standalone --nproc_per_node=2 ${TORCHRUN_ARGS:-} bench/step_profile.py \
        --config "$config" --label "$label" --out "$OUT/step_profile_ep2.md" "$@" > "$log" 2>&1
    echo "[$label: exit $? after $((SECONDS - start)) s]"
    grep -h "^SUMMARY" "$log" >> "$OUT/summary.txt" || tail -5 "$log"
}

# p2p_gpu_tests S1 S2: the P2P 2-GPU tests of tests/test_parallel.py (at most S1 seconds), then the graph's
# 2-GPU tests (S2), each test's name and outcome
p2p_gpu_tests() {
    MOE_AUTOTUNE=0 timeout "$1" python3 -m pytest -v -m multigpu -k "p2p or P2P" tests/test_parallel.py 2>&1 \
        | grep -E "PASS|FAIL|ERROR|passed|failed|Error" | tail -8 | tee "$OUT/gpu_tests_1.log"
    MOE_AUTOTUNE=0 timeout "$2" python3 -m pytest -v -m multigpu tests/test_step_graph.py 2>&1 \
        | grep -E "PASS|FAIL|ERROR|passed|failed|Error" | tail -8 | tee "$OUT/gpu_tests_2.log"
}

# routing NAME NEED_S [--section.key=value overrides]: a training run of olmoe_bench, printing its
# logged steps' loss, tokens/s, MFU and every layer's load max/mean
routing() {
    local name=$1 need=$2
    shift 2
    if [ "$(left)" -lt "$need" ]; then echo "[skipped: routing run $name, $(left) s left]"; return; fi
    timeout "$(left)" python3 -m torch.distributed.run --standalone --nproc_per_node=2 train/train.py \
        --config configs/olmoe_bench.yaml --log.every=10 --log.heatmap_every=0 --log.wandb_mode=disabled \
        --log.progress=false --checkpoint.every=0 --log.dir=/tmp/ep2_runs --log.run_name="$name" "$@" > "$OUT/$name.log" 2>&1
    echo "[routing run $name: exit $?]"
    cp "/tmp/ep2_runs/$name/metrics.jsonl" "$OUT/${name}_metrics.jsonl"
    python3 - "$OUT/${name}_metrics.jsonl" <<'EOF'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    ks = sorted((k for k in r if k.startswith("moe/layer") and k.endswith("/load_imbalance")), key=lambda k: int(k.split("/")[1][5:]))
    if ks:
        print(f"step {r['step']:4d} loss {r.get('train/loss', float('nan')):.3f} tok/s {r.get('perf/tokens_per_s', 0):,.0f} "
              f"mfu {r.get('perf/mfu', 0):.3f} worst {max(r[k] for k in ks):.2f} | " + " ".join(f"{r[k]:.1f}" for k in ks))
EOF
}

if [ "$PART" = 1 ]; then
    P="--warm 8 --steps 3 --timed 10"
    prof "olmoe_bench EP 2, NCCL, one chunk" 90 configs/olmoe_bench.yaml $P
    prof "olmoe_bench EP 2, NCCL, overlap_chunks 2" 70 configs/olmoe_bench.yaml $P --parallel.overlap_chunks=2
    prof "olmoe_bench EP 2, P2P" 70 configs/olmoe_bench.yaml $P --parallel.dispatcher=p2p
    prof "olmoe_bench EP 2, NCCL, one chunk, force_balance (benchmark mode)" 70 configs/olmoe_bench.yaml $P --moe.force_balance=true
    prof "olmoe_bench EP 2, NCCL, overlap_chunks 2, force_balance (benchmark mode)" 70 configs/olmoe_bench.yaml $P \
        --moe.force_balance=true --parallel.overlap_chunks=2
    if [ "$(left)" -gt 60 ]; then
        MOE_AUTOTUNE=0 timeout "$(left)" python3 -m pytest -q -m multigpu tests/test_parallel.py 2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
    fi
elif [ "$PART" = 2 ]; then
    A="--warm 3 --steps 1 --timed 3 --train.grad_accum=8"
    prof "olmoe_bench EP 2, NCCL, one chunk, 8 micro-batches" 100 configs/olmoe_bench.yaml $A
    prof "olmoe_bench EP 2, NCCL, overlap_chunks 2, 8 micro-batches" 90 configs/olmoe_bench.yaml $A --parallel.overlap_chunks=2
    prof "mixtral_bench (8 layers) EP 2, NCCL, one chunk" 90 configs/mixtral_bench.yaml --warm 6 --steps 2 --timed 8
    prof "mixtral_bench (8 layers) EP 2, NCCL, 8 micro-batches" 90 configs/mixtral_bench.yaml $A
    # the routing per layer over 150 steps, the default coefficients
    routing routing 110 --train.steps=150
elif [ "$PART" = 4 ]; then
    P="--warm 8 --steps 3 --timed 10"
    A="--warm 3 --steps 1 --timed 3 --train.grad_accum=8"
    prof "olmoe_bench EP 2, NCCL, overlap_chunks 2" 90 configs/olmoe_bench.yaml $P --parallel.overlap_chunks=2
    prof "olmoe_bench EP 2, P2P, 8 micro-batches" 60 configs/olmoe_bench.yaml $A --parallel.dispatcher=p2p
    prof "olmoe_bench EP 2, P2P, 8 micro-batches, force_balance (benchmark mode)" 60 configs/olmoe_bench.yaml $A \
        --parallel.dispatcher=p2p --moe.force_balance=true
    prof "olmoe_bench EP 2, NCCL, overlap_chunks 2, 8 micro-batches" 60 configs/olmoe_bench.yaml $A --parallel.overlap_chunks=2
    prof "olmoe_bench EP 2, P2P, 8 micro-batches, replicate" 60 configs/olmoe_bench.yaml $A --parallel.dispatcher=p2p \
        --parallel.data_parallel=replicate
    prof "olmoe_bench EP 2, NCCL, overlap_chunks 2, force_balance (benchmark mode)" 40 configs/olmoe_bench.yaml $P \
        --moe.force_balance=true --parallel.overlap_chunks=2
    if [ "$(left)" -gt 80 ]; then
        MOE_AUTOTUNE=0 timeout "$(left)" python3 -m pytest -q -m multigpu tests/test_parallel.py 2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
    fi
    prof "mixtral_bench (8 layers) EP 2, P2P" 60 configs/mixtral_bench.yaml --warm 6 --steps 2 --timed 8 --parallel.dispatcher=p2p
elif [ "$PART" = 5 ]; then
    # the bar's run: olmoe_bench with its routing-health options (since 2026-11-24's fifth session)
    # in its fastest layout, trained 100 steps (the routing of every layer and the logged MFU), then
    # its step profile (the exposed exchange) and the default layout's for the before/after
    FAST="$BAR"
    routing healthy_fast 260 --train.steps=100 $FAST
    prof "olmoe_bench (routing options) EP 2, P2P, replicate, 8 micro-batches" 90 configs/olmoe_bench.yaml \
        --warm 3 --steps 1 --timed 3 $FAST
    prof "olmoe_bench (routing options) EP 2, NCCL, fsdp, one micro-batch (as shipped)" 90 configs/olmoe_bench.yaml \
        --warm 8 --steps 3 --timed 10
elif [ "$PART" = 6 ]; then
    # after the NCCL dispatcher's token rows (each token sent to a rank once, the experts weight)
    # and both transports' expert-major rows (one segment per expert): the 2-GPU tests first
    # (neither has run on GPUs), then the step in the bar's layout with NCCL beside P2P, then the
    # shipped layout
    MOE_AUTOTUNE=0 timeout 200 python3 -m pytest -q -m multigpu tests/test_parallel.py 2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
    FAST="--parallel.data_parallel=replicate --train.grad_accum=8"
    prof "olmoe_bench EP 2, NCCL token rows, replicate, 8 micro-batches" 90 configs/olmoe_bench.yaml \
        --warm 3 --steps 1 --timed 3 $FAST
    prof "olmoe_bench EP 2, P2P, replicate, 8 micro-batches" 90 configs/olmoe_bench.yaml \
        --warm 3 --steps 1 --timed 3 $FAST --parallel.dispatcher=p2p
    prof "olmoe_bench EP 2, NCCL token rows, fsdp, one micro-batch (as shipped)" 80 configs/olmoe_bench.yaml \
        --warm 8 --steps 3 --timed 10
elif [ "$PART" = 7 ]; then
    # after the symmetric buffers are zeroed before their addresses are shared (PART=6's P2P runs
    # waited forever on a lazily allocated slot): the P2P 2-GPU tests, then P2P in the bar's
    # layout and the shipped layout (PART=6 measured NCCL in the bar's layout)
    MOE_AUTOTUNE=0 timeout 240 python3 -m pytest -q -m multigpu tests/test_parallel.py -k p2p 2>&1 | tail -8 \
        | tee "$OUT/gpu_tests.log"
    prof "olmoe_bench EP 2, P2P, replicate, 8 micro-batches" 90 configs/olmoe_bench.yaml \
        --warm 3 --steps 1 --timed 3 --parallel.data_parallel=replicate --train.grad_accum=8 --parallel.dispatcher=p2p
    prof "olmoe_bench EP 2, NCCL token rows, fsdp, one micro-batch (as shipped)" 80 configs/olmoe_bench.yaml \
        --warm 8 --steps 3 --timed 10
elif [ "$PART" = 8 ]; then
    # NCCL (token rows) against P2P in the bar's layout on one machine, alternating (PART=6 and 7
    # measured them on two machines whose hosts differed), profiled with the host table
    FAST="--warm 3 --steps 1 --timed 3 --parallel.data_parallel=replicate --train.grad_accum=8 --host-table 25"
    for round in 1 2; do
        prof "olmoe_bench EP 2, NCCL token rows, replicate, 8 micro-batches (round $round)" 70 configs/olmoe_bench.yaml $FAST
        prof "olmoe_bench EP 2, P2P, replicate, 8 micro-batches (round $round)" 70 configs/olmoe_bench.yaml $FAST \
            --parallel.dispatcher=p2p
    done
elif [ "$PART" = 9 ]; then
    MOE_AUTOTUNE=0 timeout 240 python3 -m pytest -q -m multigpu tests/test_parallel.py tests/test_train.py -k \
        "nccl_two_gpus or padded_nccl" 2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
    FAST="--warm 3 --steps 1 --timed 3 --parallel.data_parallel=replicate --train.grad_accum=8 --host-table 25"
    for round in 1 2; do
        prof "olmoe_bench EP 2, NCCL exact sizes, replicate, 8 micro-batches (round $round)" 70 configs/olmoe_bench.yaml $FAST
        prof "olmoe_bench EP 2, NCCL padded, replicate, 8 micro-batches (round $round)" 70 configs/olmoe_bench.yaml $FAST \
            --parallel.nccl_sizes=padded
        prof "olmoe_bench EP 2, P2P, replicate, 8 micro-batches (round $round)" 70 configs/olmoe_bench.yaml $FAST \
            --parallel.dispatcher=p2p
    done
elif [ "$PART" = 10 ]; then
    FAST="$BAR"
    routing healthy_fast 260 --train.steps=100 $FAST
    P="--warm 3 --steps 1 --timed 3 --host-table 25 $FAST"
    prof "olmoe_bench EP 2, P2P, replicate, 8 micro-batches (this tree)" 70 configs/olmoe_bench.yaml $P
    if [ -d .base ]; then
        (cd .base && prof "olmoe_bench EP 2, P2P, replicate, 8 micro-batches (.base: $(cat REV 2>/dev/null))" 70 \
            configs/olmoe_bench.yaml $P)
    fi
elif [ "$PART" = 11 ]; then
    P="--warm 3 --steps 1 --timed 3 --host-table 25 --parallel.data_parallel=replicate --train.grad_accum=8"
    if [ -d .base ]; then
        (cd .base && prof "olmoe_bench EP 2, P2P, replicate, 8 micro-batches (.base: $(cat REV 2>/dev/null), round 2)" 70 \
            configs/olmoe_bench.yaml $P --parallel.dispatcher=p2p)
    fi
    prof "olmoe_bench EP 2, P2P, replicate, 8 micro-batches (this tree, round 2)" 70 configs/olmoe_bench.yaml $P \
        --parallel.dispatcher=p2p
    prof "olmoe_bench EP 2, NCCL exact sizes, replicate, 8 micro-batches (this tree)" 70 configs/olmoe_bench.yaml $P
elif [ "$PART" = 12 ]; then
    P="--warm 3 --steps 1 --timed 6 $BAR"
    for round in 1 2; do
        prof "olmoe_bench EP 2, P2P, replicate, 8 micro-batches, gc_every 50 (round $round)" 70 configs/olmoe_bench.yaml $P
        prof "olmoe_bench EP 2, P2P, replicate, 8 micro-batches, gc_every 0 (round $round)" 70 configs/olmoe_bench.yaml $P \
            --train.gc_every=0
    done
elif [ "$PART" = 13 ]; then
    MOE_AUTOTUNE=0 timeout 200 python3 -m pytest -q -m multigpu tests/test_parallel.py tests/test_train.py -k p2p 2>&1 \
        | tail -8 | tee "$OUT/gpu_tests.log"
    P="--warm 3 --steps 1 --timed 3 $BAR"
    for round in 1 2; do
        if [ -d .base ]; then
            (cd .base && prof "olmoe_bench EP 2, P2P, replicate, 8 micro-batches (.base: $(cat REV 2>/dev/null), round $round)" \
                70 configs/olmoe_bench.yaml $P)
        fi
        prof "olmoe_bench EP 2, P2P token rows, replicate, 8 micro-batches (round $round)" 70 configs/olmoe_bench.yaml $P
    done
elif [ "$PART" = 14 ]; then
    p2p_tests() {  # the P2P tests on 2 GPUs of the tree in the working directory; exit status of pytest
        MOE_AUTOTUNE=0 timeout 240 python3 -m pytest -q -x -m multigpu tests/test_parallel.py tests/test_train.py -k p2p "$@" 2>&1 \
            | tail -6 | tee -a "$OUT/gpu_tests.log"
        return "${PIPESTATUS[0]}"
    }
    BRANCH_OK=0
    if [ "${TESTS:-both}" != none ]; then
        if [ "${TESTS:-both}" = both ]; then echo "== this tree ==" | tee -a "$OUT/gpu_tests.log"; p2p_tests; fi
        if [ -d .branch ]; then
            echo "== .branch: $(cat .branch/REV) ==" | tee -a "$OUT/gpu_tests.log"
            (cd .branch && MOE_AUTOTUNE=0 timeout 150 python3 -m pytest -q -x tests/test_p2p_rows.py 2>&1 | tail -4 \
                | tee -a "$OUT/gpu_tests.log" && exit "${PIPESTATUS[0]}") && (cd .branch && p2p_tests) && BRANCH_OK=1
        fi
    else
        BRANCH_OK=1  # TESTS=none: a later call on the same trees, whose tests passed in an earlier one
    fi
    for d in .base .branch; do [ -d $d ] && cp bench/step_profile.py $d/bench/; done  # one profile script for all trees
    P="--warm 3 --steps 1 --timed 3 $BAR"
    base() { [ -d .base ] && (cd .base && prof "P2P, a row per pair both ways (.base: $(cat REV), round $1)" 70 configs/olmoe_bench.yaml $P); }
    here() { prof "P2P, token rows back (this tree, round $1)" 70 configs/olmoe_bench.yaml $P; }
    branch() { [ "$BRANCH_OK" = 1 ] && (cd .branch && prof "P2P, token rows both ways (.branch: $(cat REV), round $1)" 70 configs/olmoe_bench.yaml $P); }
    for round in ${ROUNDS:-1 2}; do
        if [ $((round % 2)) = 1 ]; then base "$round"; here "$round"; branch "$round"
        else branch "$round"; here "$round"; base "$round"; fi
    done
elif [ "$PART" = 15 ]; then
    [ -d .branch ] && cp bench/step_profile.py .branch/bench/
    P="--warm 3 --steps 1 --timed 3 $BAR"
    for round in 1 2; do
        prof "P2P, token rows back (this tree, round $round)" 60 configs/olmoe_bench.yaml $P
        [ -d .branch ] && (cd .branch && prof "P2P, token rows both ways (.branch: $(cat REV), round $round)" 60 \
            configs/olmoe_bench.yaml $P)
        [ "$round" = 1 ] && prof "P2P, token rows back (this tree), force_balance (benchmark mode)" 60 \
            configs/olmoe_bench.yaml $P --moe.force_balance=true
    done
elif [ "$PART" = 16 ]; then
    P="--warm 3 --steps 1 --timed 3 $BAR"
    for round in 1 2; do
        prof "P2P, no binding (round $round)" 55 configs/olmoe_bench.yaml $P
        TORCHRUN_ARGS=--numa-binding=node prof "P2P, --numa-binding=node (round $round)" 55 configs/olmoe_bench.yaml $P
    done
elif [ "$PART" = 17 ]; then
    P="--warm 3 --steps 1 --timed 3 $BAR"
    prof "P2P, launches and host table (OMP_NUM_THREADS $OMP_NUM_THREADS)" 60 configs/olmoe_bench.yaml $P --host-table 40
    for round in 1 2; do
        for threads in "$OMP_NUM_THREADS" 4 1; do
            OMP_NUM_THREADS=$threads prof "P2P, OMP_NUM_THREADS $threads (round $round)" 55 configs/olmoe_bench.yaml $P
        done
    done
elif [ "$PART" = 18 ] || [ "$PART" = 19 ]; then
    if [ "$PART" = 19 ]; then
        MOE_AUTOTUNE=0 timeout 120 python3 -m pytest -q -x tests/test_router_topk.py tests/test_router_loss.py \
            tests/test_expert_sort.py tests/test_moe_layer.py 2>&1 | tail -4 | tee "$OUT/gpu_tests_1.log"
        MOE_AUTOTUNE=0 timeout 240 python3 -m pytest -q -m multigpu tests/test_parallel.py tests/test_train.py 2>&1 \
            | tail -6 | tee "$OUT/gpu_tests.log"
    else
        MOE_AUTOTUNE=0 timeout 200 python3 -m pytest -q -m multigpu tests/test_parallel.py 2>&1 | tail -6 | tee "$OUT/gpu_tests.log"
    fi
    [ -d .base ] && cp bench/step_profile.py .base/bench/
    P="--warm 3 --steps 1 --timed 3 $BAR"
    base() { [ -d .base ] && (cd .base && prof "P2P (.base: $(cat REV), round $1)" 55 configs/olmoe_bench.yaml $P); }
    here() { prof "P2P, router tail and plan fused (this tree, round $1)" 55 configs/olmoe_bench.yaml $P; }
    for round in $([ "$PART" = 18 ] && echo 1 2 3 || echo 1 2); do
        if [ $((round % 2)) = 1 ]; then base "$round"; here "$round"; else here "$round"; base "$round"; fi
    done
elif [ "$PART" = 20 ]; then
    # a96c81e's review fixes (int64 table offsets, the K and bias guards) on a GPU first
    MOE_AUTOTUNE=0 timeout 120 python3 -m pytest -q -x tests/test_router_topk.py tests/test_router_loss.py \
        tests/test_expert_sort.py tests/test_moe_layer.py 2>&1 | tail -4 | tee "$OUT/gpu_tests_1.log"
    [ -d .base ] && cp bench/step_profile.py .base/bench/
    P="--warm 3 --steps 1 --timed 6 $BAR"
    here() { prof "P2P (this tree, round $1)" 60 configs/olmoe_bench.yaml $P; }
    base() { [ -d .base ] && (cd .base && prof "P2P (.base: $(cat REV), round $1)" 60 configs/olmoe_bench.yaml $P); }
    for round in 1 2 3; do
        if [ $((round % 2)) = 1 ]; then here "$round"; base "$round"; else base "$round"; here "$round"; fi
    done
elif [ "$PART" = 21 ]; then
    MOE_AUTOTUNE=0 timeout 200 python3 -m pytest -q -x tests/test_launch.py tests/test_router_topk.py \
        tests/test_router_loss.py tests/test_expert_sort.py tests/test_moe_layer.py tests/test_gather_sum.py \
        tests/test_p2p_rows.py tests/test_rope.py tests/test_lm_loss.py 2>&1 | tail -4 | tee "$OUT/gpu_tests_1.log"
    timeout 60 python3 bench/launch.py --out "$OUT/launch.md" 2>&1 | tail -8
    H="$BAR"
    host() {  # host LABEL DIR [args]
        local label=$1 dir=$2 name
        shift 2
        name=$(slug "$label")
        [ "$(left)" -lt 70 ] && { echo "[skipped: $label]"; return; }
        (cd "$dir" && timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node=2 bench/host_step.py \
            --config configs/olmoe_bench.yaml --label "$label" --out-dir "$OUT/$name" "$@" -- $H) > "$OUT/host_$name.log" 2>&1
        grep -h "^SUMMARY" "$OUT/host_$name.log" | tee -a "$OUT/host_summary.txt"
    }
    host "this tree, round 1" . --profile 45
    [ -d .base ] && host ".base $(cat .base/REV), round 1" .base --profile 45
    [ -d .base ] && host ".base $(cat .base/REV), round 2" .base
    host "this tree, round 2" .
    MOE_AUTOTUNE=0 timeout "$(left)" python3 -m pytest -q -m multigpu tests/test_parallel.py 2>&1 | tail -4 \
        | tee "$OUT/gpu_tests.log"
    echo "| run | dims | step ms | own wall ms | process CPU ms |"; echo "|---|---|---|---|---|"
    sed 's/^SUMMARY //' "$OUT/host_summary.txt"
    echo "[part $PART done after $SECONDS s]"
    exit 0
elif [ "$PART" = 22 ]; then
    MOE_AUTOTUNE=0 timeout 200 python3 -m pytest -q tests/test_p2p_rows.py tests/test_gather_sum.py \
        tests/test_step_graph.py "tests/test_parallel.py::test_two_ranks_sharing_one_gpu_equal_one_process" 2>&1 \
        | grep -v "^SKIPPED" | tail -6 | tee "$OUT/gpu_tests_1.log"
    MOE_AUTOTUNE=0 timeout 150 python3 -m pytest -q -m multigpu -k "p2p or P2P" tests/test_parallel.py 2>&1 \
        | grep -v "^SKIPPED" | tail -4 | tee "$OUT/gpu_tests_2.log"
    P="--warm 3 --steps 1 --timed 6 $BAR"
    for round in ${ROUNDS:-1 2}; do
        prof "P2P eager, round $round" 60 configs/olmoe_bench.yaml $P
        prof "P2P cuda_graph, round $round" 60 configs/olmoe_bench.yaml $P --train.cuda_graph=true
    done
elif [ "$PART" = 23 ]; then
    [ "${TESTS:-1}" != 0 ] && p2p_gpu_tests 150 240
    if [ "${TESTS:-1}" = all ]; then
        MOE_AUTOTUNE=0 timeout "$(( $(left) - 30 ))" python3 -m pytest -v --durations=15 -m "not multigpu" \
            tests/test_p2p_rows.py tests/test_gather_sum.py tests/test_step_graph.py \
            "tests/test_parallel.py::test_two_ranks_sharing_one_gpu_equal_one_process" > "$OUT/gpu_tests_3.log" 2>&1
        echo "[one-GPU tests: exit $?]"; grep -E "FAIL|ERROR|passed|failed" "$OUT/gpu_tests_3.log" | tail -6
        tail -20 "$OUT/gpu_tests_3.log"
    fi
    P="--warm 3 --steps 1 --timed 6 $BAR"
    for round in ${ROUNDS:-1 2}; do
        prof "P2P cuda_graph, 1 chunk, round $round" 60 configs/olmoe_bench.yaml $P --train.cuda_graph=true
        prof "P2P cuda_graph, 2 chunks, round $round" 60 configs/olmoe_bench.yaml $P --train.cuda_graph=true \
            --parallel.overlap_chunks=2
    done
    prof "P2P eager, 2 chunks" 60 configs/olmoe_bench.yaml $P --parallel.overlap_chunks=2
elif [ "$PART" = 24 ]; then
    if [ -f probe/ce_overlap.py ] && [ "${PROBE:-1}" != 0 ]; then  # a GEMM beside copy-engine and SM copies
        timeout 90 python3 -m torch.distributed.run --standalone --nproc_per_node=2 probe/ce_overlap.py 2>&1 \
            | grep -v Warning | tail -12 | tee "$OUT/ce_overlap.txt"
    fi
    [ "${TESTS:-1}" != 0 ] && p2p_gpu_tests 240 300
    P="--warm 3 --steps 1 --timed 6 $BAR --train.cuda_graph=true"
    for round in ${ROUNDS-1 2}; do
        prof "P2P graphed, kernels, 1 chunk, round $round" 60 configs/olmoe_bench.yaml $P
        prof "P2P graphed, copy_engine, 1 chunk, round $round" 60 configs/olmoe_bench.yaml $P --parallel.p2p_copy=copy_engine
        prof "P2P graphed, copy_engine, 2 chunks, round $round" 60 configs/olmoe_bench.yaml $P \
            --parallel.p2p_copy=copy_engine --parallel.overlap_chunks=2
    done
elif [ "$PART" = 25 ]; then
    if [ "${TESTS:-1}" != 0 ]; then
        p2p_gpu_tests 240 300
        MOE_AUTOTUNE=0 timeout "$(( $(left) - 20 ))" python3 -m pytest -v -m "not multigpu" \
            "tests/test_parallel.py::test_two_ranks_sharing_one_gpu_equal_one_process" 2>&1 \
            | grep -E "PASS|FAIL|ERROR|passed|failed|Error" | tail -6 | tee "$OUT/gpu_tests_3.log"
    fi
    P="--warm 3 --steps 1 --timed 6 $BAR --train.cuda_graph=true"
    for round in ${ROUNDS-1}; do
        prof "P2P graphed, kernels, 1 chunk, round $round" 60 configs/olmoe_bench.yaml $P
        prof "P2P graphed, copy_engine, 1 chunk, round $round" 60 configs/olmoe_bench.yaml $P --parallel.p2p_copy=copy_engine
        prof "P2P graphed, copy_engine, 2 chunks, round $round" 60 configs/olmoe_bench.yaml $P \
            --parallel.p2p_copy=copy_engine --parallel.overlap_chunks=2
        # the same 131,072 tokens a step in 4 micro-batches of twice the tokens: half the wgrad's
        # read-modify-writes of the fp32 .grad (~51 ms a step at 8) and of the per-micro-batch costs
        prof "P2P graphed, copy_engine, 4 micro-batches of 8 x 2048, round $round" 60 configs/olmoe_bench.yaml $P \
            --parallel.p2p_copy=copy_engine --train.grad_accum=4 --data.batch_size=8
    done
    if [ -f probe/tbo.py ] && [ "${PROBE:-1}" != 0 ]; then
        for mode in threads threads_ce; do
            if [ "$(left)" -lt 100 ]; then echo "[skipped: tbo $mode, $(left) s left]"; continue; fi
            MODE=$mode T=$(( $(left) < 200 ? $(left) - 10 : 190 )) ROUNDS=2 bash probe/run24c.sh | tee -a "$OUT/tbo.txt"
        done
    fi
elif [ "$PART" = 26 ]; then
    P="--warm 3 --steps 1 --timed 6 $BAR --train.cuda_graph=true"
    for round in ${ROUNDS-1 2}; do
        prof "P2P graphed, copy_engine, round $round" 60 configs/olmoe_bench.yaml $P --parallel.p2p_copy=copy_engine
        prof "P2P graphed, copy_engine, 4 micro-batches of 8 x 2048, round $round" 60 configs/olmoe_bench.yaml $P \
            --parallel.p2p_copy=copy_engine --train.grad_accum=4 --data.batch_size=8
        prof "P2P graphed, kernels, round $round" 60 configs/olmoe_bench.yaml $P
    done
elif [ "$PART" = 27 ]; then
    routing fastest_100 300 --train.steps=100 --parallel.dispatcher=p2p --parallel.data_parallel=replicate \
        --parallel.p2p_copy=copy_engine --train.cuda_graph=true --train.grad_accum=4 --data.batch_size=8
else
    timeout "$(left)" python3 bench/memory_check.py --gpus 2 --steps 8 --timeout 200 --out "$OUT/memory_ep2.md" \
        --only olmoe_bench_fsdp olmoe_bench_fsdp_selective olmoe_bench_fsdp_full olmoe_ep1_fsdp olmoe_ep1_fsdp_selective \
        > "$OUT/memory_check.log" 2>&1
    echo "[memory_check: exit $?]"; tail -12 "$OUT/memory_check.log"
    if [ "$(left)" -gt 60 ]; then
        MOE_AUTOTUNE=0 timeout "$(left)" python3 -m pytest -q -m multigpu tests/test_fsdp.py tests/test_train.py \
            tests/test_faults.py tests/test_scaling.py 2>&1 | tail -8 | tee "$OUT/gpu_tests_3.log"
    fi
fi
echo "| run | step ms (no profiler) | tokens/s | MFU | peak GB | exposed all-to-all % (rank 0) | exposed exchange % (busiest rank) | same, GPU-only profile | that less its wait for a later rank | worst load max/mean |"
echo "|---|---|---|---|---|---|---|---|---|---|"
sed 's/^SUMMARY //' "$OUT/summary.txt" 2>/dev/null
echo "[part $PART done after $SECONDS s]"
