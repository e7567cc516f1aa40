#!/usr/bin/env bash
# tp-run.sh - on a machine with 2 GPUs: the C tests and the Python package's GPU tests
# (scripts/device-run.sh), then `comet bench --preset all` with EP 1 x TP 2 and with EP 2
# in the same run, their summaries last. Logs in $OUT.
set -uo pipefail
OUT=${OUT:-out}
scripts/device-run.sh ${*:-tests python} || exit 1
for layout in "tp2:--tp 2" "ep2:--ep 2"; do
    name=${layout%%:*}
    timeout 280 build/comet bench --preset all ${layout#*:} --json "$OUT/bench-$name.json" > "$OUT/bench-$name.log" 2>&1
    echo "== $name (rc $?)"
    grep -E "^[a-z0-9.-]+ +(baseline|comet) |layer1 \(|layer0 \(|whole layer in turns|rror" "$OUT/bench-$name.log" | cut -c1-200
done
