"""The engine: requests in, one step at a time, outputs out.

A step is three calls: the scheduler picks the tokens to compute, the model runner computes
them and samples, and post-processing appends the samples, detokenizes, checks the stop
conditions and finishes requests (freeing their blocks). Not thread-safe: one thread drives
an engine (:class:`engine.async_engine.AsyncLLM` runs it on its own thread).

A request whose sampling or detokenization raises is finished alone with
``finish_reason="error"``; the step goes on with the others.
"""
from __future__ import annotations

import hashlib
import itertools
import logging
import time
from collections.abc import Sequence as Seq

import torch

from engine import gc_heap
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.connector import KVConnector
from engine.hashing import root_hash
from engine.kv_events import KVEventLog, ZmqEventPublisher
from engine.lookahead import NOTHING, held_by_both, reserve
from engine.model_runner import StepResult
from engine.models import LoadedModel, load_model
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput, RequestOutputKind
from engine.penalties import TokenCounts
from engine.request_checks import checked_request
from engine.runner_setup import set_up_runner
from engine.sampler import Sample, SampleError
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.spec_decode.draft import DraftProposer
from engine.spec_decode.speculator import NgramProposer, Speculator
from engine.stats import EngineStats, NvmlTelemetry, StatsCollector
from engine.structured_output import GrammarCompiler
from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

TRANSFER_WAIT_S = 0.05  # how long a step with nothing to run waits for the connector


class LLMEngine:
    """Loads the model, sizes the KV cache, and runs steps over the queued requests.

    ``loaded_model``: an already loaded model to use instead of loading ``config.model``
    (it must be on ``config``'s device).
    ``kv_connector``: see :mod:`engine.connector`; ``None`` keeps all KV in the block pool.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        kv_connector: KVConnector | None = None,
        loaded_model: LoadedModel | None = None,
    ) -> None:
        config = config or EngineConfig()
        _use_device(config.torch_device)
        model = loaded_model
        if model is None:
            model = load_model(
                config.model, dtype=config.dtype, device=config.torch_device, tokenizer=config.tokenizer
            )
        model_device = next(model.model.parameters()).device
        if model_device.type != config.torch_device.type:
            raise ValueError(f"the model is on {model_device}, the config says {config.device!r}")
        self.config = config = config.resolve(model.config.max_position_embeddings)
        self.model_config = mc = model.config
        self.tokenizer: Tokenizer = model.tokenizer
        self.fingerprint = model.fingerprint
        self.model_path = model.path  # the checkpoint folder (its generation_config.json)
        self.device = torch.device(config.device)
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        setup = set_up_runner(config, model, with_connector=kv_connector is not None)
        self.model_runner, kv_cache, num_blocks = setup.runner, setup.kv_cache, setup.num_blocks
        self.namespace = setup.namespace
        self.connector = kv_connector
        if kv_connector is not None:
            kv_connector.register_kv_cache(kv_cache, self.namespace, config.block_size)
        self._stats = StatsCollector()
        self.speculator: Speculator | None = None
        if config.speculative_config is not None:
            proposer = (
                DraftProposer(setup.draft, config, num_blocks) if setup.draft is not None
                else NgramProposer(config.speculative_config)
            )
            self.speculator = Speculator(
                config.speculative_config, proposer, self._stats, config.max_model_len
            )
        self._telemetry = NvmlTelemetry(self.device)
        events = config.kv_events_config
        self._kv_events = KVEventLog(config.block_size) if events and events.enable_kv_cache_events else None
        self._kv_publisher = ZmqEventPublisher(events) if events and events.publishes else None
        if self._kv_events is not None:
            self._kv_events.cleared()  # routers forget what an earlier life of this instance held
        self.block_manager = BlockManager(
            num_blocks,
            config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            on_evict=kv_connector.on_blocks_evicted if kv_connector is not None else None,
            events=self._kv_events,
            kv_window=mc.kv_window,  # every layer windowed: blocks behind it are given back
        )
        self.scheduler = Scheduler(config, self.block_manager, self._stats, kv_connector)
        self.scheduler.prefill_cost = setup.prefill_cost
        self.outputs = OutputProcessor(self.tokenizer, self.eos_token_ids, config.max_model_len)
        self._ahead_held: list[int] = []  # blocks a forward launched ahead may still write
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        self._counter = itertools.count()
        self._closed = False
        gc_heap.freeze_startup_heap()  # no collection walks the start-up heap again

    @property
    def num_blocks(self) -> int:
        return self.block_manager.num_blocks

    def add_request(
        self,
        prompt: str | Seq[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
        priority: int = 0,
    ) -> str:
        """Queue a request (text or token ids); returns its id. Raises ``ValueError`` for a
        prompt that is empty, is not valid Unicode (a lone surrogate), has an invalid token id
        or does not fit ``max_model_len``, and for a non-zero ``priority`` unless
        ``scheduling_policy`` is ``"priority"`` (a lower value is served earlier)."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        params = params or SamplingParams()
        text, token_ids = checked_request(
            prompt, params, request_id, cache_salt, priority,
            self.tokenizer, self.model_config.vocab_size, add_special_tokens,
        )
        number = next(self._counter)
        if request_id is None:
            request_id = str(number)
        seed = params.seed if params.seed is not None else _derived_seed(self.config.seed, number)
        seq = Sequence(
            request_id,
            token_ids,
            params,
            block_size=self.config.block_size,
            root_hash=root_hash(self.namespace, cache_salt),
            generator=torch.Generator(self.device).manual_seed(seed),
            prompt=text,
            cache_salt=cache_salt,
            priority=priority,
        )
        if params.structured_output is not None:
            seq.grammar = self.grammars.state(params.structured_output)
        if params.has_penalties:
            seq.token_counts = TokenCounts(token_ids, self.model_config.vocab_size, self.device)
        self.outputs.add(request_id, token_ids, params)
        try:
            self.scheduler.add(seq)
        except BaseException:
            self.outputs.drop(request_id)
            raise
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a waiting, loading or running request and free its blocks (a loading one's
        once its load is reported); its final output, or None if there is no such unfinished
        request."""
        seq = self.scheduler.get(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        return self.outputs.output(seq)

    def has_unfinished_requests(self) -> bool:
        """Requests waiting, loading or running, or connector transfers still to be reported
        (a load of an aborted request, saves that hold blocks): steps complete them all."""
        return self.scheduler.has_unfinished() or self.scheduler.has_pending_transfers()

    def step(self) -> list[RequestOutput]:
        """Run one step; an output for every request that got a token or finished in it
        (only for those that finished, of the requests that asked for ``FINAL_ONLY``).

        With a connector, the step first takes in the transfers it finished. A sequence
        short of blocks while some are held for saves makes the connector let go of the
        saves it has not started (:meth:`KVConnector.release_held`). When nothing can run
        until a transfer finishes, the step waits up to ``TRANSFER_WAIT_S`` for one and may
        then run nothing."""
        _use_device(self.device)  # the stepping thread may not be the building one
        try:
            return self._step()
        finally:
            self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        if self._kv_events is None:
            return
        events = self._kv_events.take()
        if events and self._kv_publisher is not None:
            self._kv_publisher.publish(events)

    def _step(self) -> list[RequestOutput]:
        if self.connector is not None:
            self.scheduler.apply_transfers(self.connector.poll())
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        if plan.is_empty and self._ahead_held:  # its blocks may be what the plan lacks
            self._end_lookahead()
            plan = self.scheduler.schedule()
        if plan.is_empty and plan.preempted:  # admission waits a step after a preemption
            plan = self.scheduler.schedule()
        if plan.waits_for_held and self.connector is not None:
            self.connector.release_held()  # saves waiting for room below must not stall it
        if plan.is_empty and self.scheduler.has_pending_transfers():
            self.scheduler.apply_transfers(self.connector.poll(TRANSFER_WAIT_S))
            plan = self.scheduler.schedule()
        if plan.is_empty:
            if self.scheduler.has_unfinished() and not self.scheduler.has_pending_transfers():
                raise RuntimeError("the scheduler could not schedule any of the queued requests")
            return []
        results = self._run(plan)
        self._stats.observe_iteration(plan.num_batched_tokens)
        now = time.perf_counter()
        num_rejected = [  # the drafts each sequence had rejected; none without a speculator
            self.speculator.verified(seq, result) if len(seq.spec_token_ids) else 0
            for (seq, _), result in zip(plan.scheduled, results)
        ] if self.speculator is not None else []
        done: list[tuple[Sequence, str | None, Exception | None]] = []  # (seq, reason, error)
        append, final_only = self._append, RequestOutputKind.FINAL_ONLY  # per request below
        for (seq, _), result in zip(plan.scheduled, results):
            if result is None:
                continue
            if isinstance(result, SampleError):
                done.append((seq, None, result.error))
                continue
            try:
                reason = None
                # a step that gives several tokens (accepted drafts) spreads its interval
                # over them, as the server's histogram does
                last = seq.last_token_time
                gap = 0.0 if last is None else (now - last) / len(result)
                for sample in result:  # stops apply token by token: none past a stop is kept
                    reason = append(seq, sample, now, gap)
                    if reason is not None:
                        break
            except Exception as e:
                done.append((seq, None, e))
                continue
            if reason is not None or seq.params.output_kind is not final_only:
                done.append((seq, reason, None))  # a request that goes on quietly needs nothing more
        # Blocks are registered once the tokens they hold are appended, before finishing.
        self.scheduler.complete_step(plan, num_rejected)
        outputs = []
        for seq, reason, error in done:
            if error is not None:
                outputs.append(self._fail(seq, error))
                continue
            if reason is not None:
                self.scheduler.finish(seq, reason)
            outputs.append(self.outputs.output(seq))
        if self._ahead_held and not self.scheduler.running:  # launched for requests now gone
            self._end_lookahead()
        return outputs

    def _run(self, plan: SchedulerOutput) -> list[StepResult]:
        """The model runner's step; with ``async_scheduling`` it launches the next decode
        forward before this step's tokens reach the host (:mod:`engine.lookahead`)."""
        reserved = NOTHING
        if self.config.async_scheduling:
            reserved = reserve(plan, self.scheduler, self.block_manager, self.config)
        previous = self._ahead_held
        both = held_by_both(previous, reserved.held)  # held already: they stay held
        added = [b for b in reserved.held if b not in both] if both else reserved.held
        self.block_manager.hold(added)
        self._ahead_held = reserved.held
        try:
            results = self.model_runner.run(plan, reserved.seqs)
        except BaseException:
            self._ahead_held = previous + added
            self._end_lookahead(sync=True)
            raise
        # run() waited for the forward launched in the step before: its blocks can go
        self.block_manager.release([b for b in previous if b not in both] if both else previous)
        if self.model_runner.lookahead is None and reserved.held:  # not launched after all
            self.block_manager.release(reserved.held)
            self._ahead_held = []
        return results

    def _end_lookahead(self, sync: bool = False) -> None:
        """Wait for the forward launched ahead (``sync``: for all queued work) and give back
        the blocks held for it."""
        held, self._ahead_held = self._ahead_held, []
        try:
            self.model_runner.drop_lookahead()
            if sync and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        finally:
            self.block_manager.release(held)

    def stats(self) -> EngineStats:
        return self._stats.snapshot(self.block_manager, self.scheduler, self._telemetry.memory())

    def close(self) -> None:
        """Abort what is left, release the connector and NVML and give the KV cache's memory
        back; no request can be added afterwards. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._end_lookahead()
        except Exception:  # a broken device: the rest of the clean-up still runs
            logger.exception("waiting for the decode forward launched ahead failed")
        for request_id in self.outputs.request_ids():
            self.abort_request(request_id)
        if self.connector is not None:
            self.connector.close()
        self._telemetry.close()
        self._publish_kv_events()
        if self._kv_publisher is not None:
            self._kv_publisher.close()
        if self.speculator is not None and isinstance(self.speculator.proposer, DraftProposer):
            self.speculator.proposer.close()
        gc_heap.thaw()  # what this engine leaves in cycles is collected again
        self.model_runner.free_kv_cache()

    def _append(self, seq: Sequence, sample: Sample, now: float, gap: float) -> str | None:
        """Append a sampled token and detokenize it; the finish reason if it ends the
        request (the caller finishes it). ``gap``: its inter-token latency, if it is not
        the first token."""
        token = sample.token_id
        grammar_ended = seq.grammar is not None and seq.grammar.advance(token)
        seq.append_token(token)
        if seq.logprobs is not None:
            seq.logprobs.append(sample.logprob)
        if seq.top_logprobs is not None:
            seq.top_logprobs.append(sample.top_logprobs)
        stats = self._stats
        stats.num_generated_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
            stats.ttft_s.append(now - seq.arrival_time)
        else:
            stats.itl_s.append(gap)
        seq.last_token_time = now
        return self.outputs.stop(seq, token, grammar_ended)

    def _fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        """Finish a request whose sampling or detokenization raised, and only it: its output
        has ``finish_reason="error"`` and the text already sent."""
        logger.error("request %s failed", seq.request_id, exc_info=error)
        self.scheduler.finish(seq, "error")  # a no-op if it finished before raising
        return self.outputs.failed(seq)


def _use_device(device: torch.device) -> None:
    """Make ``cuda:N`` the calling thread's current device: kernels (Triton's too) launch on
    the current device, which is per thread and may have been set by another engine."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def _derived_seed(engine_seed: int, number: int) -> int:
    digest = hashlib.sha256(f"tiered-kv/request-seed/{engine_seed}/{number}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
