"""The loss of a chaos run against its fault-free run at equal *samples*.

``ft_bench.py --figures chaos`` compares the two runs' losses at equal steps.
A step averages the gradients of the groups that take part in it, so a chaos
run, whose groups are out part of the time, has trained on fewer samples at
the same step. This script compares at equal samples instead: a committed
step counts its ``participants``; over the last 10% of the samples both runs
reached, each run's mean loss, and the fault-free run's spread over ten
windows of them (its noise).

    python crates/bench/py/ft_samples.py CHAOS_DIR FREE_DIR

The directories are the ones ``FT_BENCH_KEEP=1`` keeps (``replica*.jsonl``).
"""

import glob
import json
import statistics
import sys
from typing import List, Tuple


def load(d: str) -> Tuple[List[Tuple[int, float]], int]:
    """(samples so far, loss) per committed record, and the samples in all."""
    participants, losses = {}, []
    for path in glob.glob(d + "/replica*.jsonl"):
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                if r.get("committed") and "loss" in r:
                    participants[r["step"]] = r["participants"]
                    losses.append((r["step"], r["loss"]))
    so_far, total = {}, 0
    for step in sorted(participants):
        total += participants[step]
        so_far[step] = total
    return [(so_far[s], v) for s, v in losses], total


def main() -> None:
    chaos, chaos_total = load(sys.argv[1])
    free, free_total = load(sys.argv[2])
    top = min(chaos_total, free_total)
    lo = int(top * 0.9)
    c = [v for s, v in chaos if lo < s <= top]
    f = [(s, v) for s, v in free if lo < s <= top]
    width = max(1, (top - lo) // 10)
    means = [statistics.fmean(xs) for k in range(10) if (xs := [v for s, v in f if lo + k * width < s <= lo + (k + 1) * width])]
    mc, mf = statistics.fmean(c), statistics.fmean(v for _, v in f)
    print(f"samples (group-steps): chaos {chaos_total}, fault-free {free_total}; compared over {lo}-{top}")
    print(f"loss at equal samples: chaos {mc:.4f}, fault-free {mf:.4f} (its windows {min(means):.4f}-{max(means):.4f}): {'within' if min(means) <= mc <= max(means) else 'outside'}")


if __name__ == "__main__":
    main()
