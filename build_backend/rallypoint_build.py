"""The PEP 517 backend of ``pip install .``: maturin's, plus the extension.

maturin builds one Rust target per wheel (PyO3/maturin#368), and this wheel
carries two: the ``rally`` launcher (a binary, maturin's ``bin`` bindings, as
today) and ``rallypoint._native``, the ``rally`` backend for
torch.distributed (a PyO3 module, abi3: one build serves every CPython 3.8+,
and building it needs no torch). So ``build_wheel`` lets maturin build the
launcher's wheel, builds the extension with cargo (same release profile,
so the crates they share compile once), and adds it to the wheel as
``rallypoint/_native.abi3.so``, with its RECORD line.

The wheel keeps maturin's ``py3-none-<platform>`` tag: the launcher runs
under any Python, and only ``rallypoint.torch`` (CPython, with torch) loads
the extension. ``pip install -e .`` puts the extension in the source tree.

Everything else is maturin's.
"""

import base64
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import zipfile

import maturin
from maturin import (  # noqa: F401 - the rest of the PEP 517 interface
    build_sdist,
    get_requires_for_build_editable,
    get_requires_for_build_sdist,
    get_requires_for_build_wheel,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODULE = "rallypoint/_native.abi3.so"


def _build_extension() -> str:
    """Builds crates/torch (cargo, release) and returns the shared object."""
    cargo = os.environ.get("CARGO", "cargo")
    cmd = [cargo, "build", "--release", "--locked", "-p", "rallypoint-torch", "--message-format=json-render-diagnostics"]
    out = subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.PIPE, text=True).stdout
    for line in out.splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if msg.get("reason") == "compiler-artifact" and msg["target"]["name"] == "_native":
            return msg["filenames"][0]
    raise RuntimeError("cargo built no _native library (crates/torch)")


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def _stripped(so: str) -> bytes:
    """The module without its debug info (as maturin strips the launcher),
    when binutils' strip is here; else as built."""
    strip = shutil.which("strip")
    if strip is None:
        with open(so, "rb") as f:
            return f.read()
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "native.so")
        subprocess.run([strip, "--strip-debug", "-o", out, so], check=True)
        with open(out, "rb") as f:
            return f.read()


def _add_to_wheel(wheel: str, so: str) -> None:
    data = _stripped(so)
    fd, tmp = tempfile.mkstemp(suffix=".whl", dir=os.path.dirname(wheel))
    os.close(fd)
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            body = src.read(item.filename)
            if item.filename.endswith(".dist-info/RECORD"):
                lines = [line for line in body.decode().splitlines() if line and not line.startswith(MODULE + ",")]
                lines.insert(-1, _record_line(MODULE, data))
                body = ("\n".join(lines) + "\n").encode()
            dst.writestr(item, body)
        info = zipfile.ZipInfo(MODULE, date_time=(2020, 1, 1, 0, 0, 0))
        info.external_attr = 0o755 << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        dst.writestr(info, data)
    os.replace(tmp, wheel)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    name = maturin.build_wheel(wheel_directory, config_settings, metadata_directory)
    _add_to_wheel(os.path.join(wheel_directory, name), _build_extension())
    return name


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    name = maturin.build_editable(wheel_directory, config_settings, metadata_directory)
    shutil.copyfile(_build_extension(), os.path.join(ROOT, "python", MODULE))
    return name
