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
]

CHECK = r"""
import json, sys
import torch
from storage.codecs import kivi, kivi_triton
sys.path.insert(0, "tests")
from interpreter_testing import value_errors

from test_kivi_triton import case_block

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
print(json.dumps({"results": results, "batches": batches, "errors": errors}))
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
    kv = x.to(getattr(torch, dtype))
    if layout == "strided":
        kv = kv.permute(4, 0, 1, 2, 3).contiguous().permute(1, 2, 3, 4, 0)
    return kv


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
