#!/usr/bin/env bash
# Launch-to-exit of two `rally` binaries, interleaved run by run so both see the
# same machine: `--standalone --nproc-per-node N --no-python true`, R rounds,
# medians and quartiles in ms.
# EXTRA flags (e.g. "-t 3") go to both.
#   crates/bench/sh/compare_launch.sh OLD_RALLY NEW_RALLY [N=8] [R=30] [EXTRA]
set -euo pipefail
old=$1; new=$2; n=${3:-8}; rounds=${4:-30}; extra=${5:-}
for _ in $(seq "$rounds"); do
  for which in old new; do
    exe=${!which}
    t0=$(date +%s%N)
    RALLY_LOG=error "$exe" run --standalone --nproc-per-node "$n" $extra --no-python true >/dev/null 2>&1
    echo "$which $(( ($(date +%s%N) - t0) / 1000 ))"
  done
done | python3 -c '
import statistics, sys
runs = {}
for line in sys.stdin:
    which, us = line.split()
    runs.setdefault(which, []).append(int(us) / 1000)
for which, v in sorted(runs.items()):
    v.sort()
    print(f"{which}: median {statistics.median(v):.1f} ms (p25 {v[len(v)//4]:.1f}, p75 {v[3*len(v)//4]:.1f}) of {len(v)}")
'
