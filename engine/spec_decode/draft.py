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

The drafts never leave the device: position ``j``'s input ids are the ids sampled at
``j - 1``, and the positions, slots and block tables of all ``k`` positions are prepared on
the host before the first (they do not depend on the ids). The proposal hands the
verifier a ``[k]`` tensor, so a step's one host sync stays verification's.

After verification the draft's KV is good up to the first draft that was not accepted;
the next proposal rolls ``num_computed_tokens`` back there (its slots are overwritten).
The host never sees the drafts, so it counts them: of the tokens a sequence gained since
its proposal (the accepted drafts and the target's one), all but the last were drafts. A
count that is off (a step that never verified them) costs acceptance, never output:
verification checks every draft against the target.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.host_staging import to_device
from engine.kv_cache import KVCacheSpec
from engine.model_runner import BatchInputs, ModelRunner
from engine.models import LoadedModel
from engine.sampler import draw, filtered_probs, position_seed
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

    __slots__ = ("block_table", "num_computed_tokens", "drafts_from", "num_fed")

    def __init__(self) -> None:
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose draft KV is in the pool
        self.drafts_from = 0  # position of the first draft fed last time
        self.num_fed = 0  # drafts fed last time, from drafts_from on

    def roll_back(self, num_tokens: int) -> None:
        """Keep the KV of the fed drafts the sequence (now ``num_tokens`` long) accepted; the
        last token is always fed again (its logits give the first draft)::

            drafts_from
            | d1 .. da  t |          gained since the proposal: a accepted drafts, then t
        """
        accepted = min(max(num_tokens - self.drafts_from - 1, 0), self.num_fed)
        computed = min(self.num_computed_tokens, self.drafts_from + accepted)
        self.num_computed_tokens = min(computed, num_tokens - 1)
        self.drafts_from, self.num_fed = self.num_computed_tokens, 0


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
            state.roll_back(seq.num_tokens)
            # KV for the tokens and the k-1 drafts fed back; short of blocks: no drafts
            if self.block_manager.allocate(state, seq.num_tokens + k - 1):
                live.append((i, seq, state, k))
        if not live:
            return proposals
        feeds = self._feeds(live)
        device = self.runner.device
        width = len(feeds) + 1  # K, the most drafts of a row
        drafts = torch.empty(len(live), width, dtype=torch.int64, device=device)  # [R, K]
        probs: list[list[torch.Tensor]] = [[] for _ in live]
        logits = self._catch_up([(seq, state) for _, seq, state, _ in live])  # [R, V]
        rows = list(range(len(live)))
        index = torch.arange(len(live), device=device)
        for j in range(width):
            if j:
                rows, index, batch = feeds[j - 1]
                batch.input_ids = drafts[:, j - 1].index_select(0, index)  # [len(rows)]
                logits = self.runner.forward(batch)
            tokens, qs = self._pick(logits, [live[r][1] for r in rows], j)
            drafts[:, j].index_copy_(0, index, tokens)
            for r, q in zip(rows, qs):
                if q is not None:
                    probs[r].append(q)
        for r, (i, seq, state, k) in enumerate(live):
            state.drafts_from, state.num_fed = seq.num_tokens, k - 1
            state.num_computed_tokens = seq.num_tokens + k - 1
            proposals[i] = Proposal(drafts[r, :k], torch.stack(probs[r]) if probs[r] else None)
        return proposals

    def _feeds(
        self, live: list[tuple[int, Sequence, DraftState, int]]
    ) -> list[tuple[list[int], torch.Tensor, BatchInputs]]:
        """For each draft position ``j >= 1``: the rows that feed their draft ``j - 1`` back
        (those proposing more than ``j``), as a device index, and their batch, all but its
        input ids."""
        feeds = []
        for j in range(1, max(k for *_, k in live)):
            rows = [r for r, (*_, k) in enumerate(live) if k > j]
            batch = self.runner.prepare(
                None,
                [live[r][1].num_tokens + j - 1 for r in rows],
                [1] * len(rows),
                [live[r][2].block_table for r in rows],
                [1] * len(rows),
            )
            feeds.append((rows, to_device(rows, torch.int64, self.runner.device), batch))
        return feeds

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
        self, logits: torch.Tensor, seqs: Seq[Sequence], j: int
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Draft ``j`` of each row, on the device (``[R]``): the argmax for greedy requests,
        else a sample of the request's distribution under the draft (its ``q``); a seeded
        request's with the noise its target draws at that position, so that the draft is
        the target's own token wherever the two models' distributions are close."""
        tokens = logits.argmax(dim=-1)  # [R]
        qs: list[torch.Tensor | None] = [None] * len(seqs)
        random = [r for r, seq in enumerate(seqs) if not seq.params.is_greedy]
        if random:
            index = to_device(random, torch.int64, logits.device)
            params = [seqs[r].params for r in random]
            probs = filtered_probs(logits.index_select(0, index), params)  # [S, V]
            seeds = [
                None if seqs[r].params.seed is None
                else position_seed(seqs[r].params.seed, seqs[r].num_output_tokens + j)
                for r in random
            ]
            tokens.index_copy_(0, index, draw(probs, [seqs[r].generator for r in random], seeds))
            for j, r in enumerate(random):
                qs[r] = probs[j]
        return tokens, qs
