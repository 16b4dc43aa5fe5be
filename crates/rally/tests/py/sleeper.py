"""A worker that never talks to its peers: records where it ran in
$MARKER_DIR/<attempt>-<rank>.json, then sleeps FIRST_SLEEP seconds in attempt 0
(default 600: only a re-form ends it) or LATER_SLEEP seconds after (default 1)."""
import json
import os
import time

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
keys = ["RANK", "WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"]
with open(os.path.join(os.environ["MARKER_DIR"], f"{attempt}-{os.environ['RANK']}.json"), "w") as f:
    json.dump({k: os.environ[k] for k in keys}, f)
time.sleep(float(os.environ.get("FIRST_SLEEP" if attempt == 0 else "LATER_SLEEP", 600 if attempt == 0 else 1)))
