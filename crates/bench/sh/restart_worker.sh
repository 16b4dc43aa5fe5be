#!/bin/sh
# The restart benchmark's worker, the same under both launchers. In attempt 0,
# local rank 0 fails after a moment and records when; the others wait to be
# stopped. In later attempts every worker records when it started, and exits.
d=$BENCH_DIR
if [ "$TORCHELASTIC_RESTART_COUNT" = "0" ]; then
  if [ "$LOCAL_RANK" = "0" ]; then
    sleep 0.5
    date +%s.%N > "$d/fail"
    exit 1
  fi
  exec sleep 60
fi
date +%s.%N > "$d/start.$LOCAL_RANK"
