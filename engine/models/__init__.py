"""Models the engine runs, and how they are loaded.

``load_model("tiny")`` gives the built-in random model; ``load_model(folder)`` a Hugging
Face checkpoint folder of a Llama, Mistral, Qwen2/3, Phi-3 or Gemma 2/3 model (see
docs/models.md).
"""
from __future__ import annotations

from engine.models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from engine.models.llama import CausalLM
from engine.models.loader import LoadedModel, load_model
from engine.models.tiny import tiny_model_path, write_tiny_checkpoint
from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CausalLM",
    "IncrementalDetokenizer",
    "LoadedModel",
    "ModelConfig",
    "Tokenizer",
    "load_model",
    "tiny_model_path",
    "write_tiny_checkpoint",
]
