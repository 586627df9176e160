"""An engine's model side, set up once: the model runner, the KV pool it is sized for, the
decode graphs, and the namespace that the pool's content hashes are keyed in.

The order matters: a draft model's KV and the peak memory of a step are known before the
pool is sized from what is left, and fp8 scales are calibrated before the namespace is
derived from them (a stored block is only valid under the scales it was written with).
"""
from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from engine import startup_probes
from engine.config import EngineConfig
from engine.hashing import KVNamespace
from engine.kv_cache import FP8_CALIBRATION_TEXT, KVCacheSpec, kv_cache_dtype, num_pool_blocks
from engine.model_runner import ModelRunner
from engine.models import LoadedModel, load_model
from engine.prefill_cost import PrefillCost
from engine.spec_decode.draft import draft_kv_spec

logger = logging.getLogger(__name__)


class RunnerSetup(NamedTuple):
    runner: ModelRunner
    kv_cache: torch.Tensor
    num_blocks: int
    namespace: bytes  # the digest of everything a stored block's bytes depend on
    draft: LoadedModel | None  # the draft model of ``speculative_config``
    prefill_cost: PrefillCost | None  # measured on CUDA with a connector (engine.scheduler)


def set_up_runner(config: EngineConfig, model: LoadedModel, with_connector: bool) -> RunnerSetup:
    """The runner for ``model`` under a resolved ``config``, its KV pool allocated and, on
    CUDA unless ``enforce_eager``, its decode graphs captured."""
    mc = model.config
    device = torch.device(config.device)
    spec = KVCacheSpec(
        num_layers=mc.num_layers,
        block_size=config.block_size,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=kv_cache_dtype(config.kv_cache_dtype, model.dtype),
    )
    runner = ModelRunner(model.model, config, spec, tuple(model.tokenizer.eos_token_ids), mc.vocab_size)
    draft = load_draft(config, model)
    kv_scales = None
    if config.kv_cache_dtype == "fp8":
        calibration = model.tokenizer.encode(FP8_CALIBRATION_TEXT)
        limit = min(config.max_model_len - 1, config.max_num_batched_tokens)
        kv_scales = startup_probes.calibrate_fp8_scales(runner, calibration[:limit])
    draft_bytes = draft_kv_spec(draft, config.block_size).bytes_per_block if draft else 0
    # what a prefill costs sizes the head an overlapped load recomputes (engine.scheduler)
    prefill_cost = None
    if device.type == "cuda" and with_connector:
        prefill_cost = startup_probes.time_prefill(runner, kv_scales)
        logger.info("prefill step: %.2f ms + %.2f us a token + %.3f ns a token per token "
                    "before it", prefill_cost.fixed_s * 1e3, prefill_cost.per_token_s * 1e6,
                    prefill_cost.per_token_context_s * 1e9)

    def peak_memory() -> int:  # of a step, measured only if the pool is sized from it
        return startup_probes.profile_peak_memory(runner, kv_scales)

    num_blocks = num_pool_blocks(config, spec, peak_memory, draft_bytes)
    kv_cache = runner.init_kv_cache(num_blocks, kv_scales)
    if device.type == "cuda" and not config.enforce_eager:
        graphs = runner.enable_decode_graphs(capture=True)
        logger.info(
            "captured %d decode graphs (batch 1..%d) in %.1f s",
            len(graphs.buckets), graphs.max_batch, graphs.capture_seconds,
        )
    namespace = KVNamespace(
        model_fingerprint=model.fingerprint,
        kv_dtype=str(spec.dtype).removeprefix("torch."),
        kv_scales=tuple((s.k, s.v) for s in kv_scales or ()),
        block_size=config.block_size,
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
    ).digest()
    return RunnerSetup(runner, kv_cache, num_blocks, namespace, draft, prefill_cost)


def load_draft(config: EngineConfig, target: LoadedModel) -> LoadedModel | None:
    """The draft model of ``speculative_config``, in the target's dtype, checked against it."""
    spec = config.speculative_config
    if spec is None or spec.resolved_method != "draft_model":
        return None
    draft = load_model(spec.model, dtype=target.dtype, device=torch.device(config.device))
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"the draft model's vocabulary ({draft.config.vocab_size} tokens) is not the "
            f"target's ({target.config.vocab_size}): they must share the tokenizer"
        )
    if draft.config.max_position_embeddings < config.max_model_len:
        raise ValueError(
            f"the draft model's max_position_embeddings={draft.config.max_position_embeddings}"
            f" is shorter than max_model_len={config.max_model_len}"
        )
    return draft
