"""The Triton KIVI kernels against the torch reference, on the CPU under TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET when it is imported, so the kernels run in a subprocess with
the variable set; this module never imports triton itself and works in any test order.
"""
from __future__ import annotations

import json

import pytest

from interpreter_testing import run_interpreted


CASES = [
    # (bits, dtype, [L, 2, T, H, D], layout)
    (2, "float16", (2, 2, 16, 3, 32), "contiguous"),
    (4, "float16", (2, 2, 16, 3, 32), "contiguous"),
    (2, "bfloat16", (1, 2, 32, 2, 40), "contiguous"),  # value tail group of 8
    (4, "bfloat16", (1, 2, 32, 2, 40), "contiguous"),
    (2, "float16", (1, 2, 48, 2, 34), "strided"),  # key tail of 16, value tail of 2 codes
    (4, "bfloat16", (2, 2, 16, 2, 64), "strided"),
    (4, "float32", (1, 2, 16, 2, 32), "contiguous"),
    (2, "bfloat16", (1, 2, 16, 2, 32), "constant"),  # zero-range groups
    (2, "float16", (1, 2, 16, 2, 32), "nonfinite"),  # groups of SPECIAL_GROUPS
    (4, "float16", (1, 2, 48, 1, 34), "nonfinite"),
    (2, "bfloat16", (1, 2, 32, 2, 40), "nonfinite"),
    (4, "bfloat16", (1, 2, 16, 2, 32), "nonfinite"),
    (2, "float32", (1, 2, 16, 2, 40), "nonfinite"),
    (4, "float32", (1, 2, 32, 1, 32), "nonfinite"),
]

INF, NAN = float("inf"), float("nan")
# Element j of a group that a broken block can hold (non-finite values), or that is
# easy to get wrong (signed zeros, subnormals, values beyond fp16).
SPECIAL_GROUPS = [
    lambda j: INF,
    lambda j: -INF,
    lambda j: (INF, -INF)[j % 2],
    lambda j: INF if j == 3 else j - 5.0,
    lambda j: -INF if j == 3 else j - 5.0,
    lambda j: NAN if j % 7 == 3 else j - 5.0,
    lambda j: NAN,
    lambda j: (NAN, INF, -INF)[j % 3],
    lambda j: (NAN, -INF)[j % 2],
    lambda j: 0.0,
    lambda j: -0.0,
    lambda j: (0.0, -0.0)[j % 2],
    lambda j: (-0.0, 0.0)[j % 2],
    lambda j: j * 2.0**-24,  # fp16 subnormals
    lambda j: j * 2.0**-140,  # bf16 and fp32 subnormals, 0 in fp16
    lambda j: (7e4, -1e6, 1.0)[j % 3],  # beyond fp16 (inf in an fp16 block)
]

CHECK = r"""
import json, sys
import torch
from storage.codecs import kivi, kivi_triton
sys.path.insert(0, "tests")
from interpreter_testing import value_errors

from test_kivi_triton import (
    NAN_META_DTYPES, NAN_META_SHAPE, case_block, nan_meta_payload, same_but_nan_bits,
)

assert kivi_triton._interpreting(), "TRITON_INTERPRET=1 did not reach triton"
results = {}
for i, (bits, dtype, shape, layout) in enumerate(json.loads(sys.argv[1])):
    dtype, shape = getattr(torch, dtype), tuple(shape)
    kv = case_block(i)
    ref = kivi.quantize_block(kv, bits, backend="torch")
    tri = kivi.quantize_block(kv, bits, backend="triton")
    dec_ref = kivi.dequantize_block(ref, bits, dtype, shape, backend="torch")
    dec_tri = kivi.dequantize_block(tri, bits, dtype, shape, backend="triton")
    as_bytes = lambda t: t.contiguous().reshape(-1).view(torch.uint8)
    results[str(i)] = {
        "payload_equal": torch.equal(ref, tri),
        "payload_bytes_differing": int((ref != tri).sum()),
        "decoded_equal": torch.equal(as_bytes(dec_ref), as_bytes(dec_tri)),
        "decoded_dtype": str(dec_tri.dtype),
    }

batches = {}
for bits in (2, 4):  # a batch of blocks, as the block mover encodes them on the device
    g = torch.Generator().manual_seed(10 + bits)
    blocks = (torch.randn(3, 2, 2, 16, 2, 32, generator=g) * 2).to(torch.bfloat16)
    shape = tuple(blocks.shape[1:])
    payloads = torch.empty(3, kivi.kivi_layout(shape, bits).nbytes, dtype=torch.uint8)
    kivi.quantize_blocks(blocks, bits, payloads, backend="triton")
    ref = torch.stack([kivi.quantize_block(b, bits, backend="torch") for b in blocks])
    decoded = torch.empty_like(blocks)
    kivi.dequantize_blocks(payloads, bits, decoded, backend="triton")
    dec_ref = torch.stack(
        [kivi.dequantize_block(r, bits, torch.bfloat16, shape, backend="torch") for r in ref]
    )
    batches[str(bits)] = {
        "payload_equal": torch.equal(payloads, ref),
        "decoded_equal": torch.equal(decoded.view(torch.int16), dec_ref.view(torch.int16)),
    }

nan_meta = {}
for dtype in NAN_META_DTYPES:
    payload = nan_meta_payload(dtype)
    dtype = getattr(torch, dtype)
    ref = kivi.dequantize_block(payload, 2, dtype, NAN_META_SHAPE, backend="torch")
    tri = kivi.dequantize_block(payload, 2, dtype, NAN_META_SHAPE, backend="triton")
    nan_meta[str(dtype)] = same_but_nan_bits(ref, tri)

kv = torch.zeros(1, 2, 16, 2, 32, dtype=torch.float16)
lay = kivi.kivi_layout(tuple(kv.shape), 2)
out = lay.views(torch.empty(lay.meta_bytes + lay.code_bytes, dtype=torch.uint8))
calls = {
    "short_codes": lambda: kivi_triton.quantize_pack(
        kivi.value_rows(kv), 2, out.value_codes[..., :-1], out.value_scale, out.value_zero),
    "strided_scale": lambda: kivi_triton.quantize_pack(
        kivi.key_rows(kv), 2, out.key_codes,
        torch.empty(1, 32, 2, 1, dtype=torch.float16).transpose(1, 2), out.key_zero),
    "fp8_block": lambda: kivi_triton.quantize_pack(
        kivi.value_rows(kv.to(torch.float8_e4m3fn)), 2, out.value_codes, out.value_scale,
        out.value_zero),
    "three_bits": lambda: kivi_triton.unpack_dequantize(
        out.value_codes, out.value_scale, out.value_zero, 3, kivi.value_rows(kv)),
}
errors = value_errors(calls)
print(json.dumps({"results": results, "batches": batches, "nan_meta": nan_meta, "errors": errors}))
"""


def case_block(i: int):
    """The KV block of ``CASES[i]`` (on the CPU, in the case's layout)."""
    import torch

    _, dtype, shape, layout = CASES[i]
    g = torch.Generator().manual_seed(i)
    x = torch.randn(shape, generator=g) * 3
    x[:, 0, ..., :2] += 8
    if layout == "constant":
        x[:, :, :, 0] = 1.5
    if layout == "nonfinite":  # each key channel and value row one of SPECIAL_GROUPS
        _, _, T, H, D = shape
        x[:, 0] = special_rows(H * D, T).view(H, D, T).permute(2, 0, 1)
        x[:, 1] = special_rows(T * H, D).view(T, H, D)
    kv = x.to(getattr(torch, dtype))
    if layout == "strided":
        kv = kv.permute(4, 0, 1, 2, 3).contiguous().permute(1, 2, 3, 4, 0)
    return kv


def special_rows(count: int, n: int):
    """``count`` fp32 rows of ``n`` values: row ``i`` is group kind ``i`` of SPECIAL_GROUPS,
    cycling."""
    import torch

    kinds = [SPECIAL_GROUPS[i % len(SPECIAL_GROUPS)] for i in range(count)]
    return torch.tensor([[kind(j) for j in range(n)] for kind in kinds])


NAN_META_DTYPES = ["float16", "bfloat16", "float32"]
NAN_META_SHAPE = (1, 2, 16, 2, 40)


def nan_meta_payload(dtype: str):
    """A kivi2 payload of random bytes: scales and zeros of every bit pattern, as a corrupt
    record or one written by an older encoder from inf or NaN groups can hold them; plus
    NaNs with every payload bit set (as CUDA writes them) and infinities."""
    import torch

    from storage.codecs import kivi

    lay = kivi.kivi_layout(NAN_META_SHAPE, 2)
    g = torch.Generator().manual_seed(20 + NAN_META_DTYPES.index(dtype))
    payload = torch.randint(0, 256, (lay.nbytes,), dtype=torch.uint8, generator=g)
    special = torch.tensor([0x7FFF, -1, 0x7C00, -1024, 0x7E00], dtype=torch.int16)
    meta = lay.views(payload)
    for t in (meta.key_scale, meta.key_zero, meta.value_scale, meta.value_zero):
        t.view(torch.int16).view(-1)[: len(special)] = special
    return payload


def same_but_nan_bits(ref, out) -> dict:
    """Whether ``out`` is NaN where ``ref`` is and has ``ref``'s bits everywhere else."""
    import torch

    ref, out = ref.cpu(), out.cpu()
    as_int = {2: torch.int16, 4: torch.int32}[ref.dtype.itemsize]
    nan = ref.isnan()
    return {
        "nans": int(nan.sum()),
        "same_nans": torch.equal(nan, out.isnan()),
        "rest_equal": torch.equal(ref.view(as_int)[~nan], out.view(as_int)[~nan]),
    }


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return run_interpreted(CHECK, json.dumps(CASES))


def _case_id(case: tuple) -> str:
    bits, dtype, shape, layout = case
    return f"kivi{bits}-{dtype}-{'x'.join(map(str, shape))}-{layout}"


@pytest.mark.parametrize("case", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_triton_matches_torch(interpreted, case):
    result = interpreted["results"][str(case)]
    assert result["payload_equal"], f"{result['payload_bytes_differing']} payload bytes differ"
    assert result["decoded_equal"]
    assert result["decoded_dtype"] == f"torch.{CASES[case][1]}"


@pytest.mark.parametrize("bits", ["2", "4"])
def test_a_batch_of_blocks_matches_one_block_at_a_time(interpreted, bits):
    """``quantize_blocks`` runs the kernels once over the whole batch; every row must still
    be the block's own payload, and decoding the batch must give every block back."""
    assert interpreted["batches"][bits] == {"payload_equal": True, "decoded_equal": True}


@pytest.mark.parametrize("dtype", NAN_META_DTYPES)
def test_nan_or_inf_metadata_decodes_to_nan_on_both_paths(interpreted, dtype):
    """The encoder never writes a NaN or infinite scale or zero, but a record can hold one.
    Both paths then decode NaN at the same places (not -0 or inf: the bf16 store rounds
    with integer ops) and the same bits everywhere else."""
    result = interpreted["nan_meta"][f"torch.{dtype}"]
    assert result["nans"] > 0
    assert result["same_nans"] and result["rest_equal"]


@pytest.mark.parametrize(
    "call,message",
    [
        ("short_codes", "codes must be"),
        ("strided_scale", "must be contiguous"),
        ("fp8_block", "fp16, bf16 or fp32"),
        ("three_bits", "2 or 4 bits"),
    ],
)
def test_wrapper_rejects_bad_arguments(interpreted, call, message):
    error = interpreted["errors"][call]
    assert error is not None and message in error


@pytest.mark.cuda
@pytest.mark.parametrize("case", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_compiled_kernels_match_torch_on_the_gpu_and_the_cpu(case):
    """The kernels compiled for the GPU (not the interpreter) give the payload torch gives on
    the CPU and on the GPU, byte for byte, and decode it to the same tensor."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from storage.codecs import kivi

    bits, dtype, shape, _ = CASES[case]
    dtype, shape = getattr(torch, dtype), tuple(shape)
    kv = case_block(case)
    on_gpu = kv.to("cuda")  # keeps the strided layout
    assert on_gpu.stride() == kv.stride()
    ref = kivi.quantize_block(kv, bits, backend="torch")
    assert torch.equal(kivi.quantize_block(on_gpu, bits, backend="triton").cpu(), ref)
    assert torch.equal(kivi.quantize_block(on_gpu, bits, backend="torch").cpu(), ref)
    as_bytes = lambda t: t.cpu().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    decoded = as_bytes(kivi.dequantize_block(ref, bits, dtype, shape, backend="torch"))
    for backend in ("triton", "torch"):
        on_device = kivi.dequantize_block(ref.to("cuda"), bits, dtype, shape, backend=backend)
        assert torch.equal(as_bytes(on_device), decoded), backend


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", NAN_META_DTYPES)
def test_compiled_kernels_decode_nan_or_inf_metadata_like_torch(dtype):
    """On the GPU a NaN computed from a NaN scale or zero is 0x7FFFFFFF, which the bf16
    store's rounding would carry into -0: it must stay NaN, as on the CPU."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from storage.codecs import kivi

    payload = nan_meta_payload(dtype)
    dtype = getattr(torch, dtype)
    ref = kivi.dequantize_block(payload, 2, dtype, NAN_META_SHAPE, backend="torch")
    for backend in ("triton", "torch"):
        out = kivi.dequantize_block(payload.cuda(), 2, dtype, NAN_META_SHAPE, backend=backend)
        result = same_but_nan_bits(ref, out)
        assert result["nans"] > 0 and result["same_nans"] and result["rest_equal"], backend
