"""vLLM's repetition, frequency and presence penalties, and the token counts they need.

For each row with penalties, over the vocabulary (vLLM's definitions):

- ``repetition_penalty`` r: a token of the prompt or of the output so far has its logit
  divided by r when positive and multiplied by r otherwise (r > 1 discourages repeats);
- ``frequency_penalty`` f: the logit loses f × (times the token was generated);
- ``presence_penalty`` p: the logit loses p once the token was generated at all.

A sequence that has penalties keeps a :class:`TokenCounts` on its device: a mask of its
prompt's tokens, built once, and a count of each generated token, bumped as tokens are
appended. A step stacks the rows' counts; nothing in it goes back to the host.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.host_staging import to_device


class TokenCounts:
    """Which tokens a sequence's prompt holds, and how often each was generated."""

    def __init__(self, prompt_token_ids: Sequence[int], vocab_size: int, device: torch.device) -> None:
        self.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [V]
        ids = [t for t in prompt_token_ids if 0 <= t < vocab_size]
        self.prompt_mask[to_device(ids, torch.int64, device)] = True
        self.output_counts = torch.zeros(vocab_size, dtype=torch.int32, device=device)  # [V]

    def add(self, token_id: int) -> None:
        """Count a generated token (one small kernel on a GPU, no sync)."""
        if 0 <= token_id < self.output_counts.shape[0]:
            self.output_counts[token_id] += 1


def apply_penalties(
    logits: torch.Tensor,
    counts: Sequence[TokenCounts],
    presence: Sequence[float],
    frequency: Sequence[float],
    repetition: Sequence[float],
) -> torch.Tensor:
    """``logits`` [R, V] with the penalties of each row applied (a new tensor)."""
    device, dtype = logits.device, logits.dtype
    prompt_mask = torch.stack([c.prompt_mask for c in counts])  # [R, V]
    output_counts = torch.stack([c.output_counts for c in counts]).to(dtype)  # [R, V]
    generated = output_counts > 0
    r = to_device(repetition, dtype, device)[:, None]  # [R, 1]
    factor = torch.where(prompt_mask | generated, r, torch.ones_like(r))
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    logits = logits - to_device(frequency, dtype, device)[:, None] * output_counts
    return logits - to_device(presence, dtype, device)[:, None] * generated.to(dtype)

