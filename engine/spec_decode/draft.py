"""The draft model: a smaller checkpoint with the target's vocabulary proposes ``k`` tokens
autoregressively.

Its KV lives in a pool of its own (:class:`DraftProposer`'s cache tensor, shaped by the
draft's config, and a :class:`BlockManager` without prefix caching, connector or events),
so draft blocks are never confused with the target's and never reach the KV tiers. Each
sequence has a :class:`DraftState`: its draft block table and how many of its tokens the
draft has computed. A proposal first catches the draft up on the sequence's new tokens
(the whole prompt the first time; then the target's last token, and the last draft if all
were accepted), then feeds its own drafts back one at a time::

    positions   0 ..... T-1 | T   T+1 ... T+k-1
    fed         tokens      | d1  d2 ... d(k-1)        (dk is proposed, not fed)

After verification the draft's KV is good up to the first draft that was not accepted;
the next proposal rolls ``num_computed_tokens`` back there (its slots are overwritten).
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.kv_cache import KVCacheSpec
from engine.model_runner import ModelRunner
from engine.models import LoadedModel
from engine.penalties import to_device
from engine.sampler import draw, filtered_probs
from engine.sequence import Sequence
from engine.spec_decode.speculator import Proposal


def draft_kv_spec(draft: LoadedModel, block_size: int) -> KVCacheSpec:
    mc = draft.config
    return KVCacheSpec(
        num_layers=mc.num_layers,
        block_size=block_size,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=draft.dtype,
    )


class DraftState:
    """What the draft pool holds for one sequence (what :class:`BlockManager` reads)."""

    __slots__ = ("block_table", "num_computed_tokens", "drafts_from", "fed_drafts")

    def __init__(self) -> None:
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose draft KV is in the pool
        self.drafts_from = 0  # position of the first draft fed last time
        self.fed_drafts: list[int] = []  # drafts fed last time, from drafts_from on

    def roll_back(self, token_ids: list[int]) -> None:
        """Keep the KV of the fed drafts the sequence accepted; the last token is always
        fed again (its logits give the first draft)."""
        matched = 0
        tail = token_ids[self.drafts_from : self.drafts_from + len(self.fed_drafts)]
        while matched < len(tail) and tail[matched] == self.fed_drafts[matched]:
            matched += 1
        computed = min(self.num_computed_tokens, self.drafts_from + matched)
        self.num_computed_tokens = min(computed, len(token_ids) - 1)
        self.drafts_from, self.fed_drafts = self.num_computed_tokens, []


class DraftProposer:
    """Runs the draft model over its own KV pool of ``num_blocks`` blocks."""

    def __init__(self, draft: LoadedModel, config: EngineConfig, num_blocks: int) -> None:
        spec = draft_kv_spec(draft, config.block_size)
        mc = draft.config
        self.runner = ModelRunner(draft.model, config, spec, (), mc.vocab_size)
        self.runner.init_kv_cache(num_blocks, None)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, enable_prefix_caching=False, kv_window=mc.kv_window
        )
        self.budget = config.max_num_batched_tokens
        self.states: dict[Sequence, DraftState] = {}

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.runner.kv_cache

    def keep_only(self, running: Seq[Sequence]) -> None:
        keep = set(running)
        for seq in [s for s in self.states if s not in keep]:
            self.block_manager.free(self.states.pop(seq))

    def close(self) -> None:
        self.states.clear()
        self.runner.free_kv_cache()

    @torch.inference_mode()
    def propose(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> list[Proposal]:
        proposals = [Proposal([], None)] * len(seqs)
        live: list[tuple[int, Sequence, DraftState, int]] = []
        for i, (seq, k) in enumerate(zip(seqs, num_tokens)):
            state = self.states.setdefault(seq, DraftState())
            state.roll_back(seq.token_ids)
            # KV for the tokens and the k-1 drafts fed back; short of blocks: no drafts
            if self.block_manager.allocate(state, seq.num_tokens + k - 1):
                live.append((i, seq, state, k))
        if not live:
            return proposals
        drafts: list[list[int]] = [[] for _ in live]
        probs: list[list[torch.Tensor]] = [[] for _ in live]
        logits = self._catch_up([(seq, state) for _, seq, state, _ in live])  # [len(live), V]
        rows = list(range(len(live)))
        for j in range(max(k for *_, k in live)):
            if j:
                rows = [r for r in rows if live[r][3] > j]
                logits = self.runner.forward_logits(
                    [live[r][1].token_ids + drafts[r] for r in rows],  # feeds drafts[r][-1]
                    [live[r][1].num_tokens + j - 1 for r in rows],
                    [1] * len(rows),
                    [live[r][2].block_table for r in rows],
                    [1] * len(rows),
                )
            for r, (token, q) in zip(rows, self._pick(logits, [live[r][1] for r in rows])):
                drafts[r].append(token)
                if q is not None:
                    probs[r].append(q)
        for r, (i, seq, state, k) in enumerate(live):
            state.drafts_from = seq.num_tokens
            state.fed_drafts = drafts[r][: k - 1]
            state.num_computed_tokens = seq.num_tokens + k - 1
            proposals[i] = Proposal(drafts[r], torch.stack(probs[r]) if probs[r] else None)
        return proposals

    def _catch_up(self, pending: list[tuple[Sequence, DraftState]]) -> torch.Tensor:
        """Feed each sequence's tokens the draft has not computed, in forwards of at most
        ``max_num_batched_tokens`` tokens; the logits after each one's last token."""
        out: list[torch.Tensor | None] = [None] * len(pending)
        todo = list(range(len(pending)))
        while todo:
            batch, budget = [], self.budget
            for i in todo:
                seq, state = pending[i]
                n = min(seq.num_tokens - state.num_computed_tokens, budget)
                if n <= 0:
                    break
                batch.append((i, n))
                budget -= n
            ends = [pending[i][1].num_computed_tokens + n == pending[i][0].num_tokens for i, n in batch]
            logits = self.runner.forward_logits(
                [pending[i][0].token_ids for i, _ in batch],
                [pending[i][1].num_computed_tokens for i, _ in batch],
                [n for _, n in batch],
                [pending[i][1].block_table for i, _ in batch],
                [int(end) for end in ends],
            )
            row = 0
            for (i, n), end in zip(batch, ends):
                pending[i][1].num_computed_tokens += n
                if end:
                    out[i] = logits[row]
                    row += 1
            todo = [i for i in todo if out[i] is None]
        return torch.stack(out)

    def _pick(
        self, logits: torch.Tensor, seqs: Seq[Sequence]
    ) -> list[tuple[int, torch.Tensor | None]]:
        """A draft token per row: the argmax for greedy requests, else a sample of the
        request's distribution under the draft (returned as ``q``)."""
        tokens = logits.argmax(dim=-1)  # [R]
        qs: list[torch.Tensor | None] = [None] * len(seqs)
        random = [r for r, seq in enumerate(seqs) if not seq.params.is_greedy]
        if random:
            index = to_device(random, torch.int64, logits.device)
            params = [seqs[r].params for r in random]
            probs = filtered_probs(logits.index_select(0, index), params)  # [S, V]
            tokens.index_copy_(0, index, draw(probs, [seqs[r].generator for r in random]))
            for j, r in enumerate(random):
                qs[r] = probs[j]
        return list(zip(tokens.tolist(), qs))  # the host sync of this draft position
