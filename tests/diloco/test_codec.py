"""The DiLoCo wire format (diloco/codec.py): round trips, integrity checks, compression error and
size.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from speedtronic.diloco import codec  # noqa: E402


# ----------------------------------------------------------------------------------- codec
def _delta(seed=0, rows=33):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(rows, 70, generator=g), "b": torch.randn(5, generator=g)}


def test_delta_roundtrip_and_integrity():
    d = _delta()
    h = codec.DeltaHeader(node="n1", session="s1", seq=3, base_version=2, inner_steps=5, tokens=9)
    data, decoded = codec.encode_delta(d, h)
    out, header = codec.decode_delta(data)
    assert header.key == "nodes/n1/s1/d00000003-b00000002.safetensors"
    assert all(torch.equal(out[k], d[k]) for k in d) and all(torch.equal(decoded[k], d[k])
                                                              for k in d)
    flipped = bytearray(data)
    flipped[-7] ^= 0x10  # one payload bit: safetensors alone would load this silently
    with pytest.raises(codec.FormatError, match="sha256"):
        codec.decode_delta(bytes(flipped))
    edited = data.replace(b'\\"base_version\\": 2', b'\\"base_version\\": 9')
    assert edited != data
    with pytest.raises(codec.FormatError):
        codec.decode_delta(edited)
    for damaged in (data[: len(data) // 2], b"", data[:5]):
        with pytest.raises(codec.FormatError):
            codec.decode_delta(damaged)


@pytest.mark.parametrize("name,bound,ratio", [("bf16", 5e-3, 2), ("int8", 1.5e-2, 4)])
def test_compression_error_and_size(name, bound, ratio):
    d = _delta(1, rows=600)
    h = codec.DeltaHeader(node="n", session="s", seq=0, base_version=0, inner_steps=1,
                          tokens=0, codec=name)
    raw, _ = codec.encode_delta(d, codec.DeltaHeader(node="n", session="s", seq=0,
                                                     base_version=0, inner_steps=1, tokens=0))
    data, decoded = codec.encode_delta(d, h)
    out, _ = codec.decode_delta(data)
    err = codec.relative_error(d, out)
    assert 0 < err < bound
    assert len(data) < len(raw) / ratio * 1.1
    assert all(torch.equal(out[k], decoded[k]) for k in d)  # sender knows what master sees


@pytest.mark.parametrize("field, value", [("version", "7"), ("master_epoch", True),
                                          ("path", 3), ("created_at", "now")])
def test_a_pointer_with_a_mistyped_field_is_a_format_error(field, value):
    """The poll loop handles FormatError; a TypeError from a "7" version once ended the thread."""
    import json

    good = codec.Pointer(version=7, path="global/v.safetensors", sha256="a", weights_digest="b",
                         outer_step=1, master_epoch=1, state_path="master/s", state_sha256="c")
    assert codec.Pointer.from_bytes(good.to_bytes()) == good
    bad = json.dumps({**json.loads(good.to_bytes()), field: value}).encode()
    with pytest.raises(codec.FormatError, match=f"{field} is"):
        codec.Pointer.from_bytes(bad)


def test_tensor_digest_is_the_documented_hash_and_copies_no_tensor():
    """sha256 over (key, dtype, shape, raw bytes) in sorted key order: nodes of different
    versions must agree on it. Hashing used to copy each tensor's bytes whole first."""
    import hashlib
    import tracemalloc

    g = torch.Generator().manual_seed(0)
    tensors = {"b": torch.randn(64, 32, generator=g).to(torch.bfloat16),
               "a": torch.randn(16, 8, generator=g).t(),  # not contiguous
               "c": torch.zeros(0, 4), "d": torch.arange(6, dtype=torch.float16)}
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(bytes(t.reshape(-1).view(torch.uint8).tolist()))
    assert codec.tensor_digest(tensors) == h.hexdigest()
    big = {"w": torch.ones(2 << 20)}  # 8 MiB
    tracemalloc.start()
    try:
        codec.tensor_digest(big)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
