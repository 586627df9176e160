"""``raw``: the tensor's bytes exactly as they are in memory (contiguous, little-endian)."""
from __future__ import annotations

import math

import numpy as np
import torch

from storage.codecs.base import CodecError, Section, TensorCodec, check_kv_dtype, check_shape


class RawCodec(TensorCodec):
    name = "raw"
    lossless = True

    def layout(self, dtype: torch.dtype, shape: tuple[int, ...]) -> list[Section]:
        check_kv_dtype(dtype, self.name, CodecError)
        check_shape(shape, self.name, CodecError)
        itemsize = dtype.itemsize
        return [Section(math.prod(shape) * itemsize, itemsize)]

    def encode_array(self, kv: torch.Tensor) -> np.ndarray:
        check_kv_dtype(kv.dtype, self.name)
        flat = kv.detach().contiguous().cpu().reshape(-1)
        return flat.view(torch.uint8).numpy()

    def encode_blocks(self, blocks: torch.Tensor, out: torch.Tensor) -> None:
        check_kv_dtype(blocks.dtype, self.name)
        out.copy_(blocks.reshape(blocks.shape[0], -1).view(torch.uint8))

    def decode_blocks(self, payloads: torch.Tensor, out: torch.Tensor) -> None:
        if not out.is_contiguous():
            raise ValueError("decode_blocks writes into a contiguous batch")
        out.view(out.shape[0], -1).view(torch.uint8).copy_(payloads)

    def decode_array(
        self, buf: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...], device: torch.device | str
    ) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype)
        out.reshape(-1).view(torch.uint8).numpy()[:] = buf
        return out.to(device)
