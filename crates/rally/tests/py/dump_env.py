"""Writes the worker's environment (what torchrun-compatible launchers set) as JSON
to $DUMP_DIR/<RANK>.json, minus what the launcher's parent already had."""
import json
import os

skip = set(json.loads(os.environ.get("DUMP_PARENT_KEYS", "[]")))
env = {k: v for k, v in os.environ.items() if k not in skip}
with open(os.path.join(os.environ["DUMP_DIR"], os.environ["RANK"] + ".json"), "w") as f:
    json.dump(env, f, indent=1, sort_keys=True)
