"""What several benchmarks share: the machine description and random Llama checkpoints."""
from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import torch


def machine(**extra: str) -> dict:
    """The CPU, core count and library versions, for a benchmark's JSON."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "cuda": torch.cuda.is_available(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        **extra,
    }


def write_random_llama(
    path: Path, config: dict, seed: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32
):
    """A random ``LlamaForCausalLM`` saved by ``transformers`` itself, plus the tiny model's
    byte-level tokenizer (with its chat template). Returns the ``transformers`` model.

    ``device``: where the weights are initialized (``cuda`` is much faster for large
    models); ``dtype``: the dtype they are saved in."""
    import transformers

    from engine.models.tiny import write_tiny_tokenizer

    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    model = model.to(dtype).eval()
    model.save_pretrained(path)
    write_tiny_tokenizer(path)
    return model


def write_json(path: Path, data: dict) -> None:
    """Write a benchmark's results (creating the folder) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"\nwrote {path}", file=sys.stderr)
