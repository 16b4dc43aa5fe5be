"""The wire format of :class:`rallypoint.ft.RallyTransport`: requests, frames,
the header, and the flat byte space that makes chunks fetchable by range.

The flat byte space
-------------------
A staged state dict is flattened with ``torch.utils._pytree``. Its tensor
leaves, in leaf order, are laid end to end in one *flat byte space*: tensor
``i`` occupies ``[offsets[i], offsets[i] + nbytes[i])``, its bytes being the
tensor's contiguous memory (native byte order; both ends are the same
machine type). A receiver fetches any range of that space from any source
serving the same step, which is what lets :func:`recv_striped` split one
state dict across several sources, and what lets several small tensors travel
in one request.

Requests (receiver -> source)
-----------------------------
Fixed 40 bytes, network byte order (``REQUEST``)::

    magic  4s  b"RPT1"
    kind   B   ord("M"): the header of a step; ord("R"): a range of bytes
    pad    3x
    step   q   the step the receiver wants
    token  Q   (R only) the staging token the header named
    offset Q   (R only) start in the flat byte space
    length Q   (R only) number of bytes, > 0

A connection carries any number of requests, one after another. The source
never unpickles anything a receiver sends: a request is these 40 bytes.

Frames (source -> receiver)
---------------------------
``kind: 1 byte, length: u32`` then ``length`` bytes of payload:

- ``H`` the header: UTF-8 JSON (below); answers ``M``, followed by
- ``S`` the pytree spec and the non-tensor leaves, pickled;
- ``D`` raw tensor bytes, at most :data:`CHUNK`, never spanning two tensors;
  a range is answered by exactly ``length`` bytes of ``D`` frames;
- ``E`` a refusal or an abort, UTF-8 text; the source closes the connection
  after it.

The header names the step, the staging ``token`` (a random 64-bit number
drawn each time a step is staged, so ranges of two stagings are never
mixed), the number of pytree leaves, and one entry per tensor leaf:
``{"leaf", "path", "dtype", "shape", "nbytes"}`` (integers, never JSON
booleans; ``nbytes`` must equal the shape's size). Tensor data is never
pickled. The ``S`` frame is: a receiver trusts its sources' pickled spec
and non-tensor leaves as torchft's own transports do (sources are the
job's own replicas); only the header is checked field by field.
"""

import json
import math
import struct
from typing import Iterator, List, Sequence, Tuple

import torch

MAGIC = b"RPT1"
REQUEST = struct.Struct("!4sB3xqQQQ")
FRAME = struct.Struct("!cI")
KIND_META = ord("M")
KIND_RANGE = ord("R")
FORMAT = 1

#: Largest ``D`` frame: a large tensor is sent and received in syscalls of
#: this size, not one.
CHUNK = 4 << 20
#: Largest ``H``/``S``/``E`` frame a receiver accepts.
MAX_META = 256 << 20

_UNSUPPORTED = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}


class WireError(ValueError):
    """A malformed request, frame or header."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: object) -> torch.dtype:
    """The torch dtype spelled ``name`` in a header, or :class:`WireError`."""
    d = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(d, torch.dtype) or name in _UNSUPPORTED:
        raise WireError(f"unknown dtype {name!r}")
    return d


def encode_request(kind: int, step: int, token: int = 0, offset: int = 0, length: int = 0) -> bytes:
    return REQUEST.pack(MAGIC, kind, step, token, offset, length)


def decode_request(buf: bytes) -> Tuple[int, int, int, int, int]:
    """``(kind, step, token, offset, length)`` or :class:`WireError`."""
    magic, kind, step, token, offset, length = REQUEST.unpack(buf)
    if magic != MAGIC:
        raise WireError(f"not a rallypoint checkpoint request (magic {magic!r})")
    if kind not in (KIND_META, KIND_RANGE):
        raise WireError(f"unknown request kind {kind}")
    return kind, step, token, offset, length


def offsets(nbytes: Sequence[int]) -> List[int]:
    """Start of each tensor in the flat byte space."""
    out, at = [], 0
    for n in nbytes:
        out.append(at)
        at += n
    return out


def segments(starts: Sequence[int], nbytes: Sequence[int], offset: int, length: int) -> Iterator[Tuple[int, int, int]]:
    """``(tensor, start within it, count)`` covering ``[offset, offset+length)``
    of the flat byte space, in order; empty tensors are skipped."""
    end = offset + length
    lo, hi = 0, len(starts)
    while lo < hi:  # the last tensor starting at or before `offset`
        mid = (lo + hi) // 2
        if starts[mid] <= offset:
            lo = mid + 1
        else:
            hi = mid
    i = max(lo - 1, 0)
    while offset < end and i < len(starts):
        stop = starts[i] + nbytes[i]
        if stop > offset:
            n = min(stop, end) - offset
            yield i, offset - starts[i], n
            offset += n
        i += 1


def encode_header(step: int, token: int, leaves: int, tensors: List[dict]) -> bytes:
    return json.dumps(
        {"format": FORMAT, "step": step, "token": token, "leaves": leaves, "tensors": tensors},
        separators=(",", ":"),
    ).encode()


def _is_int(v: object) -> bool:
    """An integer of JSON, not a boolean (``True`` is an ``int`` in Python)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _check_tensor(e: object, leaves: int, seen: set) -> dict:
    if not isinstance(e, dict):
        raise WireError(f"tensor entry is not an object: {e!r:.80}")
    path = e.get("path")
    if not isinstance(path, str):
        raise WireError(f"tensor entry without a path: {e!r:.80}")
    leaf, shape, nbytes = e.get("leaf"), e.get("shape"), e.get("nbytes")
    if not _is_int(leaf) or not 0 <= leaf < leaves or leaf in seen:
        raise WireError(f"tensor {path}: leaf index {leaf!r} out of range or repeated")
    seen.add(leaf)
    dtype = dtype_from_name(e.get("dtype"))
    if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
        raise WireError(f"tensor {path}: bad shape {shape!r:.80}")
    want = math.prod(shape) * dtype.itemsize
    if not _is_int(nbytes) or nbytes != want:
        raise WireError(f"tensor {path}: {nbytes!r} bytes for {dtype_name(dtype)}{shape} (expected {want})")
    return {"leaf": leaf, "path": path, "dtype": dtype, "shape": tuple(shape), "nbytes": nbytes}


def decode_header(payload: bytes, step: int) -> dict:
    """The header of ``step``, checked entry by entry (dtypes parsed), or
    :class:`WireError` saying what is wrong."""
    try:
        h = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"header is not JSON: {e}") from None
    if not isinstance(h, dict) or h.get("format") != FORMAT:
        raise WireError(f"header of an unknown format: {payload[:80]!r}")
    if h.get("step") != step:
        raise WireError(f"header is for step {h.get('step')!r}, not step {step}")
    leaves, token, entries = h.get("leaves"), h.get("token"), h.get("tensors")
    if not _is_int(leaves) or leaves < 0 or not _is_int(token) or not isinstance(entries, list):
        raise WireError("header lacks leaves, token or tensors")
    seen: set = set()
    tensors = [_check_tensor(e, leaves, seen) for e in entries]
    return {"step": step, "token": token, "leaves": leaves, "tensors": tensors}


def same_layout(a: dict, b: dict) -> bool:
    """Whether two headers describe the same tensors (two sources serving the
    same step must, for their ranges to be mixed)."""
    return a["leaves"] == b["leaves"] and a["tensors"] == b["tensors"]
