#!/usr/bin/env bash
# The pending GPU work of docs/pending/README.md in two device calls of under 10 minutes each:
#   bash docs/pending/run.sh 1   # hd256_one_q, window_fwd (its GPU test, then the probe)
#   bash docs/pending/run.sh 2   # triton_align, wide tiles below 1k keys, the shared test helper
# Each patch is applied, run and reverted (git apply works outside a repository too); the logs go
# to $OUT (or /tmp) as <step>.log, and a failing step does not stop the next.
set -u
out=${OUT:-/tmp}
cd "$(dirname "$0")/../.."
step() {  # name, patch ('' for none), command
    local name=$1 patch=$2
    shift 2
    [ -n "$patch" ] && git apply "docs/pending/$patch"
    echo "== $name" | tee "$out/$name.log"
    PYTHONPATH=. "$@" >> "$out/$name.log" 2>&1
    echo "rc=$?" >> "$out/$name.log"
    [ -n "$patch" ] && git apply -R "docs/pending/$patch"
    tail -25 "$out/$name.log"
}
case ${1:-} in
1)
    step hd256_one_q fwd-one-q-buffer.patch timeout 200 python docs/pending/hd256_one_q.py
    step window_test window-fwd.patch timeout 200 python -m pytest -q -p no:cacheprovider \
        tests/test_attention.py -k hopper_forward_window
    step window_fwd window-fwd.patch timeout 150 python docs/pending/window_fwd.py
    ;;
2)
    step triton_align triton-align.patch timeout 150 python docs/pending/triton_align.py
    step wide_below_1k '' timeout 100 python bench/attention_wide_tiles.py --head-dims 96 48 \
        --lengths 256 512 --modes fwd+bwd --out "$out/wide_below_1k.md"
    step helper_tests '' timeout 280 python -m pytest -q -p no:cacheprovider tests/test_attention.py \
        -k "head_dim_96 or (writes_every and 72)"
    ;;
*)
    echo "usage: bash docs/pending/run.sh 1|2" >&2
    exit 2
    ;;
esac
