"""Writes, as OUT_DIR/<local rank>.json, the CPUs this worker may run on and
the memory policies its mappings show (/proc/self/numa_maps)."""
import json
import os

policies = set()
try:
    with open("/proc/self/numa_maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) > 1:
                policies.add(fields[1])
except OSError:
    pass
out = os.path.join(os.environ["OUT_DIR"], os.environ["LOCAL_RANK"] + ".json")
with open(out, "w") as f:
    json.dump({"cpus": sorted(os.sched_getaffinity(0)), "policies": sorted(policies)}, f)
