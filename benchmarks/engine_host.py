"""The engine thread's own work per decode step: scheduling, appending and detokenizing the
sampled tokens, stop checks and outputs, with the model runner replaced by one that returns
fixed tokens at once. On a GPU this work overlaps the next forward (async scheduling); when
it takes longer than a forward, the GPU waits for it.

For each batch size B and prompt length P: B requests of P token ids on the tiny model
(CPU), prefilled, then decode steps timed in CPU time, the fastest of 6 chunks (a shared VM
is noisy) and the last one (the longest outputs: what grows with them shows there), with the garbage collector's pauses over all of them (a pause stops the engine's
thread as well; the fastest chunk leaves them out). ``--output-kind final_only`` asks for final outputs only, as ``LLM.generate``
does; the default is every step's output, as the server streams.

``--runner`` keeps the model runner (decode from the graph buffers, without capture, and
launched a step ahead as on a GPU; the sampler) and replaces only the model: a lookup into a
``[vocab, vocab]`` table whose rows are the logits, its argmax walking printable-ASCII ids.
That is all the host does between two graph replays on a GPU, the forward aside.

    python benchmarks/engine_host.py [--batches 1,32] [--prompts 32,2048] [--steps 600]
        [--output-kind cumulative|final_only] [--runner] [--out benchmarks/results/engine_host.json]
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

from bench_common import machine, write_json
from engine import LLM, RequestOutputKind, SamplingParams
from engine.sampler import Sample

REPO = Path(__file__).resolve().parents[1]
CHUNKS = 6


def host_ms_per_step(
    batch: int, prompt: int, steps: int, kind: RequestOutputKind, runner: bool = False
) -> tuple[float, dict]:
    max_len = min(prompt + steps + 16, 4096)
    llm = LLM(device="cpu", max_model_len=max_len, max_num_seqs=max(batch, 8),
              max_num_batched_tokens=max(2048, prompt), async_scheduling=runner)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True,
                            output_kind=kind)
    for i in range(batch):
        engine.add_request([(7 * i + j) % 200 + 3 for j in range(prompt)], params)
    while engine.scheduler.waiting or any(s.is_prefilling for s in engine.scheduler.running):
        engine.step()
    count = [0]

    def run(plan, ahead=()):  # the forward and sampling, done at once
        count[0] += 1
        return [[Sample(65 + (count[0] + b) % 26, None, None)] for b in range(len(plan.scheduled))]

    if runner:
        stub_model(engine.model_runner)
    else:
        engine.model_runner.run = run
    per_chunk = steps // CHUNKS
    chunks = []
    with CollectorPauses() as pauses:
        for _ in range(CHUNKS):
            start = time.process_time()
            for _ in range(per_chunk):
                engine.step()
            chunks.append((time.process_time() - start) / per_chunk)
    llm.engine.close()
    # the fastest chunk, and the last (the longest outputs: what grows with them shows there)
    return 1e3 * min(chunks), {"last_chunk_ms_per_step": 1e3 * chunks[-1], **pauses.summary(per_chunk * CHUNKS)}


class CollectorPauses:
    """The garbage collector's pauses while it is entered (they stop the engine's thread
    too): ``summary(steps)`` gives their number, milliseconds per step and the longest."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._start = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append(time.perf_counter() - self._start)

    def __enter__(self) -> CollectorPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self, steps: int) -> dict:
        return {"gc_collections": len(self.pauses), "gc_ms_per_step": 1e3 * sum(self.pauses) / steps,
                "gc_longest_ms": 1e3 * max(self.pauses, default=0.0)}


def stub_model(runner) -> None:
    """The model as a table lookup (row t: the logits after token t, argmax the next
    printable-ASCII id), behind the runner's decode graph buffers (no capture on a CPU)."""
    vocab = runner.model.compute_logits(torch.zeros(1, runner.model.config.hidden_size)).shape[-1]
    table = torch.zeros(vocab, vocab)
    for t in range(vocab):
        table[t, 32 + (t * 7 + 3) % 95] = 1.0

    def lookup(ids, *_):
        return torch.nn.functional.embedding(ids, table)

    runner.model.forward = lookup
    runner.model.compute_logits = lambda hidden: hidden
    runner.enable_decode_graphs(capture=False).forward = lookup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompts", default="32,2048")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--output-kind", choices=[k.value for k in RequestOutputKind],
                    default=RequestOutputKind.CUMULATIVE.value)
    ap.add_argument("--runner", action="store_true",
                    help="keep the model runner and sampler; stub only the model")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/engine_host.json")
    args = ap.parse_args()
    try:
        batches = [int(b) for b in args.batches.split(",")]
        prompts = [int(p) for p in args.prompts.split(",")]
    except ValueError:
        sys.exit("--batches and --prompts are comma-separated integers")
    if args.steps < CHUNKS or any(b < 1 for b in batches) or any(not 1 <= p <= 3000 for p in prompts):
        sys.exit(f"--steps must be >= {CHUNKS}, batches >= 1, prompts in [1, 3000]")
    kind = RequestOutputKind(args.output_kind)
    rows = []
    stubbed = "the model" if args.runner else "the model runner"
    print(f"engine host work per decode step, {stubbed} stubbed ({kind.value} outputs)")
    print("| batch | prompt tokens | ms / step | µs / request | last chunk ms / step | garbage collections | "
          "their ms / step | longest ms |")
    print("|---|---|---|---|---|---|---|---|")
    for b in batches:
        for p in prompts:
            ms, extra = host_ms_per_step(b, p, args.steps, kind, args.runner)
            rows.append({"batch": b, "prompt": p, "ms_per_step": ms, **extra})
            print(f"| {b} | {p} | {ms:.3f} | {1e3 * ms / b:.1f} | {extra['last_chunk_ms_per_step']:.3f} "
                  f"| {extra['gc_collections']} | "
                  f"{extra['gc_ms_per_step']:.3f} | {extra['gc_longest_ms']:.1f} |", flush=True)
    write_json(args.out, {"machine": machine(), "output_kind": kind.value, "runner": args.runner,
                          "steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()
