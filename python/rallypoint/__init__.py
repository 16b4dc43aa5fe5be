"""rallypoint: a control plane for distributed jobs.

This package ships the ``rally`` launcher (a static binary, installed on PATH)
and ``python -m rallypoint.run``, which runs ``rally run`` under the calling
Python: workers use the same interpreter, as under ``torchrun``.
"""

import os
import sys
import sysconfig


def find_rally_bin() -> str:
    """The ``rally`` executable installed with this package."""
    name = "rally"
    candidates = [
        os.path.join(sysconfig.get_path("scripts"), name),
        # `pip install --user`
        os.path.join(sysconfig.get_path("scripts", scheme=_user_scheme()), name),
        # `pip install --target`: bin/ beside the package directory
        os.path.join(os.path.dirname(os.path.dirname(__file__)), "bin", name),
        os.path.join(os.path.dirname(sys.executable), name),
    ]
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError(
        "the rally executable was not found beside this Python package; looked in: "
        + ", ".join(candidates)
    )


def _user_scheme() -> str:
    if sys.version_info >= (3, 10):
        return sysconfig.get_preferred_scheme("user")
    return "posix_user" if os.name == "posix" else "nt_user"
