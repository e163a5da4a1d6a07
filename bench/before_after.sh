#!/usr/bin/env bash
# A refactor's before/after in one run: the same bench in a base tree and in this tree,
# alternating, so that both meet the same machine state. Each run compares itself with its own
# anchor in the same rounds (PyTorch, raw all_to_all_single); the before/after claim is the
# ratio of those anchored ratios, read against the runs' own A-vs-A rows.
#
#   BASE=.base ROUNDS=2 OUT=/tmp/ab bench/before_after.sh NAME python3 bench/combine.py
#   BASE=.base ROUNDS=2 OUT=/tmp/ab bench/before_after.sh a2a_p2p torchrun --standalone --nproc_per_node=2 \
#       bench/all_to_all.py --transport p2p
#
# BASE: the old tree (e.g. `git archive <commit> | tar -x -C .base`); each run gets `--out
# $OUT/NAME_{before,after}_<round>.md` appended; its log goes to $LOGS (default /tmp) and is
# printed when the run fails.
set -uo pipefail
name=$1; shift
here=$(cd "$(dirname "$0")/.." && pwd)
base=$(cd "${BASE:?set BASE to the old tree}" && pwd)
mkdir -p "${OUT:?set OUT}"
for round in $(seq 1 "${ROUNDS:-2}"); do
    for side in before after; do
        tree=$([ "$side" = before ] && echo "$base" || echo "$here")
        log="${LOGS:-/tmp}/${name}_${side}_${round}.log"
        (cd "$tree" && "$@" --out "$OUT/${name}_${side}_${round}.md") > "$log" 2>&1 \
            || { echo "$name $side round $round failed:"; tail -20 "$log"; }
        echo "== $name $side round $round"; grep '^|' "$OUT/${name}_${side}_${round}.md" 2>/dev/null | tail -n +3
    done
done
