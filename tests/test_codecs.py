from __future__ import annotations

import hashlib
import struct
import threading

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from memory_testing import traced_peak
from storage.base import BlockKey
from storage.codecs import CodecError, decode_block, encode_block, get_codec
from storage.codecs.base import KV_DTYPES
from storage.codecs.kivi import GROUP, kivi_layout
from storage.record import Record, decode_record, encode_record
from storage.seal import SealKey

LOSSLESS = ["raw", "zstd", "zstd:5"]
LOSSY = ["kivi2", "kivi4", "kivi2+zstd", "kivi4+zstd"]
SHAPE = (2, 2, 16, 3, 32)  # [L, 2, T, H, D]
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def make_kv(shape=SHAPE, dtype=torch.float16, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 2
    x[:, 0, ..., :2] += 6  # a couple of outlier key channels, as in real models
    return x.to(dtype)


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def key(i: int = 0) -> BlockKey:
    return BlockKey(hashlib.sha256(b"ns").digest(), hashlib.sha256(str(i).encode()).digest())


# --- lossless -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("spec", LOSSLESS)
def test_lossless_round_trip_is_bit_exact(spec, dtype):
    codec = get_codec(spec)
    kv = make_kv(dtype=dtype)
    out = codec.decode(codec.encode(kv), dtype, SHAPE)
    assert codec.lossless
    assert out.dtype == dtype and tuple(out.shape) == SHAPE
    assert torch.equal(bits_of(out), bits_of(kv))


@pytest.mark.parametrize("spec", LOSSLESS + LOSSY)
def test_encode_ignores_strides_and_is_deterministic(spec):
    codec = get_codec(spec)
    kv = make_kv(dtype=torch.bfloat16)
    strided = kv.permute(4, 0, 1, 2, 3).contiguous().permute(1, 2, 3, 4, 0)
    assert not strided.is_contiguous()
    assert codec.encode(strided) == codec.encode(kv) == codec.encode(kv.clone())


def test_zstd_compresses_exponent_plane():
    kv = make_kv(shape=(4, 2, 16, 4, 64), dtype=torch.bfloat16)
    payload = get_codec("zstd").encode(kv)
    low, high = struct.unpack_from("<2I", payload)
    assert low <= kv.numel() and high < 0.6 * kv.numel()


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    shape=st.lists(st.integers(0, 7), min_size=0, max_size=5).map(tuple),
    dtype=st.sampled_from(KV_DTYPES),
    spec=st.sampled_from(LOSSLESS),
    seed=st.integers(0, 2**32 - 1),
)
def test_lossless_random_shapes_and_bit_patterns(shape, dtype, spec, seed):
    # Random bytes cover every bit pattern: NaNs, infinities, subnormals, negative zero.
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    kv = torch.empty(shape, dtype=dtype)
    bits_of(kv).numpy()[:] = raw
    codec = get_codec(spec)
    out = codec.decode(codec.encode(kv), dtype, shape)
    assert tuple(out.shape) == shape
    assert torch.equal(bits_of(out), bits_of(kv))


# --- KIVI ---------------------------------------------------------------------------------

_OUT_EPS = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24,
            torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}
_OUT_TINY = {torch.float8_e4m3fn: 2.0**-10, torch.float8_e5m2: 2.0**-17}


def kivi_bound(kv: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-element error bound: half a step, plus fp16 rounding of the scale and zero
    (≤ 2**-11 relative each, the scale's counted over all qmax steps), plus rounding of
    the result to the block's dtype."""
    payload = get_codec(f"kivi{bits}").encode(kv)
    meta = kivi_layout(tuple(kv.shape), bits).views(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    qmax = (1 << bits) - 1
    bounds = []
    for scale, zero, n, to_block in (
        (meta.key_scale, meta.key_zero, kv.shape[2], lambda t: t.permute(0, 3, 1, 2)),
        (meta.value_scale, meta.value_zero, kv.shape[4], lambda t: t),
    ):
        s = scale.float().repeat_interleave(GROUP, dim=-1)[..., :n]
        z = zero.float().repeat_interleave(GROUP, dim=-1)[..., :n]
        bound = s / 2 + (qmax * s + z.abs()) * 2.0**-10 + 2.0**-24
        bounds.append(to_block(bound))
    bound = torch.stack(bounds, dim=1)  # [L, 2, T, H, D]
    x = kv.float()
    return bound + (x.abs() + bound) * _OUT_EPS[kv.dtype] + _OUT_TINY.get(kv.dtype, 0.0)


@pytest.mark.parametrize(
    "shape",
    [SHAPE, (1, 2, 32, 2, 40), (2, 2, 48, 1, 64), (1, 2, 5, 2, 7)],
    ids=["T16-D32", "T32-D40-tail", "T48-key-tail", "T5-D7-odd"],
)
@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("spec", LOSSY)
def test_kivi_error_is_bounded(spec, dtype, shape):
    codec = get_codec(spec)
    kv = make_kv(shape, dtype)
    out = codec.decode(codec.encode(kv), dtype, shape)
    assert not codec.lossless
    assert out.dtype == dtype and tuple(out.shape) == shape
    bits = int(spec[4])
    err = (out.float() - kv.float()).abs()
    assert (err <= kivi_bound(kv, bits)).all(), f"max error {err.max():.4g}"


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_zstd_decodes_like_kivi(bits):
    kv = make_kv(dtype=torch.bfloat16)
    plain, packed = get_codec(f"kivi{bits}"), get_codec(f"kivi{bits}+zstd")
    a = plain.decode(plain.encode(kv), kv.dtype, SHAPE)
    b = packed.decode(packed.encode(kv), kv.dtype, SHAPE)
    assert torch.equal(bits_of(a), bits_of(b))


@pytest.mark.parametrize("value", [0.0, 3.0, -1e-3, 70000.0])
def test_kivi_constant_groups(value):
    # Zero range: the scale is 0 and every element decodes to fp16(value) (saturated).
    kv = torch.full(SHAPE, value, dtype=torch.float32)
    out = get_codec("kivi2").decode(get_codec("kivi2").encode(kv), kv.dtype, SHAPE)
    expected = torch.tensor(value).clamp(-65504, 65504).half().float()
    assert torch.isfinite(out).all()
    assert (out == expected).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_kivi_non_finite_groups(dtype):
    # A group of one infinity is constant (its zero saturates to ±65504), NaN reads as 0,
    # and an infinity beside finite values leaves them finite.
    inf, nan = float("inf"), float("nan")
    kv = make_kv(SHAPE, dtype)
    kv[:, 1, 0, 0], kv[:, 1, 1, 0], kv[:, 1, 2, 0] = inf, -inf, nan  # whole value groups
    kv[:, 1, 3, 0, 5], kv[:, 1, 4, 0, 7], kv[:, 1, 5, 0, 9] = nan, inf, -inf
    codec = get_codec("kivi4")
    out = codec.decode(codec.encode(kv), dtype, SHAPE)
    saturated = torch.tensor(65504.0).to(dtype)
    assert (out[:, 1, 0, 0] == saturated).all() and (out[:, 1, 1, 0] == -saturated).all()
    assert (out[:, 1, 2, 0] == 0).all()
    assert not out.isnan().any()
    assert out[kv.isfinite()].isfinite().all()
    assert codec.encode(kv) == codec.encode(torch.where(kv.isnan(), 0, kv))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    dtype=st.sampled_from(KV_DTYPES),
    bits=st.sampled_from([2, 4]),
    seed=st.integers(0, 2**32 - 1),
)
def test_kivi_random_bit_patterns_never_decode_to_nan(dtype, bits, seed):
    # Random bytes: NaNs, infinities, subnormals, signed zeros, values beyond fp16. Every
    # scale and zero written is finite, so nothing decodes to NaN.
    shape = (1, 2, 16, 2, 40)
    kv = torch.empty(shape, dtype=dtype)
    n = kv.numel() * dtype.itemsize
    bits_of(kv).numpy()[:] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    codec = get_codec(f"kivi{bits}")
    payload = codec.encode(kv)
    meta = kivi_layout(shape, bits).views(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    for t in (meta.key_scale, meta.key_zero, meta.value_scale, meta.value_zero):
        assert t.isfinite().all()
    assert not meta.key_scale.signbit().any() and not meta.value_scale.signbit().any()
    assert not codec.decode(payload, dtype, shape).isnan().any()


@pytest.mark.parametrize(
    "bits,T,expected",
    [(4, 16, 6 / 2 + 5 / 2), (4, 32, 5.0), (2, 16, 4 / 2 + 3 / 2), (2, 32, 3.0)],
)
def test_kivi_bits_per_value(bits, T, expected):
    # Codes plus 32 bits of scale + zero per group: key groups are min(T, 32) tokens long.
    shape = (2, 2, T, 4, 64)
    size = len(get_codec(f"kivi{bits}").encode(make_kv(shape)))
    assert 8 * size / np.prod(shape) == expected


@settings(max_examples=25, deadline=None, derandomize=True)
@given(
    shape=st.tuples(st.integers(1, 2), st.just(2), st.integers(1, 70), st.integers(1, 3),
                    st.integers(1, 70)),
    bits=st.sampled_from([2, 4]),
    seed=st.integers(0, 2**16),
)
def test_kivi_random_shapes(shape, bits, seed):
    kv = make_kv(shape, torch.float16, seed)
    codec = get_codec(f"kivi{bits}+zstd")
    out = codec.decode(codec.encode(kv), kv.dtype, shape)
    assert ((out.float() - kv.float()).abs() <= kivi_bound(kv, bits)).all()


def test_kivi_rejects_non_blocks():
    with pytest.raises(ValueError, match="L, 2, T, H, D"):
        get_codec("kivi4").encode(torch.zeros(2, 3, 4, 5, 6))
    with pytest.raises(ValueError, match="L, 2, T, H, D"):
        get_codec("kivi4").encode(torch.zeros(2, 16, 4, 8))


def test_encode_rejects_non_kv_dtypes():
    for spec in ("raw", "zstd", "kivi2"):
        with pytest.raises(ValueError, match="KV dtypes"):
            get_codec(spec).encode(torch.zeros(SHAPE, dtype=torch.int32))


# --- registry -----------------------------------------------------------------------------

@pytest.mark.parametrize(
    "spec,name,lossless",
    [
        ("raw", "raw", True),
        ("zstd", "zstd", True),
        ("zstd:1", "zstd", True),
        ("raw+zstd", "zstd", True),
        ("zstd:3", "zstd:3", True),
        ("kivi2", "kivi2", False),
        ("kivi4", "kivi4", False),
        ("kivi2+zstd", "kivi2+zstd", False),
        ("kivi4+zstd:1", "kivi4+zstd", False),
        ("kivi4+zstd:19", "kivi4+zstd:19", False),
    ],
)
def test_canonical_names_round_trip(spec, name, lossless):
    codec = get_codec(spec)
    assert codec.name == name and codec.lossless is lossless
    assert get_codec(codec.name).name == name


@pytest.mark.parametrize(
    "spec",
    ["", "foo", "ZSTD", "zstd:0", "zstd:20", "zstd:-1", "zstd:x", "zstd:", "kivi3", "kivi2+kivi4",
     "zstd+zstd", "kivi2+zstd+zstd", "raw+", "+zstd", "kivi2 ", "raw+raw", None, 3, ["zstd"]],
)
def test_registry_rejects_bad_specs(spec):
    with pytest.raises(ValueError, match="kivi2"):
        get_codec(spec)


def test_registry_error_lists_valid_specs():
    with pytest.raises(ValueError) as info:
        get_codec("lz4")
    for name in ("raw", "zstd[:LEVEL]", "kivi2", "kivi4", "kivi2+zstd", "kivi4+zstd"):
        assert name in str(info.value)


# --- malformed payloads -------------------------------------------------------------------

@pytest.mark.parametrize("spec", LOSSLESS + LOSSY)
def test_wrong_length_raises_codec_error(spec):
    codec = get_codec(spec)
    payload = codec.encode(make_kv())
    for bad in (b"", payload[:-1], payload + b"\0", payload[: len(payload) // 2]):
        with pytest.raises(CodecError):
            codec.decode(bad, torch.float16, SHAPE)


@pytest.mark.parametrize("spec", LOSSLESS + LOSSY)
def test_wrong_dtype_or_shape_raises_codec_error(spec):
    codec = get_codec(spec)
    payload = codec.encode(make_kv())
    with pytest.raises(CodecError):
        codec.decode(payload, torch.int32, SHAPE)
    with pytest.raises(CodecError):
        codec.decode(payload, torch.float16, (2, 2, 16, 3, 31))
    if spec.startswith("kivi"):
        with pytest.raises(CodecError):
            codec.decode(payload, torch.float16, (4, 16, 3, 32))


@pytest.mark.parametrize("spec", ["zstd", "kivi2+zstd", "kivi4+zstd"])
def test_corrupt_zstd_planes_raise_codec_error(spec):
    codec = get_codec(spec)
    payload = bytearray(codec.encode(make_kv(dtype=torch.bfloat16)))
    sizes = [s.nbytes // s.itemsize for s in codec.inner.layout(torch.bfloat16, SHAPE)
             for _ in range(s.itemsize)]
    header = 4 * len(sizes)
    lengths = list(struct.unpack_from(f"<{len(sizes)}I", payload))
    i = next(i for i, (n, size) in enumerate(zip(lengths, sizes)) if n < size)  # a zstd frame
    start = header + sum(lengths[:i])

    bad = payload.copy()
    bad[start : start + 4] = b"\xde\xad\xbe\xef"  # not a zstd magic number
    with pytest.raises(CodecError, match="zstd"):
        codec.decode(bytes(bad), torch.bfloat16, SHAPE)

    # Lengths that still add up but split the planes in the wrong place.
    bad = payload.copy()
    struct.pack_into("<2I", bad, 0, lengths[0] - 1, lengths[1] + 1)
    with pytest.raises(CodecError):
        codec.decode(bytes(bad), torch.bfloat16, SHAPE)

    # A valid frame of the wrong size is refused before it is decompressed.
    forged = zstandard.ZstdCompressor().compress(bytes(sizes[i] + 4096))
    lengths[i] = len(forged)
    bad = bytearray(struct.pack(f"<{len(sizes)}I", *lengths)) + payload[header:start] + forged
    bad += payload[start + struct.unpack_from("<I", payload, 4 * i)[0] :]
    with pytest.raises(CodecError, match="declares"):
        codec.decode(bytes(bad), torch.bfloat16, SHAPE)


BOMBS = [
    "a frame declaring more",
    "a frame without a content size",
    "the plane's frame, then a bomb",
    "the plane's frame twice",
    "a frame without a content size, then a bomb",
    "a skippable frame",
]


def bomb_frame(kind: str, plane_len: int) -> bytes:
    """A stored plane that would expand far past ``plane_len`` bytes (64 MiB of zeros
    compress to about 2 KiB), or that is not one frame of exactly the plane's size."""
    bomb = zstandard.ZstdCompressor().compress(bytes(64 << 20))
    unsized = zstandard.ZstdCompressor(write_content_size=False)
    plane = zstandard.ZstdCompressor().compress(bytes(plane_len))
    return {
        "a frame declaring more": bomb,
        "a frame without a content size": unsized.compress(bytes(64 << 20)),
        "the plane's frame, then a bomb": plane + bomb,
        "the plane's frame twice": plane + plane,
        "a frame without a content size, then a bomb": unsized.compress(bytes(plane_len)) + bomb,
        "a skippable frame": struct.pack("<II", 0x184D2A50, plane_len - 9) + bytes(plane_len - 9),
    }[kind]


@pytest.mark.parametrize("bomb", BOMBS)
def test_zstd_bomb_in_a_record_is_refused_without_expanding(bomb: str):
    
    kv = make_kv(dtype=torch.bfloat16)
    good = encode_block(key(1), None, range(16), kv, "zstd")
    planes = get_codec("zstd").inner.layout(torch.bfloat16, SHAPE)[0].nbytes // 2
    lengths = struct.unpack_from("<2I", good.payload)
    forged = bomb_frame(bomb, planes)
    payload = struct.pack("<2I", len(forged), lengths[1]) + forged + good.payload[8 + lengths[0] :]
    record = Record(key(1), None, good.token_ids, "zstd", torch.bfloat16, SHAPE, payload)
    seal_key = SealKey.generate()
    stored = decode_record(encode_record(record, seal_key), seal_key, key(1))  # seal and all
    def decode() -> None:
        with pytest.raises(CodecError, match="zstd"):
            decode_block(stored)

    _, peak = traced_peak(decode)
    assert peak < 4 * planes + (1 << 20)


@pytest.mark.parametrize("spec", LOSSLESS + LOSSY)
def test_random_corruption_never_raises_anything_else(spec):
    codec = get_codec(spec)
    payload = codec.encode(make_kv(dtype=torch.bfloat16))
    rng = np.random.default_rng(1)
    for _ in range(60):
        bad = bytearray(payload)
        for pos in rng.integers(0, len(bad), rng.integers(1, 4)):
            bad[pos] ^= 1 << int(rng.integers(0, 8))
        try:
            out = codec.decode(memoryview(bad), torch.bfloat16, SHAPE)
        except CodecError:
            continue
        assert out.dtype == torch.bfloat16 and tuple(out.shape) == SHAPE


def test_decode_does_not_alias_the_payload():
    kv = make_kv()
    buf = bytearray(get_codec("raw").encode(kv))
    out = get_codec("raw").decode(memoryview(buf), kv.dtype, SHAPE)
    buf[:] = bytes(len(buf))
    assert torch.equal(bits_of(out), bits_of(kv))


def test_zstd_is_safe_across_threads():
    codec = get_codec("zstd")
    blocks = [make_kv(dtype=torch.bfloat16, seed=i) for i in range(8)]
    failures = []

    def work(i: int) -> None:
        for _ in range(20):
            kv = blocks[(i + _) % len(blocks)]
            if not torch.equal(codec.decode(codec.encode(kv), kv.dtype, SHAPE), kv):
                failures.append(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


# --- records ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["raw", "zstd", "kivi4+zstd:3"])
def test_encode_block_decode_block_through_a_record(spec):
    kv = make_kv(dtype=torch.bfloat16)
    tokens = list(range(100, 116))
    record = encode_block(key(1), key(0).block_hash, tokens, kv, spec)
    assert record.codec == get_codec(spec).name and record.shape == SHAPE
    assert record.dtype == torch.bfloat16 and record.token_ids == tuple(tokens)
    seal_key = SealKey.generate()
    back = decode_record(encode_record(record, seal_key), seal_key, key(1))
    assert back.codec == record.codec and back.parent_hash == key(0).block_hash
    out = decode_block(back)
    expected = get_codec(spec).decode(record.payload, kv.dtype, SHAPE)
    assert torch.equal(bits_of(out), bits_of(expected))
    if get_codec(spec).lossless:
        assert torch.equal(bits_of(out), bits_of(kv))


def test_encode_block_takes_a_codec_object():
    kv = make_kv()
    record = encode_block(key(), None, range(16), kv, get_codec("zstd:1"))
    assert record.codec == "zstd" and record.parent_hash is None
    assert torch.equal(decode_block(record), kv)


def test_decode_block_unknown_codec_or_bad_payload():
    kv = make_kv()
    good = encode_block(key(), None, range(16), kv, "zstd")
    unknown = Record(key(), None, good.token_ids, "lz4", kv.dtype, SHAPE, good.payload)
    with pytest.raises(CodecError, match="lz4"):
        decode_block(unknown)
    truncated = Record(key(), None, good.token_ids, "zstd", kv.dtype, SHAPE, good.payload[:-3])
    with pytest.raises(CodecError):
        decode_block(truncated)


# --- stages: the tensor stage on the engine's device, the byte stage on the host -----------

@pytest.mark.parametrize("spec", LOSSLESS + LOSSY)
def test_pack_of_the_stage_payload_is_the_encoding(spec):
    """The CPU pool holds a block in its codec's tensor stage; a writer packs it, a reader
    unpacks into a slot: together they must be ``encode`` and ``decode``."""
    codec = get_codec(spec)
    kv = make_kv(dtype=torch.bfloat16, seed=3)
    staged = codec.stage.encode_array(kv).copy()
    payload = codec.pack(staged, kv.dtype, SHAPE)
    assert payload == codec.encode(kv)
    out = np.full(staged.size, 0xAB, dtype=np.uint8)
    codec.unpack_into(payload, kv.dtype, SHAPE, out)
    assert np.array_equal(out, staged)
    with pytest.raises(CodecError):
        codec.unpack_into(payload, kv.dtype, SHAPE, out[:-1])
    with pytest.raises(CodecError):
        codec.unpack_into(payload[:-1], kv.dtype, SHAPE, out)


@pytest.mark.parametrize("data", ["random bytes", "a constant"])
def test_a_zstd_pack_is_the_encoding_and_owns_its_bytes(data):
    """A writer's pack joins the planes by numpy (the GIL let go): the same bytes as
    ``encode``, stored planes or frames alike, none of them a view of the slot's bytes."""
    codec = get_codec("zstd")
    kv = make_kv(dtype=torch.bfloat16, seed=5)
    if data == "random bytes":  # no plane compresses: each is stored as it is
        kv.view(torch.uint8).random_(generator=torch.Generator().manual_seed(5))
    else:
        kv.fill_(1.5)
    staged = codec.stage.encode_array(kv).copy()
    payload = codec.pack(staged, kv.dtype, SHAPE)
    assert payload == codec.encode(kv)
    staged[:] = 0
    assert payload == codec.encode(kv)


@pytest.mark.parametrize("spec", ["raw", "kivi2", "kivi4"])
@pytest.mark.parametrize("shape", [SHAPE, (1, 2, 3, 1, 5)], ids=["block", "odd-payload"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn], ids=str)
def test_a_batch_of_blocks_encodes_like_each_block(spec, shape, dtype):
    codec = get_codec(spec)
    blocks = torch.stack([make_kv(shape, torch.float32, seed=s) for s in range(3)]).to(dtype)
    payloads = torch.empty(3, codec.payload_size(dtype, shape), dtype=torch.uint8)
    codec.encode_blocks(blocks, payloads)
    for i in range(3):
        assert np.array_equal(payloads[i].numpy(), codec.encode_array(blocks[i]))
    out = torch.empty_like(blocks)
    codec.decode_blocks(payloads, out)
    for i in range(3):
        expected = codec.decode(payloads[i].numpy().tobytes(), dtype, shape)
        assert torch.equal(bits_of(out[i]), bits_of(expected))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", ["raw", "kivi2", "kivi4"])
@pytest.mark.parametrize("shape", [SHAPE, (1, 2, 3, 1, 5)], ids=["block", "odd-payload"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn], ids=str)
def test_a_batch_encoded_on_the_gpu_is_the_hosts_encoding(spec, shape, dtype):
    """The block mover encodes and decodes on the engine's device (Triton for 16- and 32-bit
    KV, torch for fp8): the payloads and the decoded blocks are the host's, byte for byte."""
    codec = get_codec(spec)
    blocks = torch.stack([make_kv(shape, torch.float32, seed=s) for s in range(3)]).to(dtype)
    payloads = torch.empty(3, codec.payload_size(dtype, shape), dtype=torch.uint8, device="cuda")
    codec.encode_blocks(blocks.to("cuda"), payloads)
    for i in range(3):
        assert np.array_equal(payloads[i].cpu().numpy(), codec.encode_array(blocks[i]))
    out = torch.empty_like(blocks, device="cuda")
    codec.decode_blocks(payloads, out)
    host = torch.empty_like(blocks)
    codec.decode_blocks(payloads.cpu(), host)
    assert torch.equal(bits_of(out.cpu()), bits_of(host))


@pytest.mark.parametrize("spec", ["zstd", "kivi4+zstd"])
def test_a_run_packed_at_once_is_each_block_packed(spec):
    codec = get_codec(spec)
    shape, dtype = (2, 2, 16, 2, 64), torch.bfloat16
    size = codec.stage.payload_size(dtype, shape)
    staged = np.random.default_rng(0).integers(0, 256, size=(4, size), dtype=np.uint8)
    staged[1] = 0  # every plane compresses
    staged[2, 1::2] = 0x3F  # only the high bytes' plane does
    for row, packed in zip(staged, codec.pack_many(staged, dtype, shape), strict=True):
        assert bytes(packed) == bytes(codec.pack(row, dtype, shape))
