"""Wire formats: globals, deltas, master state and the pointer; checksums; delta compression.

Objects are safetensors files (no pickle: a store is shared with other machines) whose string
metadata carries a JSON header. Integrity is end to end, never trusted to the store:

* a **global** is named by the pointer together with the sha256 of its bytes and the digest of its
  tensors (:func:`tensor_digest`), so a node can prove which weights it holds;
* a **delta** carries ``content_sha256`` = sha256(header JSON without that field + tensor
  digest): a flipped payload byte that safetensors would load silently is caught, and so is an
  edited header field (base version, seq, ...).

Compression of deltas (pseudo-gradients): ``none`` (fp32), ``bf16`` (2x smaller) or ``int8``
(4x smaller: symmetric per-chunk absmax scales over ``INT8_CHUNK`` consecutive values). The
worker keeps the quantization error in its reference weights, so it is sent next round (error
feedback), and reports the relative L2 error as a metric.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..errors import SpeedtronicError

DELTA_FORMAT = "speedtronic-diloco-delta/1"
GLOBAL_FORMAT = "speedtronic-diloco-global/1"
STATE_FORMAT = "speedtronic-diloco-master-state/1"
POINTER_KEY = "global/latest.json"
LEASE_KEY = "master/lease.json"
CODECS = ("none", "bf16", "int8")
INT8_CHUNK = 1024  # values per scale; 0.4% overhead in fp32 scales
_SCALE_SUFFIX = ":scale"
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}")
_DELTA_NAME = re.compile(r"nodes/([^/]+)/([^/]+)/d(\d{8})-b(\d{8})\.safetensors")


class FormatError(SpeedtronicError, ValueError):
    """An object is not a valid DiLoCo object (unreadable, wrong header, failed checksum).

    A :class:`SpeedtronicError`: a damaged store object is reported as one line (exit 2), not
    as a traceback from the master thread."""


def check_id(value: str, what: str = "node id") -> str:
    """Ids become path segments in the store: letters, digits and ``_.-`` only."""
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise ValueError(f"invalid {what} {value!r}: use 1-64 of [A-Za-z0-9_.-], "
                         "starting with a letter or digit")
    return value


def sha256(data: bytes) -> str:
    """Hex sha256 of ``data``: the checksum pointers (and delta headers) record."""
    return hashlib.sha256(data).hexdigest()


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over (key, dtype, shape, raw bytes) in sorted key order; device independent."""
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].detach().to("cpu").contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():  # hashed in place: tobytes() copied every delta whole (256 MiB: +256 MiB)
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def encode(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> bytes:
    """Serialize CPU-contiguous tensors with a JSON header under metadata key ``header``."""
    flat = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    return st_save(flat, metadata={"header": json.dumps(meta, sort_keys=True)})


def decode(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Parse bytes from :func:`encode`; any damage becomes a :class:`FormatError`."""
    if len(data) < 8:
        raise FormatError(f"truncated object ({len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8 or n > 100_000_000:
        raise FormatError(f"truncated object: header claims {n} bytes, {len(data) - 8} present")
    try:
        raw = json.loads(data[8:8 + n])
        header = json.loads(raw.get("__metadata__", {}).get("header", "null"))
        end = max((v["data_offsets"][1] for k, v in raw.items() if k != "__metadata__"),
                  default=0)
    except Exception as exc:
        raise FormatError(f"unreadable object header: {exc}") from exc
    if 8 + n + end != len(data):
        raise FormatError(f"truncated object: {len(data)} bytes, header needs {8 + n + end}")
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own error types for every kind of damage
        raise FormatError(f"unreadable object: {exc}") from exc
    if not isinstance(header, dict):
        raise FormatError("object has no speedtronic header")
    return tensors, header


# ----------------------------------------------------------------------------------- deltas
@dataclass
class DeltaHeader:
    """Metadata of one pseudo-gradient upload; (node, session, seq) is its idempotency key."""

    node: str
    session: str
    seq: int
    base_version: int
    inner_steps: int
    tokens: int
    codec: str = "none"
    created_at: float = field(default_factory=time.time)
    format: str = DELTA_FORMAT
    content_sha256: str = ""

    @property
    def key(self) -> str:
        return delta_key(self.node, self.session, self.seq, self.base_version)


def delta_key(node: str, session: str, seq: int, base_version: int) -> str:
    """Store key of a worker's delta: ``nodes/<node>/<session>/d<seq>-b<base version>``; the
    master reads node, session, seq and base version back with :func:`parse_delta_key`."""
    return f"nodes/{node}/{session}/d{seq:08d}-b{base_version:08d}.safetensors"


def rejection_key(node: str, session: str, seq: int) -> str:
    """Where the master records that delta ``seq`` of ``node/session`` was rejected (a small JSON
    with the reason): a worker whose last deltas were all rejected publishes no new version, so
    without this receipt its final sync could only wait for a global that never comes."""
    return f"rejected/{node}/{session}/d{seq:08d}.json"


def parse_delta_key(key: str) -> tuple[str, str, int, int] | None:
    """``(node, session, seq, base_version)`` for a delta key, else None (done markers etc.)."""
    m = _DELTA_NAME.fullmatch(key)
    if not m:
        return None
    return m.group(1), m.group(2), int(m.group(3)), int(m.group(4))


def _content_sha(header: dict[str, Any], digest: str) -> str:
    body = {k: v for k, v in header.items() if k != "content_sha256"}
    return sha256((json.dumps(body, sort_keys=True) + digest).encode())


def compress(delta: dict[str, torch.Tensor], codec: str) -> dict[str, torch.Tensor]:
    """fp32 delta -> wire tensors. int8: per-chunk absmax scales, codes in [-127, 127]."""
    if codec == "none":
        return {k: v.float() for k, v in delta.items()}
    if codec == "bf16":
        return {k: v.to(torch.bfloat16) for k, v in delta.items()}
    if codec != "int8":
        raise ValueError(f"unknown delta codec {codec!r}; valid: {', '.join(CODECS)}")
    out: dict[str, torch.Tensor] = {}
    for k, v in delta.items():
        flat = v.float().reshape(-1)
        pad = (-flat.numel()) % INT8_CHUNK
        chunks = torch.nn.functional.pad(flat, (0, pad)).view(-1, INT8_CHUNK)  # (C, CHUNK)
        scale = chunks.abs().amax(dim=1).clamp_min(1e-30) / 127.0  # (C,) fp32
        codes = torch.round(chunks / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        out[k] = codes.reshape(-1)[: flat.numel()].reshape(v.shape)
        out[k + _SCALE_SUFFIX] = scale
    return out


def decompress(wire: dict[str, torch.Tensor], codec: str) -> dict[str, torch.Tensor]:
    """Wire tensors -> fp32 delta (shapes as sent)."""
    if codec in ("none", "bf16"):
        return {k: v.float() for k, v in wire.items()}
    if codec != "int8":
        raise FormatError(f"unknown delta codec {codec!r}")
    out: dict[str, torch.Tensor] = {}
    for k, codes in wire.items():
        if k.endswith(_SCALE_SUFFIX):
            continue
        scale = wire.get(k + _SCALE_SUFFIX)
        if scale is None or codes.dtype != torch.int8:
            raise FormatError(f"int8 delta: {k!r} lacks its scales or is not int8")
        flat = codes.reshape(-1).float()
        pad = (-flat.numel()) % INT8_CHUNK
        if scale.numel() != (flat.numel() + pad) // INT8_CHUNK:
            raise FormatError(f"int8 delta: {k!r} has {scale.numel()} scales for "
                              f"{flat.numel()} values")
        chunks = torch.nn.functional.pad(flat, (0, pad)).view(-1, INT8_CHUNK)
        out[k] = (chunks * scale.float()[:, None]).reshape(-1)[: flat.numel()].reshape(codes.shape)
    return out


def relative_error(exact: dict[str, torch.Tensor], approx: dict[str, torch.Tensor]) -> float:
    """||approx - exact|| / ||exact|| over all tensors (0.0 for an all-zero delta)."""
    num = sum(float((approx[k] - v).double().pow(2).sum()) for k, v in exact.items())
    den = sum(float(v.double().pow(2).sum()) for v in exact.values())
    return (num / den) ** 0.5 if den > 0 else 0.0


_WIRE_DTYPES = {"none": {torch.float32}, "bf16": {torch.bfloat16},
                "int8": {torch.int8, torch.float32}}


def encode_delta(delta: dict[str, torch.Tensor], header: DeltaHeader
                 ) -> tuple[bytes, dict[str, torch.Tensor]]:
    """Compress, stamp the content checksum, serialize. Returns (bytes, decoded fp32 delta as
    the master will see it) so the sender can keep the compression error for the next round."""
    wire = compress(delta, header.codec)
    meta = asdict(header)
    meta["content_sha256"] = _content_sha(meta, tensor_digest(wire))
    header.content_sha256 = meta["content_sha256"]
    return encode(wire, meta), decompress(wire, header.codec)


_HEADER_TYPES = {"node": str, "session": str, "seq": int, "base_version": int,
                 "inner_steps": int, "tokens": int, "codec": str, "created_at": (int, float),
                 "format": str, "content_sha256": str}


def _check_header_types(header: DeltaHeader) -> None:
    """A checksum proves the bytes are what the sender wrote, not that the sender is sane:
    every field must have its type (bools are not ints) and counters must be >= 0."""
    for name, kind in _HEADER_TYPES.items():
        value = getattr(header, name)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise FormatError(f"delta header field {name!r} is {type(value).__name__} "
                              f"{str(value)[:40]!r}")
    for name in ("seq", "base_version", "inner_steps", "tokens"):
        if getattr(header, name) < 0:
            raise FormatError(f"delta header field {name!r} is negative")


def decode_delta(data: bytes) -> tuple[dict[str, torch.Tensor], DeltaHeader]:
    """Parse and verify a delta object; raises FormatError naming what is wrong."""
    wire, meta = decode(data)
    if meta.get("format") != DELTA_FORMAT:
        raise FormatError(f"not a delta (format {meta.get('format')!r})")
    try:
        header = DeltaHeader(**meta)
    except TypeError as exc:
        raise FormatError(f"bad delta header: {exc}") from exc
    _check_header_types(header)
    if _content_sha(meta, tensor_digest(wire)) != header.content_sha256:
        raise FormatError("sha256 mismatch: payload or header was modified")
    allowed = _WIRE_DTYPES.get(header.codec)
    if allowed is None:
        raise FormatError(f"unknown delta codec {header.codec!r}")
    bad = sorted(k for k, v in wire.items() if v.dtype not in allowed)
    if bad:
        raise FormatError(f"dtype not allowed for codec {header.codec}: {bad[:5]}")
    return decompress(wire, header.codec), header


# ---------------------------------------------------------------------- globals and pointer
@dataclass
class Pointer:
    """``global/latest.json``, written last: names the current global and the master state."""

    version: int
    path: str
    sha256: str
    weights_digest: str
    outer_step: int
    master_epoch: int
    state_path: str
    state_sha256: str
    master: str = ""
    created_at: float = field(default_factory=time.time)
    hwm: dict = field(default_factory=dict)
    """Per ``node/session``: the highest delta seq this global holds (applied or rejected), so a
    worker knows which of its own deltas the global still lacks (its consistent-base carry)."""
    carry: float = 0.0
    """The weight the master's outer optimizer gives one delta in total (immediate step plus
    momentum), ``outer.carry_weight``: a worker installs ``G - carry * (its deltas G lacks)``."""
    workers: float = 0.0
    """The M the master divides each delta by (0 = not published)."""
    fastest_step_s: float = 0.0
    """Seconds per inner step of the fastest recent worker, as the master measures it (0 =
    unknown); ``adaptive_inner_steps`` workers scale their H by it."""

    def to_bytes(self) -> bytes:
        """The pointer as indented JSON with sorted keys (what ``global/latest.json`` holds);
        read back by :meth:`from_bytes`."""
        return (json.dumps(asdict(self), sort_keys=True, indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Pointer:
        """Parse and type-check a pointer; anything else is a :class:`FormatError` (a version
        written as ``"7"`` once raised a TypeError that ended a worker's poll thread)."""
        try:
            pointer = cls(**json.loads(data))
        except (ValueError, TypeError) as exc:
            raise FormatError(f"unreadable pointer {POINTER_KEY}: {exc}") from exc
        for f in fields(cls):
            value = getattr(pointer, f.name)
            kind = {"int": int, "str": str, "float": (int, float), "dict": dict}[f.type]
            if not isinstance(value, kind) or isinstance(value, bool):
                raise FormatError(f"unreadable pointer {POINTER_KEY}: {f.name} is "
                                  f"{value!r}, not {f.type}")
        if not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                   for k, v in pointer.hwm.items()):
            raise FormatError(f"unreadable pointer {POINTER_KEY}: hwm must map "
                              "'node/session' to an integer seq")
        for name in ("carry", "fastest_step_s", "workers"):
            value = getattr(pointer, name)
            if not (math.isfinite(value) and 0.0 <= value <= 1e6):
                raise FormatError(f"unreadable pointer {POINTER_KEY}: {name} {value!r} is not "
                                  "a finite non-negative number")
        return pointer

    def holds(self, node: str, session: str) -> int:
        """The highest seq of ``node/session`` this global holds (-1: none)."""
        return self.hwm.get(f"{node}/{session}", -1)


def global_key(version: int, epoch: int, nonce: str) -> str:
    """Store key of the global weights of ``version``, written by the master with ``epoch`` and a
    fresh ``nonce``."""
    # The epoch + nonce make every write a new immutable name: a master that crashed after
    # writing weights but before the pointer never collides with its successor's version.
    return f"global/v{version:08d}-e{epoch:04d}-{nonce}.safetensors"


def state_key(version: int, epoch: int, nonce: str) -> str:
    """Store key of the master state (outer optimizer, applied deltas) published with the global
    of ``version``; epoch and nonce make each write a new name, as for :func:`global_key`."""
    return f"master/state-v{version:08d}-e{epoch:04d}-{nonce}.safetensors"


def encode_global(weights: dict[str, torch.Tensor], version: int,
                  model: dict[str, Any] | None = None) -> bytes:
    """A global's bytes. ``model``: the run's ``model.*`` config, in the header (not in the
    pointer, whose fields older readers check strictly: a global's extra header key they
    ignore). Same-shaped tensors do not make the same model: a worker with another ``n_head``
    or ``rope_base`` once installed the global and trained on."""
    meta: dict[str, Any] = {"format": GLOBAL_FORMAT, "version": version}
    if model:
        meta["model"] = model
    return encode(weights, meta)


def decode_global_with_model(data: bytes, pointer: Pointer
                             ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """:func:`decode_global` plus the ``model.*`` config in its header ({} when it has none:
    a global from before it was recorded)."""
    if sha256(data) != pointer.sha256:
        raise FormatError(f"global {pointer.path}: sha256 does not match the pointer")
    tensors, meta = decode(data)
    if meta.get("format") != GLOBAL_FORMAT or meta.get("version") != pointer.version:
        raise FormatError(f"global {pointer.path}: header {meta} does not match the pointer")
    if tensor_digest(tensors) != pointer.weights_digest:
        raise FormatError(f"global {pointer.path}: tensor digest does not match the pointer")
    model = meta.get("model")
    return tensors, model if isinstance(model, dict) else {}


def decode_global(data: bytes, pointer: Pointer) -> dict[str, torch.Tensor]:
    """Verify bytes against the pointer (sha256 of the file and of the tensors)."""
    return decode_global_with_model(data, pointer)[0]
