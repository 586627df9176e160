"""What the Triton kernels' wrappers share: the dtypes they take, the interpreter (detection
and a backport for Triton 3.6), and the checks of their arguments."""
from __future__ import annotations

import torch
import triton

MAX_HEAD_DIM = 256
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)

# fp8 formats, as the kernels name them: (id, mantissa bits, exponent bias).
# An e4m3fn byte is decoded to an fp16 that is 2**-8 times its value, an e5m2 byte to its
# own value; FP8_FACTOR undoes that.
FP8_FORMATS = {torch.float8_e4m3fn: (1, 3, 7), torch.float8_e5m2: (2, 2, 15)}
FP8_FACTOR = {torch.float8_e4m3fn: 256.0, torch.float8_e5m2: 1.0}
TRITON_VERSION = tuple(int(p) for p in triton.__version__.split(".")[:2])


def interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def backport_interpreter_index() -> None:
    """Let Triton 3.6's interpreter take a loop bound computed at run time, under NumPy 2.4.

    Its scalars are NumPy arrays of shape [1], and ``range(lo, hi)`` in a kernel converts
    them with ``int(array)``, which NumPy 2.4 rejects for ndim > 0. Triton 3.7 squeezes the
    array first (triton-lang/triton#9171); this installs that line on older versions. The
    compiled kernels are not affected.
    """
    if TRITON_VERSION >= (3, 7) or not interpreting():
        return
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor
    if getattr(patch_tensor, "squeezes_index", False):
        return

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes_index = True
    interpreter._patch_lang_tensor = patched


def check_device(t: torch.Tensor, name: str, device: torch.device) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def check_kernel_device(t: torch.Tensor, name: str) -> None:
    if not (t.is_cuda or interpreting()):
        raise ValueError(f"{name} must be on a CUDA device (or run under TRITON_INTERPRET=1)")


def check_cache(layer_cache: torch.Tensor, device: torch.device) -> None:
    if layer_cache.dim() != 5 or layer_cache.shape[0] != 2:
        raise ValueError(
            "layer_cache must be [2, num_blocks, block_size, kv_heads, head_dim], "
            f"got {list(layer_cache.shape)}"
        )
    # blocks may lie anywhere (a layer's view of a block-major cache); within one, the
    # kernels need [block_size, kv_heads, head_dim] dense
    if not layer_cache[0, :1].is_contiguous():
        raise ValueError(
            "each block of layer_cache must be contiguous [block_size, kv_heads, head_dim], "
            f"got strides {list(layer_cache.stride())}"
        )
    check_device(layer_cache, "layer_cache", device)


def check_index(t: torch.Tensor, name: str, shape: tuple[int, ...], device: torch.device) -> None:
    if t.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(t.shape)}")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim")
    check_device(t, name, device)


def pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()
