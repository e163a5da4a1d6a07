#!/usr/bin/env bash
# The pending GPU work of docs/pending/README.md in three device calls of under 10 minutes each:
#   bash docs/pending/run.sh 2   # window-fwd.patch: its GPU tests, then the probe
#   bash docs/pending/run.sh 3   # window-bwd.patch (on top of window-fwd.patch): its tests, the probe
#   bash docs/pending/run.sh 4   # bwd256-release.patch (on main alone): the probe, then its GPU tests
# Each step's patches are applied, run and reverted (git apply works outside a repository too); the
# logs go to $OUT (or /tmp) as <step>.log, and a failing step does not stop the next.
set -u
out=${OUT:-/tmp}
cd "$(dirname "$0")/../.."
step() {  # name, patches (space-separated, in order; '' for none), command
    local name=$1 patches=$2 p applied=""
    shift 2
    for p in $patches; do  # a patch that does not apply stops the step: no probe of main vs main
        if ! git apply "docs/pending/$p"; then
            echo "== $name: $p does not apply" | tee "$out/$name.log"
            for p in $applied; do git apply -R "docs/pending/$p"; done
            return 1
        fi
        applied="$p $applied"
    done
    echo "== $name" | tee "$out/$name.log"
    PYTHONPATH=. "$@" >> "$out/$name.log" 2>&1
    echo "rc=$?" >> "$out/$name.log"
    for p in $applied; do git apply -R "docs/pending/$p"; done  # (the last applied first)
    tail -25 "$out/$name.log"
}
case ${1:-} in
2)
    step window_test window-fwd.patch timeout 240 python -m pytest -q -p no:cacheprovider \
        tests/test_attention.py -k "hopper_forward_window or causal_window"
    step window_fwd window-fwd.patch timeout 330 python docs/pending/window_fwd.py
    ;;
3)
    both="window-fwd.patch window-bwd.patch"
    step window_bwd_test "$both" timeout 270 python -m pytest -q -p no:cacheprovider \
        tests/test_attention.py -k hopper_backward_window
    step window_bwd "$both" timeout 300 python docs/pending/window_bwd.py
    ;;
4)
    # main's module, the probe's baseline; the probe first, whose rows can drop the patch alone
    cp attention/flash_attn_hopper_bwd.py /tmp/bwd_main.py
    step hd256_release bwd256-release.patch timeout 300 python docs/pending/hd256_release.py \
        /tmp/bwd_main.py
    step hd256_release_test bwd256-release.patch timeout 280 python -m pytest -q \
        -p no:cacheprovider tests/test_attention.py -k "hopper_backward and 256"
    ;;
*)
    echo "usage: bash docs/pending/run.sh 2|3|4" >&2
    exit 2
    ;;
esac
