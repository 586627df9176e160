"""The codec contract: how a KV tensor becomes a record payload and back.

A :class:`Codec` turns one KV block (``[L, 2, T, H, D]``: layers, K/V, tokens, kv heads,
head dim) into ``bytes`` and back. The record header stores the codec's :attr:`Codec.name`
plus the block's dtype and shape; the payload alone is not self-describing.

Names
    :attr:`Codec.name` is the canonical spec string: ``get_codec(c.name).name == c.name``
    and ``get_codec(c.name)`` decodes everything ``c`` encoded.

Determinism
    ``encode`` is a pure function of the codec name and the tensor's dtype, shape and
    values: the same bytes whatever the device, layout (strides) or thread. (For the KIVI
    codecs this holds for finite inputs: the torch and Triton paths are byte-identical.)

Losslessness
    When :attr:`Codec.lossless` is true, ``decode(encode(x))`` is bit-identical to ``x``.
    Lossy codecs are opt-in; their error is bounded per codec (see ``docs/codecs.md``).

Ownership
    ``encode`` never modifies its input. ``decode`` may be given a view of a buffer the
    caller will reuse (an LMDB page, a receive buffer): it never keeps a reference to it,
    and the returned tensor owns its memory.

Errors
    ``encode`` raises :class:`ValueError` for a tensor the codec cannot take (dtype, rank).
    ``decode`` raises :class:`CodecError` — never another exception type — for anything it
    cannot decode: a payload of the wrong length, a corrupt zstd frame, a dtype or shape
    the codec does not support. Codecs check structure, not integrity: a flipped bit that
    leaves the structure valid decodes to a different tensor of the right dtype and shape.
    Integrity is the record checksum's job.

Threads
    Codec objects are immutable and may be shared by any number of threads; per-thread
    state (zstd contexts) is kept per thread by the codec itself.
"""
from __future__ import annotations

import abc
from typing import NamedTuple

import numpy as np
import torch

# The dtypes a KV block may have; every codec takes all of them.
KV_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)


class CodecError(ValueError):
    """A payload cannot be decoded as asked (or a record names an unknown codec)."""


class Section(NamedTuple):
    """A run of a tensor codec's payload made of elements ``itemsize`` bytes wide."""

    nbytes: int
    itemsize: int


class Codec(abc.ABC):
    """Turns a KV tensor into bytes and back. See the module docstring for the contract."""

    name: str
    lossless: bool

    @abc.abstractmethod
    def encode(self, kv: torch.Tensor) -> bytes:
        """The payload for ``kv`` (any device, any strides)."""

    @abc.abstractmethod
    def decode(
        self,
        payload: bytes | memoryview,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        """The tensor of ``dtype`` and ``shape`` on ``device`` that ``payload`` encodes."""

    # A codec is a tensor stage (raw, KIVI: works on the tensor, may run on the engine's
    # device) followed by at most one byte stage (zstd: works on the stage's payload on
    # the host). The CPU pool holds blocks in the stage's form; ``pack`` and
    # ``unpack_into`` apply the byte stage alone.

    @property
    @abc.abstractmethod
    def stage(self) -> TensorCodec:
        """The tensor codec this codec applies first (itself for a tensor codec)."""

    @abc.abstractmethod
    def pack(
        self, staged: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> bytes | memoryview:
        """The payload for a block whose :attr:`stage` payload is ``staged`` (1-D ``uint8``,
        exactly the stage's size): ``pack(stage.encode_array(kv)) == encode(kv)``. It may
        be a view of ``staged`` (a tensor codec's is: no copy), so it is used, or copied,
        before ``staged`` changes."""

    def pack_many(
        self, staged: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> list[bytes | memoryview]:
        """:meth:`pack` of each row of ``staged`` (``[blocks, stage bytes]`` uint8)."""
        return [self.pack(row, dtype, shape) for row in staged]

    @abc.abstractmethod
    def unpack_into(
        self, payload: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...], out: np.ndarray
    ) -> None:
        """Write the :attr:`stage` payload that ``payload`` holds into ``out`` (1-D ``uint8``,
        the stage's size): the inverse of :meth:`pack`, with no other allocation of the
        block's size. :class:`CodecError` for anything it cannot decode."""

    def __repr__(self) -> str:
        return f"<codec {self.name}>"


class TensorCodec(Codec):
    """A codec that works on the tensor itself and can be followed by a byte codec.

    Its payload is a concatenation of :class:`Section` s whose sizes follow from the dtype
    and shape alone (:meth:`layout`), so a byte codec that follows it (zstd) can treat each
    section by its element width without storing anything about it.
    """

    @abc.abstractmethod
    def layout(self, dtype: torch.dtype, shape: tuple[int, ...]) -> list[Section]:
        """The payload's sections for a tensor of ``dtype`` and ``shape``.

        Raises :class:`CodecError` if the codec does not support that dtype or shape.
        """

    @abc.abstractmethod
    def encode_array(self, kv: torch.Tensor) -> np.ndarray:
        """The payload as a contiguous 1-D ``uint8`` host array laid out as :meth:`layout` says.

        The array may share memory with ``kv`` (when ``kv`` is a contiguous CPU tensor);
        callers copy it before ``kv`` can change.
        """

    @abc.abstractmethod
    def decode_array(
        self, buf: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device | str
    ) -> torch.Tensor:
        """Decode ``buf`` (1-D ``uint8``, exactly the layout's size; may be read-only)."""

    def payload_size(self, dtype: torch.dtype, shape: tuple[int, ...]) -> int:
        # asked once per record read: kept per (dtype, shape), which a codec never changes
        sizes: dict = self.__dict__.setdefault("_payload_sizes", {})
        key = (dtype, tuple(shape))
        size = sizes.get(key)
        if size is None:
            size = sizes[key] = sum(s.nbytes for s in self.layout(dtype, key[1]))
        return size

    @abc.abstractmethod
    def encode_blocks(self, blocks: torch.Tensor, out: torch.Tensor) -> None:
        """Encode a batch of blocks ``[n, L, 2, T, H, D]`` on their device into ``out``
        ``[n, payload_size]`` (``uint8``, same device): row ``i`` is the payload of block
        ``i``, byte for byte what :meth:`encode_array` gives for it."""

    @abc.abstractmethod
    def decode_blocks(self, payloads: torch.Tensor, out: torch.Tensor) -> None:
        """The inverse of :meth:`encode_blocks`: decode ``payloads`` ``[n, payload_size]``
        into ``out`` ``[n, L, 2, T, H, D]`` on the same device."""

    @property
    def stage(self) -> TensorCodec:
        return self

    def pack(
        self, staged: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> bytes | memoryview:
        return memoryview(staged)

    def unpack_into(
        self, payload: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...], out: np.ndarray
    ) -> None:
        buf = as_byte_array(payload)
        expected = self.payload_size(dtype, tuple(shape))
        if buf.size != expected or out.size != expected:
            raise CodecError(
                f"{self.name} payload for {dtype} {list(shape)} is {expected} bytes, got "
                f"{buf.size} (into {out.size})"
            )
        out[:] = buf

    def encode(self, kv: torch.Tensor) -> bytes:
        return self.encode_array(kv).tobytes()

    def decode(
        self,
        payload: bytes | memoryview,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        device: torch.device | str = "cpu",
    ) -> torch.Tensor:
        shape = tuple(shape)
        expected = self.payload_size(dtype, shape)
        buf = as_byte_array(payload)
        if buf.size != expected:
            raise CodecError(
                f"{self.name} payload for {dtype} {list(shape)} is {expected} bytes, got {buf.size}"
            )
        return self.decode_array(buf, dtype, shape, device)


def as_byte_array(payload: bytes | memoryview) -> np.ndarray:
    """A 1-D ``uint8`` view of ``payload`` (no copy)."""
    try:
        return np.frombuffer(memoryview(payload).cast("B"), dtype=np.uint8)
    except (TypeError, ValueError) as e:
        raise CodecError(f"payload is not a contiguous byte buffer: {e}") from None


def check_kv_dtype(dtype: torch.dtype, codec: str, error: type[ValueError] = ValueError) -> None:
    if dtype not in KV_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in KV_DTYPES)
        raise error(f"codec {codec} does not take {dtype}; KV dtypes are {names}")


def check_shape(shape: tuple[int, ...], codec: str, error: type[ValueError] = ValueError) -> None:
    if any(not isinstance(n, int) or n < 0 for n in shape):
        raise error(f"codec {codec}: invalid shape {list(shape)}")
