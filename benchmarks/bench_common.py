"""What several benchmarks share: the machine description, random Llama checkpoints and the
time to first token of one request."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.config import DTYPES
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.llm import LLM

BLOCK = 16  # the engine's default block size
ONE = SamplingParams(temperature=0.0, max_tokens=1)  # greedy, TTFT only


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


@dataclasses.dataclass(frozen=True)
class Shape:
    """A random Llama's dimensions (the benchmarks' model shapes)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype: str

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.layers, 2, BLOCK, self.kv_heads, self.head_dim)  # [L, 2, T, H, D]

    @property
    def block_nbytes(self) -> int:
        return math.prod(self.block_shape) * DTYPES[self.dtype].itemsize

    def llama_config(self, max_len: int) -> dict:
        return dict(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
            num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
            max_position_embeddings=max(4096, max_len), rms_norm_eps=1e-5,
            bos_token_id=256, eos_token_id=257,
        )


SHAPES = {
    "tiny": Shape(256, 4, 8, 4, 32, 688, 1024, "float32"),
    "1b": Shape(2048, 16, 32, 8, 64, 8192, 32000, "bfloat16"),
    "8b": Shape(4096, 32, 32, 8, 128, 14336, 32000, "bfloat16"),
}


def write_random_llama(
    path: Path, config: dict, seed: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32
):
    """A random ``LlamaForCausalLM`` saved by ``transformers`` itself, plus the tiny model's
    byte-level tokenizer (with its chat template), extended to the model's vocabulary with
    one added token per id past its own (``<t300>``...): a random model samples ids from
    the whole vocabulary, and an id the tokenizer did not know would decode to nothing,
    leaving the engine's detokenizer to decode an ever longer window each step.
    Returns the ``transformers`` model.

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
    cover_vocabulary(path / "tokenizer.json", config["vocab_size"])
    return model


def cover_vocabulary(tokenizer_json: Path, vocab_size: int) -> None:
    """Add a token for each id from the tokenizer's size up to ``vocab_size``."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    known = tokenizer.get_vocab_size()
    if known < vocab_size:
        tokenizer.add_tokens([f"<t{i}>" for i in range(known, vocab_size)])
        tokenizer.save(str(tokenizer_json))


def timed(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """Seconds to generate one token for ``prompt`` (its TTFT), and its cached tokens."""
    start = time.perf_counter()
    out = llm.generate(prompt, ONE)[0]
    return time.perf_counter() - start, out.num_cached_tokens


def write_json(path: Path, data: dict, *, quiet: bool = False) -> None:
    """Write a benchmark's results (creating the folder; replacing the file in one rename, so
    a run killed meanwhile leaves the last complete write) and, unless ``quiet``, say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    if not quiet:
        print(f"\nwrote {path}", file=sys.stderr)
