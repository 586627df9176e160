"""Speculative decoding: draft tokens proposed cheaply, verified by the target in one forward.

- :mod:`~engine.spec_decode.config`: ``SpeculativeConfig`` (vLLM's ``speculative_config``);
- :mod:`~engine.spec_decode.ngram`: prompt-lookup proposals;
- :mod:`~engine.spec_decode.draft`: a draft model with its own KV pool;
- :mod:`~engine.spec_decode.rejection`: greedy and rejection-sampling verification;
- :mod:`~engine.spec_decode.speculator`: who gets drafts, and the acceptance counters.

See docs/engine.md, "Speculative decoding".
"""
from engine.spec_decode.config import SpeculativeConfig

__all__ = ["SpeculativeConfig"]
