"""``zstd``: lossless byte-plane split + zstd, after any tensor codec.

Every section of the inner codec's payload (see :class:`TensorCodec.layout`) whose elements
are ``w`` bytes wide is split into ``w`` byte planes — plane ``i`` holds byte ``i`` of every
element, little-endian, so for fp16/bf16 plane 1 is sign + exponent (+ the top mantissa
bits) and compresses well, while plane 0 is mantissa and hardly does. Each plane is then
compressed on its own. Payload::

    4 * P   u32 stored length of each plane, in section order, then byte order
    ...     the planes, concatenated

A plane whose stored length equals its raw length is stored as-is (zstd did not make it
smaller); a shorter one is a single zstd frame that carries its content size. ``P`` and the
raw plane lengths follow from the inner codec's layout for the record's dtype and shape.

Decoding is bounded by those lengths: a frame must declare exactly its plane's size and
fill its stored length, and is decompressed into at most that size, so a crafted payload
cannot make the decoder allocate more than the block the record declares. (That the
declared dtype and shape are the engine's is the loader's check.)
"""
from __future__ import annotations

import struct
import threading

import numpy as np
import torch
import zstandard

from storage.codecs.base import Codec, CodecError, Section, TensorCodec, as_byte_array

DEFAULT_LEVEL = 1
MIN_LEVEL, MAX_LEVEL = 1, 19
_FRAME_MAGIC = b"\x28\xb5\x2f\xfd"  # 0xFD2FB528, little-endian
# From this size on a frame is copied with the GIL released; below, a hand-off costs more.
_RELEASED_COPY_BYTES = 64 << 10


class ZstdCodec(Codec):
    """Byte planes of ``inner``'s payload, each compressed with zstd at ``level``."""

    lossless: bool

    def __init__(self, inner: TensorCodec, level: int = DEFAULT_LEVEL) -> None:
        if not MIN_LEVEL <= level <= MAX_LEVEL:
            raise ValueError(f"zstd level must be {MIN_LEVEL}..{MAX_LEVEL}, got {level}")
        self.inner = inner
        self.level = level
        self.lossless = inner.lossless
        stage = "zstd" if level == DEFAULT_LEVEL else f"zstd:{level}"
        self.name = stage if inner.name == "raw" else f"{inner.name}+{stage}"
        # zstandard contexts are not thread-safe: one pair per thread, reused across calls.
        self._local = threading.local()
        self._layouts: dict[tuple[torch.dtype, tuple[int, ...]], list[Section]] = {}

    def _compressor(self) -> zstandard.ZstdCompressor:
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            # No frame checksum: the record's xxh3 already covers the payload.
            cctx = self._local.cctx = zstandard.ZstdCompressor(
                level=self.level, write_checksum=False, write_content_size=True
            )
        return cctx

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor()
        return dctx

    @property
    def stage(self) -> TensorCodec:
        return self.inner

    def encode(self, kv: torch.Tensor) -> bytes:
        parts = self._planes(self.inner.encode_array(kv), kv.dtype, tuple(kv.shape))
        return b"".join([_lengths(parts), *parts])

    def pack(self, staged: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> memoryview:
        """:meth:`encode`'s bytes, joined by numpy, which copies with the GIL released:
        ``bytes.join`` holds it for any result under 1 MiB, a whole block's bytes on a
        writer's pack thread."""
        parts = self._planes(staged, dtype, tuple(shape))
        head = np.frombuffer(_lengths(parts), dtype=np.uint8)
        return memoryview(np.concatenate([head, *parts]))

    def pack_many(
        self, staged: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> list[memoryview]:
        """:meth:`pack` of each row of ``staged`` (``[blocks, stage bytes]`` uint8), as views
        of one buffer: one numpy copy a section gathers every row's byte planes behind room
        for its header (with the GIL released), each plane is compressed from there, and a
        frame zstd made smaller takes the plane's place, the planes after it moved up. A
        block whose planes do not compress (random bytes) is packed where it was gathered."""
        layout = self._layout(dtype, tuple(shape))
        blocks = staged.shape[0]
        num_planes = sum(s.itemsize for s in layout)
        head = 4 * num_planes
        width = head + staged.shape[1]
        out = np.empty((blocks, width), dtype=np.uint8)
        planes: list[tuple[int, int]] = []  # (offset in a row of out, length) of each plane
        offset = 0
        for section in layout:
            n = section.nbytes // section.itemsize
            data = staged[:, offset : offset + section.nbytes]
            gathered = out[:, head + offset : head + offset + section.nbytes]
            # [blocks, n, w] -> [blocks, w, n]: plane i holds byte i of every element
            gathered.reshape(blocks, section.itemsize, n)[:] = (
                data.reshape(blocks, n, section.itemsize).transpose(0, 2, 1)
            )
            planes += [(head + offset + i * n, n) for i in range(section.itemsize)]
            offset += section.nbytes
        buf = out.reshape(-1)
        flat = memoryview(buf)
        cctx = self._compressor()
        header = struct.Struct(f"<{num_planes}I")
        payloads = []
        for row in range(0, blocks * width, width):
            end = row + head
            lengths = []
            for start, n in planes:
                packed = cctx.compress(flat[row + start : row + start + n])
                if len(packed) < n:
                    _copy(buf, flat, end, packed)
                    n = len(packed)
                elif end != row + start:  # after a smaller frame: up, by numpy (they overlap)
                    buf[end : end + n] = buf[row + start : row + start + n]
                lengths.append(n)
                end += n
            header.pack_into(flat, row, *lengths)
            payloads.append(flat[row:end])
        return payloads

    def _planes(
        self, staged: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> list[np.ndarray]:
        """The stored planes of a stage payload, in order: each one's zstd frame, or the
        plane itself where zstd did not make it smaller."""
        cctx = self._compressor()
        parts: list[np.ndarray] = []
        offset = 0
        for section in self._layout(dtype, shape):
            data = staged[offset : offset + section.nbytes]
            offset += section.nbytes
            # [n, w] -> [w, n]: one copy that gathers each byte plane contiguously.
            planes = data.reshape(-1, section.itemsize).T.copy() if section.itemsize > 1 else [data]
            for plane in planes:
                packed = cctx.compress(plane)
                smaller = len(packed) < plane.size
                parts.append(np.frombuffer(packed, dtype=np.uint8) if smaller else plane)
        return parts

    def _layout(self, dtype: torch.dtype, shape: tuple[int, ...]) -> list[Section]:
        """The inner codec's layout, kept per (dtype, shape): a writer asks once a block."""
        layout = self._layouts.get((dtype, shape))
        if layout is None:
            layout = self._layouts[(dtype, shape)] = self.inner.layout(dtype, shape)
        return layout

    def decode(
        self,
        payload: bytes | memoryview,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        shape = tuple(shape)
        out = np.empty(self.inner.payload_size(dtype, shape), dtype=np.uint8)
        self.unpack_into(payload, dtype, shape, out)
        return self.inner.decode_array(out, dtype, shape, device)

    def unpack_into(
        self, payload: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...], out: np.ndarray
    ) -> None:
        shape = tuple(shape)
        layout = self._layout(dtype, shape)
        if out.size != sum(s.nbytes for s in layout):
            raise CodecError(
                f"{self.name}: a {dtype} {list(shape)} block stages to "
                f"{sum(s.nbytes for s in layout)} bytes, not {out.size}"
            )
        src = as_byte_array(payload)
        num_planes = sum(s.itemsize for s in layout)
        header = 4 * num_planes
        if src.size < header:
            raise CodecError(f"{self.name} payload of {src.size} bytes is shorter than its header")
        lengths = struct.unpack_from(f"<{num_planes}I", src, 0)
        if header + sum(lengths) != src.size:
            raise CodecError(
                f"{self.name} payload is {src.size} bytes, its header accounts for "
                f"{header + sum(lengths)}"
            )
        # Every frame is checked before anything is allocated for the block.
        plane_lens = [s.nbytes // s.itemsize for s in layout for _ in range(s.itemsize)]
        chunks: list[np.ndarray] = []
        pos = header
        for stored, plane_len in zip(lengths, plane_lens):
            chunks.append(src[pos : pos + stored])
            pos += stored
            self._check_frame(chunks[-1], plane_len)
        dctx = self._decompressor()
        planes = iter(chunks)
        offset = 0
        for section in layout:
            # [n, w]: column i is byte plane i
            dst = out[offset : offset + section.nbytes].reshape(-1, section.itemsize)
            offset += section.nbytes
            for i in range(section.itemsize):
                dst[:, i] = self._plane(dctx, next(planes), dst.shape[0])

    def _check_frame(self, chunk: np.ndarray, plane_len: int) -> None:
        """A stored plane is the plane itself, or one zstd frame that declares exactly the
        plane's size: a frame that could expand further (a zstd bomb) is refused unread."""
        if chunk.size == plane_len:
            return
        if chunk.size > plane_len:
            raise CodecError(f"{self.name}: a plane of {plane_len} bytes is stored in {chunk.size}")
        if bytes(chunk[:4]) != _FRAME_MAGIC:
            raise CodecError(f"{self.name}: corrupt zstd frame: not a zstd frame")
        try:
            params = zstandard.get_frame_parameters(chunk)
        except zstandard.ZstdError as e:
            raise CodecError(f"{self.name}: corrupt zstd frame: {e}") from None
        if params.content_size == zstandard.CONTENTSIZE_UNKNOWN:
            raise CodecError(f"{self.name}: zstd frame without a content size")
        if params.content_size != plane_len:
            raise CodecError(
                f"{self.name}: zstd frame declares {params.content_size} bytes, "
                f"the plane is {plane_len}"
            )
        if params.dict_id:
            raise CodecError(f"{self.name}: zstd frame needs dictionary {params.dict_id}")

    def _plane(self, dctx: zstandard.ZstdDecompressor, chunk: np.ndarray, plane_len: int) -> np.ndarray:
        """A plane checked by :meth:`_check_frame`, decompressed into at most its size."""
        if chunk.size == plane_len:
            return chunk
        try:
            # One frame filling the chunk: bytes after it would be a second, unchecked frame.
            data = dctx.decompress(chunk, max_output_size=plane_len, allow_extra_data=False)
        except zstandard.ZstdError as e:
            raise CodecError(f"{self.name}: corrupt zstd frame: {e}") from None
        if len(data) != plane_len:
            raise CodecError(f"{self.name}: zstd frame gave {len(data)} bytes, expected {plane_len}")
        return np.frombuffer(data, dtype=np.uint8)


def _copy(buf: np.ndarray, flat: memoryview, at: int, data: bytes) -> None:
    """``data`` into ``buf[at:]``: by numpy, with the GIL released, for a large frame."""
    if len(data) >= _RELEASED_COPY_BYTES:
        buf[at : at + len(data)] = np.frombuffer(data, dtype=np.uint8)
    else:
        flat[at : at + len(data)] = data


def _lengths(parts: list[np.ndarray]) -> bytes:
    """The payload's header: each stored plane's length (u32)."""
    return struct.pack(f"<{len(parts)}I", *(part.size for part in parts))
