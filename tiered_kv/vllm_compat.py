"""What ``vllm serve`` takes that ``tiered-kv serve`` does not take as it is.

The supported flags are the settings of :class:`~tiered_kv.serve_config.ServeConfig`; this
module lists the rest that vLLM scripts commonly pass: flags accepted and ignored (logged
once at start), flags refused (one line naming the reason, exit 2), and the request fields
that are read but refused. docs/compatibility.md is generated from these lists and the models.
"""
from __future__ import annotations

from typing import Any, NamedTuple


class IgnoredFlag(NamedTuple):
    takes_value: bool  # False: a switch (--x / --no-x)
    reason: str


IGNORED_FLAGS: dict[str, IgnoredFlag] = {
    "--trust-remote-code": IgnoredFlag(False, "only built-in architectures run; no code from a checkpoint is executed"),
    "--disable-log-requests": IgnoredFlag(False, "requests are never logged"),
    "--enable-log-requests": IgnoredFlag(False, "requests are never logged"),
    "--disable-log-stats": IgnoredFlag(False, "statistics are served on /metrics, never logged"),
    "--max-log-len": IgnoredFlag(True, "requests are never logged"),
    "--swap-space": IgnoredFlag(True, "there is no swap space: a preempted request is recomputed, mostly from the KV tiers"),
    "--distributed-executor-backend": IgnoredFlag(True, "one process runs one device"),
    "--disable-frontend-multiprocessing": IgnoredFlag(False, "the server and the engine share one process"),
    "--load-format": IgnoredFlag(True, "weights are always read from safetensors"),
    "--uvicorn-log-level": IgnoredFlag(True, "--log-level sets uvicorn's level too"),
    "--max-seq-len-to-capture": IgnoredFlag(True, "decode CUDA graphs cover every sequence length"),
    "--guided-decoding-backend": IgnoredFlag(True, "structured output has one built-in backend"),
    "--structured-outputs-config": IgnoredFlag(True, "structured output has one built-in backend"),
}

REFUSED_FLAGS: dict[str, str] = {
    "--quantization": "quantized checkpoints are not supported (float32, float16, bfloat16 weights)",
    "-q": "quantized checkpoints are not supported (float32, float16, bfloat16 weights)",
    "--enable-lora": "LoRA adapters are not supported",
    "--lora-modules": "LoRA adapters are not supported",
    "--enable-auto-tool-choice": "tool calling is not supported (requests with tools get 400)",
    "--tool-call-parser": "tool calling is not supported (requests with tools get 400)",
    "--reasoning-parser": "reasoning output is not parsed",
    "--data-parallel-size": "one engine per server: run several servers behind a load balancer (they share KV through --kv-remote-url)",
    "-dp": "one engine per server: run several servers behind a load balancer (they share KV through --kv-remote-url)",
    "--cpu-offload-gb": "weights are not offloaded; KV is, with --kv-offloading-size and --kv-disk-size",
    "--kv-transfer-config": "the KV tiers are built in: --kv-offloading-size, --kv-disk-size, --kv-remote-url",
    "--kv-cache-memory-bytes": "size the KV pool with --gpu-memory-utilization or --num-gpu-blocks-override (--cpu-kv-cache-bytes without a GPU)",
    "--ssl-keyfile": "TLS is not served: terminate it at a reverse proxy",
    "--ssl-certfile": "TLS is not served: terminate it at a reverse proxy",
    "--rope-scaling": "the model's config.json is used as it is",
    "--hf-overrides": "the model's config.json is used as it is",
    "--limit-mm-per-prompt": "only text models are served",
    "--runner": "only text generation is served",
    "--task": "only text generation is served",
    "--enable-sleep-mode": "sleep mode is not supported",
    "--api-server-count": "one API server process per engine",
    "--compilation-config": "there are no compilation settings: decode runs under CUDA graphs unless --enforce-eager",
    "-O": "there are no compilation settings: decode runs under CUDA graphs unless --enforce-eager",
}


class RefusedField(NamedTuple):
    reason: str
    example: Any  # a value that is refused, for the test that keeps this list true


# Request fields the schema (tiered_kv/protocol_requests.py) reads but refuses (400 naming the field),
# by route; every other field it reads is supported.
REFUSED_REQUEST_FIELDS: dict[str, dict[str, RefusedField]] = {
    "completions": {
        "suffix": RefusedField("insertion (a suffix) is not supported", "tail"),
    },
    "chat": {
        "tools": RefusedField("tool calling is not supported", [{"type": "function", "function": {"name": "f"}}]),
        "tool_choice": RefusedField("tool calling is not supported: only `\"none\"` is taken", "auto"),
    },
}

# Fields OpenAI or vLLM define that clients commonly send; docs/compatibility.md says what
# becomes of those the schema does not read (refused or ignored, as the schema treats
# unknown fields).
UPSTREAM_REQUEST_FIELDS: dict[str, tuple[str, ...]] = {
    "completions": (
        "prompt", "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
        "stop", "stop_token_ids", "n", "best_of", "stream", "stream_options", "logprobs",
        "echo", "suffix", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "logit_bias", "user", "min_tokens", "ignore_eos", "skip_special_tokens",
        "include_stop_str_in_output", "prompt_logprobs", "priority", "cache_salt",
        "guided_json", "guided_regex", "guided_choice", "structured_outputs",
        "add_special_tokens", "truncate_prompt_tokens",
    ),
    "chat": (
        "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p",
        "top_k", "min_p", "seed", "stop", "stop_token_ids", "n", "stream", "stream_options",
        "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "logit_bias", "user", "min_tokens", "ignore_eos", "tools",
        "tool_choice", "parallel_tool_calls", "response_format", "reasoning_effort",
        "chat_template", "chat_template_kwargs", "add_generation_prompt",
        "continue_final_message", "skip_special_tokens", "priority", "cache_salt",
        "guided_json", "structured_outputs", "add_special_tokens", "truncate_prompt_tokens",
        "prompt_logprobs",
    ),
}
