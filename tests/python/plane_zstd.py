"""A reader of hslake's `plane_zstd` tensor encoding with pyarrow and numpy alone, written from
docs/FORMAT.md: the tests use it to show the format can be read without hslake."""
import zlib

import numpy as np
import pyarrow as pa

ELEMENT_SIZE = {"bf16": 2, "f16": 2, "f32": 4, "fp8_e4m3": 1}
NUMPY_TYPE = {"bf16": np.uint16, "f16": np.float16, "f32": np.float32, "fp8_e4m3": np.uint8}


def decode_bytes(value: bytes, size: int, n: int) -> np.ndarray:
    """The little-endian bytes of `n` elements of `size` bytes stored as one plane_zstd value."""
    count = 1 if size == 1 else 1 + 2 * (size - 1)
    frame_lens = np.frombuffer(value[: 4 * count], "<u4")
    end = 4 * count + int(frame_lens.sum())
    if end + 4 == len(value):
        # Format 3: the CRC-32 (zlib's) of every byte before it, little-endian.
        assert zlib.crc32(value[:end]) == int.from_bytes(value[end:], "little"), "value checksum"
        value = value[:end]
    half = (n + 1) // 2
    plane_lens = [n] + [half] * (count - 1)
    planes, pos = [], 4 * count
    for flen, plen in zip(frame_lens, plane_lens):
        frame = value[pos : pos + int(flen)]
        planes.append(np.frombuffer(pa.decompress(frame, decompressed_size=plen, codec="zstd", asbytes=True), np.uint8))
        pos += int(flen)
    assert pos == len(value), "bytes after the last frame"
    if size == 1:
        return planes[0].copy()
    # Top byte plane, then for each lower byte (high to low) a high-nibble and a low-nibble plane.
    rotated = planes[0].astype(np.uint64) << (8 * (size - 1))
    for k in range(size - 1):
        hi, lo = planes[1 + 2 * k], planes[2 + 2 * k]
        byte = np.empty(2 * half, np.uint8)
        byte[0::2] = (hi << 4) | (lo & 0x0F)
        byte[1::2] = (hi & 0xF0) | (lo >> 4)
        rotated |= byte[:n].astype(np.uint64) << (8 * (size - 2 - k))
    bits = 8 * size
    value_bits = (rotated >> 1) | ((rotated & 1) << (bits - 1))  # undo the rotation by one bit
    return value_bits.astype({2: "<u2", 4: "<u4"}[size]).view(np.uint8)


def decode(value: bytes, meta: dict, seq_len: int) -> np.ndarray:
    """A `[seq_len, hidden]` tensor (bf16 as uint16 bits, fp8 as uint8 codes) from its field metadata."""
    assert meta["encoding"] == "plane_zstd" and meta["byte_order"] == "little", meta
    hidden = meta["shape"][1] if len(meta["shape"]) == 2 else 1
    size = ELEMENT_SIZE[meta["dtype"]]
    raw = decode_bytes(value, size, seq_len * hidden)
    shape = (seq_len, hidden) if len(meta["shape"]) == 2 else (seq_len,)
    return raw.view(NUMPY_TYPE[meta["dtype"]]).reshape(shape)
