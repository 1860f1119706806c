"""Tensors as pool values, in Mooncake's tensor object format.

A value is a 304-byte header (Mooncake's ``TensorObjectHeader`` and its
layout block, little-endian) followed by the tensor's bytes in C order:

    header (40 bytes): u32 magic 0x4d4f4f4e ("MOON" read as a u32), u16
        version 1, u16 header size 304, i32 dtype code, i32 ndim, u32 layout
        kind (0 whole, 1 shard), u32 flags 0, u64 data offset 304, u64 data
        bytes
    layout (264 bytes): i64 global shape[8], i64 local shape[8] (-1 past
        ndim), u32 axis count, u32 0, 4 axes of 32 bytes (i32 kind, axis
        index, shard rank, shard count, split dim, 0; i64 0)

so a tensor stored here reads back with Mooncake's ``get_tensor`` and the
other way round. Nothing here imports torch until a tensor is made or read.
"""

from __future__ import annotations

import struct

HEADER_SIZE = 304
MAGIC = 0x4D4F4F4E
VERSION = 1
MAX_DIMS = 8
MAX_AXES = 4
_FULL, _SHARD = 0, 1

_HEAD = struct.Struct("<IHHiiIIQQ")
_SHAPE = struct.Struct(f"<{MAX_DIMS}q")
_AXES_AT = _HEAD.size + 2 * _SHAPE.size
_COUNT = struct.Struct("<II")
_AXIS = struct.Struct("<iiiiiiq")
assert _AXES_AT + _COUNT.size + MAX_AXES * _AXIS.size == HEADER_SIZE

#: Mooncake's dtype codes: (torch attribute, element size), by code.
DTYPES = (
    ("float32", 4), ("float64", 8), ("int8", 1), ("uint8", 1), ("int16", 2),
    ("uint16", 2), ("int32", 4), ("uint32", 4), ("int64", 8), ("uint64", 8),
    ("bool", 1), ("float16", 2), ("bfloat16", 2), ("float8_e4m3fn", 1),
    ("float8_e5m2", 1),
)


def encode_header(code: int, shape, data_bytes: int) -> bytes:
    """The header of a whole tensor of dtype ``code`` and ``shape``."""
    if not 0 <= code < len(DTYPES):
        raise ValueError(f"dtype code {code} is not one of Mooncake's")
    shape = [int(d) for d in shape]
    if len(shape) > MAX_DIMS:
        raise ValueError(f"a tensor of {len(shape)} dimensions (at most {MAX_DIMS})")
    if any(d < 0 for d in shape):
        raise ValueError(f"shape {tuple(shape)}: a negative dimension")
    dims = shape + [-1] * (MAX_DIMS - len(shape))
    out = bytearray(HEADER_SIZE)
    _HEAD.pack_into(out, 0, MAGIC, VERSION, HEADER_SIZE, code, len(shape), _FULL, 0,
                    HEADER_SIZE, data_bytes)
    _SHAPE.pack_into(out, _HEAD.size, *dims)
    _SHAPE.pack_into(out, _HEAD.size + _SHAPE.size, *dims)
    # Axis count 0 and the axes are the zeros already there.
    return bytes(out)


def decode_header(buf) -> tuple[int, tuple[int, ...]]:
    """(dtype code, local shape) of a stored tensor; ``ValueError`` naming
    what is wrong when ``buf`` is not one. Checks what Mooncake checks, and
    that the data is exactly the shape's bytes (the value read back is
    reshaped by it)."""
    mv = memoryview(buf).cast("B")
    if len(mv) < HEADER_SIZE:
        raise ValueError(f"{len(mv)} bytes: shorter than the {HEADER_SIZE}-byte tensor header")
    magic, version, size, code, ndim, kind, _flags, offset, nbytes = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC or version != VERSION or size != HEADER_SIZE:
        raise ValueError("not a tensor object (magic, version or header size)")
    if not 0 <= code < len(DTYPES):
        raise ValueError(f"unknown dtype code {code}")
    if not 0 <= ndim <= MAX_DIMS:
        raise ValueError(f"ndim {ndim}")
    if kind not in (_FULL, _SHARD):
        raise ValueError(f"layout kind {kind}")
    if offset != HEADER_SIZE or nbytes != len(mv) - offset:
        raise ValueError(f"data at {offset}, {nbytes} bytes, in a value of {len(mv)}")
    glob = _SHAPE.unpack_from(mv, _HEAD.size)
    local = _SHAPE.unpack_from(mv, _HEAD.size + _SHAPE.size)
    # A dimension may be 0 (an empty tensor: the header alone, as Mooncake
    # stores it).
    if any(d < 0 for d in glob[:ndim]) or any(d < 0 for d in local[:ndim]):
        raise ValueError("a dimension out of range")
    if any(d != -1 for d in glob[ndim:] + local[ndim:]):
        raise ValueError("dimensions past ndim are not -1")
    count, _ = _COUNT.unpack_from(mv, _AXES_AT)
    if count > MAX_AXES:
        raise ValueError(f"{count} layout axes")
    for i in range(count):
        kind_, _idx, rank, shards, split, _r0, _r1 = _AXIS.unpack_from(
            mv, _AXES_AT + _COUNT.size + i * _AXIS.size)
        if not (0 <= kind_ <= 4 and 0 <= rank < shards and -1 <= split < ndim):
            raise ValueError(f"layout axis {i}")
    shape = tuple(local[:ndim])
    n = 1
    for d in shape:
        n *= d
    if n * DTYPES[code][1] != nbytes:
        raise ValueError(f"{nbytes} data bytes for shape {shape} of {DTYPES[code][0]}")
    return code, shape


def _torch():
    try:
        import torch
    except ImportError as e:
        raise ImportError("the tensor calls need torch (pip install torch)") from e
    return torch


def tensor_parts(tensor):
    """(header, data) of a torch tensor: the data is a host copy when the
    tensor is on a device or not contiguous, else the tensor's own memory.
    ``TypeError`` for what is not a tensor of a storable dtype."""
    torch = _torch()
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"a torch.Tensor is needed, not {type(tensor).__name__}")
    code = next((i for i, (name, _) in enumerate(DTYPES)
                 if getattr(torch, name, None) == tensor.dtype), None)
    if code is None:
        raise TypeError(f"dtype {tensor.dtype} has no code in Mooncake's tensor format")
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    data = t.reshape(-1).view(torch.uint8).numpy()
    return encode_header(code, t.shape, data.nbytes), data


def tensor_of(buf):
    """The CPU tensor a stored value holds (sharing ``buf``'s memory), or
    ``ValueError`` when the value is not a tensor object."""
    code, shape = decode_header(buf)
    torch = _torch()
    dtype = getattr(torch, DTYPES[code][0], None)
    if dtype is None:
        raise ValueError(f"this torch has no {DTYPES[code][0]}")
    nbytes = len(memoryview(buf).cast("B")) - HEADER_SIZE
    if nbytes == 0:
        # An empty tensor (torch.frombuffer refuses an empty range).
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=HEADER_SIZE)
    return raw.view(dtype).reshape(shape)
