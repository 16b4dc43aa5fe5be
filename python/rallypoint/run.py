"""``python -m rallypoint.run [torchrun flags] script.py [args]``: ``rally run``
under this Python, the way ``python -m torch.distributed.run`` is torchrun.

The process becomes ``rally`` (``exec``), so signals from a terminal or a
scheduler go straight to the launcher, and its exit code is the process's.
``PYTHON_EXEC`` is set to this interpreter unless already set, so workers run
under the same Python (a venv's, without activating it).
"""

import os
import sys

from rallypoint import find_rally_bin


def main() -> None:
    rally = find_rally_bin()
    os.environ.setdefault("PYTHON_EXEC", sys.executable)
    os.execv(rally, [rally, "run", *sys.argv[1:]])


if __name__ == "__main__":
    main()
