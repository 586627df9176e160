"""Runs one scheduled step on the model: inputs, attention metadata, forward, logits, sampling."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence as Seq

import numpy as np
import torch

from engine import prompt_logprobs
from engine.attention import AttentionMetadata, KVScales
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs
from engine.decode_inputs import DecodeInputs
from engine.kv_cache import KVCacheSpec
from engine.host_staging import to_device, upload
from engine.lookahead import Lookahead
from engine.sampler import Sample, SampleError, Sampler, SamplingRow
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence
from engine.spec_decode.rejection import VerifyRow, verifiable, verify_step
from engine.spec_decode.speculator import place_drafts

StepResult = list[Sample] | SampleError | None


@dataclasses.dataclass
class BatchInputs:
    """The flattened inputs of one forward: ``N`` tokens from ``B`` sequences."""

    input_ids: torch.Tensor | None  # [N] int64; None: the caller sets them (ids on the device)
    positions: torch.Tensor  # [N] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [M] rows of the hidden states whose logits are wanted


class ModelRunner:
    """Owns the model and the KV cache tensor; one :meth:`run` per engine step."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig,
        spec: KVCacheSpec,
        eos_token_ids: Seq[int],
        vocab_size: int,
    ) -> None:
        self.model = model
        self.config = config
        self.spec = spec
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.eos_token_ids = tuple(t for t in eos_token_ids if 0 <= t < vocab_size)
        self.vocab_size = vocab_size
        self.sampler = Sampler()
        self.kv_cache: torch.Tensor | None = None  # [num_blocks, L, 2, block_size, H, D]
        self._full_cache: torch.Tensor | None = None  # kv_cache and the scratch block after it
        self.kv_scales: list[KVScales] | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self._decode_inputs: DecodeInputs | None = None  # with the decode graphs
        self.lookahead: Lookahead | None = None  # the decode forward launched a step ahead
        self.num_lookahead_used = 0  # steps that took the forward launched for them
        self.num_lookahead_wasted = 0  # launched forwards no step took

    def init_kv_cache(self, num_blocks: int, kv_scales: list[KVScales] | None) -> torch.Tensor:
        """Allocate the pool's ``num_blocks`` blocks (returned) and one scratch block after
        them, which only the padding rows of decode graphs write."""
        self._full_cache = self.spec.allocate(num_blocks + 1, self.device)  # [num_blocks+1, L, 2, T, H, D]
        self.kv_cache = self._full_cache[:num_blocks]
        self.kv_scales = kv_scales
        return self.kv_cache

    def enable_decode_graphs(self, capture: bool) -> DecodeGraphs:
        """Run decode-only steps of up to ``max_num_seqs`` sequences from static buffers, and
        with ``capture`` (CUDA only) replay them as CUDA graphs, captured here."""
        if self._full_cache is None:
            raise RuntimeError("init_kv_cache() must be called before enable_decode_graphs()")
        model, scales = self.model, self.kv_scales
        self.decode_graphs = DecodeGraphs(
            lambda ids, pos, cache, meta: model(ids, pos, cache, meta, scales),
            self._full_cache,
            max_num_seqs=self.config.max_num_seqs,
            max_model_len=self.config.max_model_len,
            block_size=self.block_size,
            scratch_block=self._full_cache.shape[0] - 1,
            capture=capture,
        )
        max_blocks = -(-self.config.max_model_len // self.block_size)
        self._decode_inputs = DecodeInputs(self.decode_graphs.max_batch, max_blocks, self.block_size)
        with torch.inference_mode():
            self.decode_graphs.capture_all()
        return self.decode_graphs

    def free_kv_cache(self) -> None:
        """Drop the KV cache and the decode graphs and, on CUDA, return their memory to the
        device (the caching allocator would otherwise keep it from the next engine in this
        process). Whoever else held a view of the cache must have dropped it first."""
        self.drop_lookahead()
        self.decode_graphs = self._decode_inputs = None
        self.kv_cache = None
        self._full_cache = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def run(self, output: SchedulerOutput, ahead: Seq[Sequence] = ()) -> list[StepResult]:
        """Forward the step; for each scheduled sequence that completes its tokens the tokens
        to append (one sample, or with draft tokens those that verification accepted and
        the target's next; :mod:`engine.spec_decode`), or the error sampling raised.

        ``ahead``: sequences of this decode step whose next forward to launch before the
        step's tokens reach the host (:mod:`engine.lookahead`); each has a block for it."""
        if self.kv_cache is None:
            raise RuntimeError("init_kv_cache() must be called before run()")
        items = output.scheduled
        launched, self.lookahead = self.lookahead, None
        rows = launched.rows_for(items) if launched is not None else None
        if rows is not None:
            self.num_lookahead_used += 1
            logits = launched.logits
            if rows != list(range(len(launched.seqs))):
                logits = logits.index_select(0, to_device(rows, torch.int64, logits.device))
            return self._sample_decode(items, logits, ahead)
        if launched is not None:  # wasted: wait for it, its blocks are given back after run()
            self.num_lookahead_wasted += 1
            launched.wait()
        num_logits = [_num_logits(seq, n) for seq, n in items]
        prompt_rows = [prompt_logprobs.rows_this_step(seq, n) for seq, n in items]
        if any(prompt_rows):
            logits = self._forward_with_prompt_logprobs(output, num_logits, prompt_rows)
            return self._sample(items, num_logits, logits)
        graphs = self.decode_graphs
        decode = all(n == 1 and m == 1 for (_, n), m in zip(items, num_logits))
        if graphs is not None and len(items) <= graphs.max_batch and decode:
            rows = self._decode_inputs.build([seq for seq, _ in items], ahead=False)
            hidden = graphs.run(rows.input_ids, rows.positions, rows.slots, rows.tables)
            return self._sample_decode(items, self.model.compute_logits(hidden), ahead)
        if ahead and decode:
            return self._sample_decode(items, self.forward(self._step_inputs(output, num_logits)), ahead)
        logits = self.forward(self._step_inputs(output, num_logits))  # [sum(num_logits), vocab]
        return self._sample(items, num_logits, logits)

    def _sample(
        self, items: Seq[ScheduledSequence], num_logits: Seq[int], logits: torch.Tensor
    ) -> list[StepResult]:
        """Sample, or verify drafts, from ``logits``: the last ``num_logits[b]`` positions
        of each scheduled sequence ``b``, in order."""
        results: list[StepResult] = [None] * len(items)
        offsets = np.cumsum([0, *num_logits])
        # With drafts in the step, verification also samples the plain rows it can: their
        # tokens then come back with the accepted ones, in one host sync.
        verified: list[int] = []
        if any(m and len(items[i].seq.spec_token_ids) for i, m in enumerate(num_logits)):
            verified = [
                i for i, m in enumerate(num_logits)
                if m and (len(items[i].seq.spec_token_ids) or verifiable(items[i].seq))
            ]
        taken = set(verified)
        plain = [i for i, m in enumerate(num_logits) if m == 1 and i not in taken]
        if verified:
            rows = [_verify_row(items[i].seq, int(offsets[i])) for i in verified]
            for i, tokens in zip(verified, verify_step(logits, rows)):
                results[i] = tokens
        if plain:
            # staged in pinned memory: a pageable copy would wait for the queued forward
            index = to_device(offsets[plain].tolist(), torch.int64, logits.device)
            rows = [self._sampling_row(items[i].seq) for i in plain]
            for i, sample in zip(plain, self.sampler(logits.index_select(0, index), rows)):
                results[i] = _as_result(sample)
        return results

    @torch.inference_mode()
    def forward_logits(
        self,
        token_ids: Seq[Seq[int]],
        starts: Seq[int],
        query_lens: Seq[int],
        block_tables: Seq[Seq[int]],
        num_logits: Seq[int],
    ) -> torch.Tensor:
        """One eager forward over the paged cache; the logits of the last ``num_logits[b]``
        positions of each sequence ``b``, in order: ``[sum(num_logits), vocab]`` float32."""
        return self.forward(self.prepare(token_ids, starts, query_lens, block_tables, num_logits))

    @torch.inference_mode()
    def forward(self, batch: BatchInputs) -> torch.Tensor:
        """One eager forward of a prepared batch (its ``input_ids`` set): the logits of its
        ``logits_indices``, ``[M, vocab]`` float32."""
        return self.model.compute_logits(self._hidden(batch))

    def _hidden(self, batch: BatchInputs) -> torch.Tensor:
        """One eager forward: the final hidden states of the batch's ``logits_indices``."""
        hidden = self.model(
            batch.input_ids, batch.positions, self.kv_cache, batch.meta, self.kv_scales
        )
        return hidden[batch.logits_indices]

    def _forward_with_prompt_logprobs(
        self, output: SchedulerOutput, num_logits: list[int], prompt_rows: Seq[int]
    ) -> torch.Tensor:
        """A step in which sequences compute prompt logprobs (``prompt_rows[b]`` positions
        of sequence ``b``, before its sampling rows): append their entries to
        ``seq.prompt_logprobs`` and return the logits of the sampling rows only."""
        items = output.scheduled
        hidden = self._hidden(
            self._step_inputs(output, [m + r for m, r in zip(num_logits, prompt_rows)])
        )
        keep: list[int] = []
        row = 0
        for (seq, _), m, r in zip(items, num_logits, prompt_rows):
            if r:
                first = prompt_logprobs.first_position(seq)
                seq.prompt_logprobs.extend(prompt_logprobs.compute(
                    self.model.compute_logits,
                    hidden[row : row + r],
                    seq.token_ids[first + 1 : first + 1 + r],
                    seq.params.prompt_logprobs,
                ))
            keep.extend(range(row + r, row + r + m))
            row += r + m
        return self.model.compute_logits(
            hidden.index_select(0, to_device(keep, torch.int64, hidden.device))
        )

    def _step_inputs(self, output: SchedulerOutput, num_logits: Seq[int]) -> BatchInputs:
        """The scheduled tokens and drafts. A draft model's drafts are a device tensor: their
        positions get placeholders here, then the drafts are copied in on the device."""
        items = output.scheduled
        token_ids, on_device = [], []
        for b, (seq, _) in enumerate(items):
            drafts = seq.spec_token_ids
            if isinstance(drafts, torch.Tensor):
                on_device.append(b)
                drafts = [0] * len(drafts)
            token_ids.append(seq.token_ids + drafts if drafts else seq.token_ids)
        batch = self.prepare(
            token_ids,
            [seq.num_computed_tokens for seq, _ in items],
            [n for _, n in items],
            [seq.block_table for seq, _ in items],
            num_logits,
        )
        if on_device:  # a sequence's drafts are the last of its tokens in the step
            ends = np.cumsum([n for _, n in items])
            drafts = [items[b].seq.spec_token_ids for b in on_device]
            starts = [int(ends[b]) - len(d) for b, d in zip(on_device, drafts)]
            place_drafts(batch.input_ids, starts, drafts)
        return batch

    def _sample_decode(
        self, items: Seq[ScheduledSequence], logits: torch.Tensor, ahead: Seq[Sequence]
    ) -> list[StepResult]:
        """Sample a decode step's ``logits`` (``[B, vocab]``); with ``ahead``, launch their
        next forward on the drawn ids before the host waits for them."""
        # a sequence's row once it is kept, without a call per sequence per step
        sampling_rows = [seq.sampling_row or self._sampling_row(seq) for seq, _ in items]
        pending = self.sampler.launch(logits, sampling_rows)
        if ahead and pending.token_ids is not None:
            ahead, ahead_ids = list(ahead), pending.token_ids
            if ahead != [seq for seq, _ in items]:  # (a Sequence compares by identity)
                index = {id(seq): b for b, (seq, _) in enumerate(items)}
                rows = to_device([index[id(seq)] for seq in ahead], torch.int64, logits.device)
                ahead_ids = ahead_ids.index_select(0, rows)
            # else every sequence of the step, in its order: the drawn ids as they are
            self.lookahead = self._launch_ahead(ahead, ahead_ids)
        samples = pending.samples()
        if pending.drawn is None and self.lookahead is not None:
            # redrawn row by row after the launch: not the ids the launched forward computes
            self.drop_lookahead()
            return [_as_result(s) for s in samples]
        if pending.drawn is not None:  # the batch drew every row: no SampleError among them
            return [[s] for s in samples]
        return [_as_result(s) for s in samples]

    def _launch_ahead(self, seqs: list[Sequence], input_ids: torch.Tensor) -> Lookahead:
        """Queue the forward of the token each of ``seqs`` is being sampled now (``input_ids``,
        ``[B]`` on the device) at its next position."""
        graphs = self.decode_graphs
        if graphs is not None and len(seqs) <= graphs.max_batch:
            rows = self._decode_inputs.build(seqs, ahead=True)
            hidden = graphs.run(rows.input_ids, rows.positions, rows.slots, rows.tables, input_ids)
            logits = self.model.compute_logits(hidden)
            positions = rows.positions.tolist()
        else:
            positions = [len(seq.token_ids) for seq in seqs]
            batch = self.prepare(None, positions, [1] * len(seqs), [s.block_table for s in seqs], [1] * len(seqs))
            batch.input_ids = input_ids
            logits = self.forward(batch)
        done = None
        if logits.is_cuda:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(logits.device))
        return Lookahead(seqs, positions, logits, done, dict(zip(map(id, seqs), range(len(seqs)))))

    def drop_lookahead(self) -> None:
        """Forget the forward launched ahead, once it ran (its blocks can be given back then)."""
        launched, self.lookahead = self.lookahead, None
        if launched is not None:
            self.num_lookahead_wasted += 1
            launched.wait()

    def prepare(
        self,
        token_ids: Seq[Seq[int]] | None,
        starts: Seq[int],
        query_lens: Seq[int],
        block_tables: Seq[Seq[int]],
        num_logits: Seq[int],
    ) -> BatchInputs:
        """Flatten a batch: sequence ``b`` computes ``query_lens[b]`` tokens from ``starts[b]``
        and wants the logits of its last ``num_logits[b]`` of them. Without ``token_ids``
        the batch's ``input_ids`` are left to the caller (positions, slots and tables do not
        depend on them)."""
        bs = self.block_size
        num_seqs = len(query_lens)
        seq_lens = [s + n for s, n in zip(starts, query_lens)]

        width = max(-(-n // bs) for n in seq_lens)
        tables = np.zeros((num_seqs, width), dtype=np.int32)  # [B, max_blocks]
        for b, table in enumerate(block_tables):
            used = -(-seq_lens[b] // bs)
            tables[b, :used] = table[:used]
        if max(query_lens) == 1:
            positions = np.asarray(starts, dtype=np.int64)
            rows = np.arange(num_seqs)
        else:
            positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, query_lens)])
            rows = np.repeat(np.arange(num_seqs), query_lens)
        slots = tables[rows, positions // bs].astype(np.int64) * bs + positions % bs  # [N]
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])

        ends = query_start_loc[1:].astype(np.int64)
        logits_indices = np.concatenate([np.arange(e - m, e) for e, m in zip(ends, num_logits)])
        arrays = [query_start_loc, np.asarray(seq_lens, dtype=np.int32), tables, slots, positions,
                  logits_indices]
        if token_ids is not None:
            flat: list[int] = []
            for tokens, s, n in zip(token_ids, starts, query_lens):
                flat += tokens[s : s + n]
            arrays.append(np.asarray(flat, dtype=np.int64))
        # one asynchronous copy on CUDA: a pageable one would wait for the queued forward
        moved = upload(arrays, self.device)
        meta = AttentionMetadata(
            query_start_loc=moved[0],
            seq_lens=moved[1],
            block_tables=moved[2],
            slot_mapping=moved[3],
            seq_lens_cpu=list(seq_lens),
            query_lens_cpu=list(query_lens),
        )
        return BatchInputs(
            input_ids=moved[6] if token_ids is not None else None,
            positions=moved[4],
            meta=meta,
            logits_indices=moved[5],
        )

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        row = seq.sampling_row
        if row is not None:
            return row
        params = seq.params
        suppressed: tuple[int, ...] = ()
        if seq.num_output_tokens < params.min_tokens:
            stop_ids = params.stop_token_ids + (() if params.ignore_eos else self.eos_token_ids)
            suppressed = tuple(t for t in stop_ids if 0 <= t < self.vocab_size)
        row = SamplingRow(
            params, seq.generator, suppressed, grammar=seq.grammar, token_counts=seq.token_counts,
            position=seq.num_output_tokens if params.seed is not None else None,
        )
        # past min_tokens nothing in it changes again: kept for later steps (a seeded
        # request's position changes at every step)
        if not suppressed and params.seed is None:
            seq.sampling_row = row
        return row


def _num_logits(seq: Sequence, num_new: int) -> int:
    """Rows of logits ``seq`` needs this step: none mid-prefill, one to sample, one more per
    draft token to verify."""
    complete = seq.num_computed_tokens + num_new == seq.num_tokens + len(seq.spec_token_ids)
    return 1 + len(seq.spec_token_ids) if complete else 0


def _verify_row(seq: Sequence, first_logit: int) -> VerifyRow:
    draft_probs = seq.spec_draft_probs
    return VerifyRow(
        first_logit, seq.spec_token_ids, seq.params, seq.generator, draft_probs, seq.num_output_tokens
    )


def _as_result(sample: Sample | SampleError) -> StepResult:
    return sample if isinstance(sample, SampleError) else [sample]
