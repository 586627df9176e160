"""The engine's configuration: one frozen dataclass, validated on construction.

Fields left as ``None`` (``max_model_len``, ``max_num_batched_tokens``) depend on the model;
:meth:`EngineConfig.resolve` returns a copy with them filled in once the model is loaded.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from engine.kv_events import KVEventsConfig
from engine.spec_decode.config import SpeculativeConfig

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
KV_CACHE_DTYPES = ("auto", "fp8")
SCHEDULING_POLICIES = ("fcfs", "priority")
DEFAULT_MAX_MODEL_LEN = 4096
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How to run one model. Every field has the meaning (and mostly the name) vLLM gives it.

    ``kv_cache_dtype="fp8"`` stores K and V as float8 e4m3 with one scale per layer and per
    K/V, calibrated once at start-up (see :mod:`engine.kv_cache`); the scales are part of the
    KV namespace, so fp8 blocks never mix with blocks of other scales.
    """

    model: str = "tiny"
    tokenizer: str | None = None  # a folder to read the tokenizer from; None: the model's
    dtype: str | torch.dtype = "auto"
    device: str = "auto"
    block_size: int = 16
    max_model_len: int | None = None  # None: min(model's max positions, 4096)
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # None: 2048, or max_model_len without chunking
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    cpu_kv_cache_bytes: int = 256 * 2**20
    seed: int = 0
    enforce_eager: bool = False  # False: decode runs under CUDA graphs on a GPU
    # launch each decode forward a step ahead (engine/lookahead); None: on CUDA with graphs
    async_scheduling: bool | None = None
    scheduling_policy: str = "fcfs"  # or "priority", as in vLLM
    kv_events_config: KVEventsConfig | None = None  # publish KV events for routers
    # draft tokens verified in one forward (engine/spec_decode); a dict of vLLM's keys is parsed
    speculative_config: SpeculativeConfig | dict | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be 'tiny' or a checkpoint folder, got {self.model!r}")
        known = isinstance(self.dtype, torch.dtype) or self.dtype == "auto" or self.dtype in DTYPES
        if not known:
            raise ValueError(
                f"dtype must be 'auto', one of {', '.join(DTYPES)} or a torch dtype, "
                f"got {self.dtype!r}"
            )
        if isinstance(self.dtype, torch.dtype) and self.dtype not in DTYPES.values():
            raise ValueError(f"dtype {self.dtype} is not supported for weights")
        if not isinstance(self.device, str) or not _DEVICE.match(self.device):
            raise ValueError(
                f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}"
            )
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but CUDA is not available on this machine")
        _positive_int("block_size", self.block_size)
        if self.block_size & (self.block_size - 1) or self.block_size > 1024:
            raise ValueError(f"block_size must be a power of two up to 1024, got {self.block_size}")
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
            if self.max_model_len < 2:
                raise ValueError("max_model_len must be at least 2 (one prompt token, one output)")
        _positive_int("max_num_seqs", self.max_num_seqs)
        if self.max_num_batched_tokens is not None:
            _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _bool("enable_prefix_caching", self.enable_prefix_caching)
        _bool("enforce_eager", self.enforce_eager)
        if self.async_scheduling is not None:
            _bool("async_scheduling", self.async_scheduling)
        if self.kv_events_config is not None and not isinstance(self.kv_events_config, KVEventsConfig):
            raise ValueError(f"kv_events_config must be a KVEventsConfig, got {self.kv_events_config!r}")
        if isinstance(self.speculative_config, dict):
            object.__setattr__(
                self, "speculative_config", SpeculativeConfig.from_dict(self.speculative_config)
            )
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            raise ValueError(f"speculative_config must be a SpeculativeConfig or a dict, got {spec!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                f"got {self.scheduling_policy!r}"
            )
        _bool("enable_chunked_prefill", self.enable_chunked_prefill)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        util = self.gpu_memory_utilization
        if isinstance(util, bool) or not isinstance(util, (int, float)) or not 0 < util <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
        if self.num_gpu_blocks_override is not None:
            _positive_int("num_gpu_blocks_override", self.num_gpu_blocks_override)
        _positive_int("cpu_kv_cache_bytes", self.cpu_kv_cache_bytes)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def is_resolved(self) -> bool:
        return self.max_model_len is not None and self.max_num_batched_tokens is not None

    def resolve(self, max_position_embeddings: int) -> EngineConfig:
        """A copy with the model-dependent defaults filled in and checked against each other."""
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = min(max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
        elif max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} is larger than the model's "
                f"max_position_embeddings={max_position_embeddings}"
            )
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = (
                DEFAULT_MAX_NUM_BATCHED_TOKENS
                if self.enable_chunked_prefill
                else max(max_model_len, DEFAULT_MAX_NUM_BATCHED_TOKENS)
            )
        elif not self.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={budget} is smaller than max_model_len={max_model_len}: "
                "without chunked prefill a whole prompt must fit into one step; enable chunked "
                "prefill or lower max_model_len"
            )
        device = self.torch_device
        async_scheduling = self.async_scheduling
        if async_scheduling is None:
            async_scheduling = (
                device.type == "cuda" and not self.enforce_eager and self.speculative_config is None
            )
        elif async_scheduling and self.speculative_config is not None:
            raise ValueError("async_scheduling does not work with speculative decoding")
        return dataclasses.replace(
            self,
            max_model_len=max_model_len,
            max_num_batched_tokens=budget,
            device=str(device),
            async_scheduling=async_scheduling,
        )


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
