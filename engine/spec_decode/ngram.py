"""Prompt lookup (vLLM's ``ngram`` method): the tokens that followed the latest earlier
occurrence of the sequence's last ``n`` tokens, for ``n`` from ``lookup_max`` down to
``lookup_min``::

    tokens:  ... a b c x y z ... a b c | ?      suffix "a b c" (n = 3) occurred earlier;
                       ^^^^^^^^           propose what followed it: x y z ...
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], lookup_min: int, lookup_max: int, k: int) -> list[int]:
    """Up to ``k`` tokens continuing ``token_ids`` by prompt lookup; ``[]`` when no suffix
    of ``lookup_min..lookup_max`` tokens occurs earlier."""
    num = len(token_ids)
    if k <= 0 or num <= lookup_min:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(lookup_max, num - 1), lookup_min - 1, -1):
        # windows starting at 0 .. num-n-1: every occurrence but the suffix itself
        windows = sliding_window_view(tokens[: num - 1], n)  # [num - n, n]
        hits = np.flatnonzero((windows == tokens[num - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return token_ids[start : start + k]
    return []
