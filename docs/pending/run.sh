#!/usr/bin/env bash
# The pending GPU work of docs/pending/README.md in two device calls of under 10 minutes each:
#   bash docs/pending/run.sh 1   # the GPU tests of what shipped untested in its final form; Hd 256 fwd+bwd
#   bash docs/pending/run.sh 2   # window-fwd.patch: its GPU tests, then the probe
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
    step shipped_tests '' timeout 300 python -m pytest -q -p no:cacheprovider tests/test_attention.py \
        -k "(hopper_forward_matches and 256) or head_dims_bf16 or head_dim_96_takes"
    step hd256_fwd_bwd '' timeout 250 python bench/attention.py --head-dims 256 --quick --rounds 5 \
        --out "$out/attention_hd256.md"
    ;;
2)
    step window_test window-fwd.patch timeout 240 python -m pytest -q -p no:cacheprovider \
        tests/test_attention.py -k "hopper_forward_window or causal_window"
    step window_fwd window-fwd.patch timeout 330 python docs/pending/window_fwd.py
    ;;
*)
    echo "usage: bash docs/pending/run.sh 1|2" >&2
    exit 2
    ;;
esac
