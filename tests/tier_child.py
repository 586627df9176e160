"""A process that serves prompts through an LLM with tiers, for the persistence tests.

    python tests/tier_child.py '{"cache_dir": ..., "prompts": [[ids...], ...], ...}'

Options (JSON): ``cache_dir``, ``prompts`` (token-id lists, run one at a time, greedy),
``codec`` (raw), ``cpu_bytes`` (0), ``max_tokens`` (8), ``sync`` (true),
``traffic`` (false: print one JSON line per finished request instead of one at the end,
and a ``ready`` line first; used by the crash test, which kills this process).
"""
from __future__ import annotations

import json
import sys

import torch

from engine import SamplingParams
from tiered_kv import TierConfig, build_llm

MAX_MODEL_LEN = 512


def main() -> None:
    args = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    config = TierConfig(
        kv_cache_dir=args["cache_dir"],
        cpu_bytes=args.get("cpu_bytes", 0),
        disk_bytes=64 << 20,
        codec=args.get("codec", "raw"),
        sync=args.get("sync", True),
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.get("max_tokens", 8), ignore_eos=True)
    traffic = args.get("traffic", False)
    with build_llm("tiny", config, max_model_len=MAX_MODEL_LEN, device="cpu") as llm:
        manager = llm.engine.connector
        if traffic:
            _line({"ready": True, "namespace": manager.namespace.hex()})
        outputs = []
        for prompt in args["prompts"]:
            out = llm.generate(prompt, params)[0]
            outputs.append({"token_ids": out.token_ids, "cached": out.num_cached_tokens})
            if traffic:
                _line({"done": len(outputs)})
        result = {
            "outputs": outputs,
            "stats": manager.stats(),
            "engine": {
                "connector_hits": llm.engine.stats().connector_hits,
                "connector_load_failures": llm.engine.stats().connector_load_failures,
            },
            "namespace": manager.namespace.hex(),
        }
    _line(result)


def _line(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
