"""What streaming costs the HTTP server: output tokens per second of B concurrent
completions of N new tokens each, streamed and not streamed, against the same
``tiered-kv serve`` (rounds alternate), beside the engine alone (``LLM.generate`` of the same
prompts, in a process of its own).

A streamed request gets one server-sent event per engine step that gave it text, built and
written by the server's event loop. That loop shares the process, and Python's interpreter
lock, with the engine's thread, so every event's work is time the engine's thread may wait
for the lock. A non-streamed request gets one response at its end. The gap between the two
rows is the cost of streaming; the gap to the engine alone is the server's.

The server's two busy threads are also timed, from ``/proc``: CPU microseconds of its event
loop and of its engine thread per generated token. CPU time is steadier than throughput on
a shared machine, and the event loop's is the cost that streaming adds.

The client is this process: raw sockets, one HTTP/1.1 connection per request, reading bytes
and counting events, so that on a small machine it takes little of the CPU from the server.
For the streamed rounds it also times each request's first and last read that brought text:
time to first text, time per output token after it, and the longest wait between events.
That wait grows when the server merges the steps of a stream it fell behind on, and also
when tokens end inside a character: a random model's byte tokens can run 20 steps without
a whole character, whose text then comes at once.

``--stub-step-ms MS`` replaces the engine's step with a sleep of MS milliseconds (the
interpreter lock free) that gives every running request one token of text
(``stub_serve.py``): the server's event loop is then all the work there is, one event per
token, and its CPU per event is the cost of the streaming path alone, without the engine's
thread taking turns with it. No engine-alone row then. With ``--callgrind`` as well, the
server runs under valgrind's callgrind, counting while one streamed round runs: the event
loop's instructions per event, the same from run to run where CPU time on a shared machine
is not (give the steps time enough under valgrind, e.g. 100 ms, or the loop falls behind
and merges events).

    python benchmarks/serve_stream.py [--shape tiny|1b] [--device cpu|cuda] [--batch 128]
        [--new 128] [--rounds 3] [--stub-step-ms MS [--callgrind]]
        [--out benchmarks/results/serve_stream.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(Path(__file__).resolve().parent)]

from bench_common import SHAPES, machine, write_json  # noqa: E402

SEED = 11


def prompts(batch: int) -> list[str]:
    return [f"request {i}: tell me about tiered caches of attention keys and values" for i in range(batch)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def complete(port: int, prompt: str, new: int, stream: bool) -> dict:
    """One completion over a fresh connection: its completion tokens, the events received
    and, streamed, when the first and the last event with text came (seconds after sending)
    and the longest wait between two reads that brought events."""
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0,
                       "ignore_eos": True, "stream": stream,
                       **({"stream_options": {"include_usage": True}} if stream else {})}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = time.perf_counter()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                 b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    parts, first, last, longest = [], None, None, 0.0
    while data := await reader.read(1 << 16):
        parts.append(data)
        if stream and b'"text":"' in data and b'"text":""' not in data:
            now = time.perf_counter() - sent
            if first is None:
                first = now
            else:
                longest = max(longest, now - last)
            last = now
    writer.close()
    head, _, payload = b"".join(parts).partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the server answered {head[:300]!r}")
    if not stream:
        if b"chunked" in head.lower():
            payload = _unchunk(payload)
        return {"tokens": json.loads(payload)["usage"]["completion_tokens"], "events": 0}
    at = payload.rfind(b'"usage":{')  # the usage chunk
    usage = json.loads(b"{" + payload[at:payload.index(b"}", at) + 1] + b"}}")
    return {"tokens": usage["usage"]["completion_tokens"], "events": payload.count(b"data: {"),
            "first_s": first, "last_s": last, "longest_gap_s": longest}


def _unchunk(payload: bytes) -> bytes:
    out, rest = [], payload
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out.append(rest[:n])
        rest = rest[n + 2:]
    return b"".join(out)


async def round_trip(port: int, texts: list[str], new: int, stream: bool) -> dict:
    """All of ``texts`` at once: tokens/s, events per request and, streamed, the time to the
    first text (median, p99), the time per output token after it (median) and the longest
    wait for events (p99 over the requests), in ms."""
    start = time.perf_counter()
    results = await asyncio.gather(*(complete(port, t, new, stream) for t in texts))
    seconds = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    if tokens != len(texts) * new:
        raise RuntimeError(f"expected {len(texts) * new} completion tokens, got {tokens}")
    out = {"s": seconds, "tok_s": tokens / seconds,
           "events_per_request": sum(r["events"] for r in results) / len(texts)}
    timed = [r for r in results if r.get("first_s") is not None]
    if stream and timed:
        out["ttft_ms_p50"] = 1e3 * _quantile([r["first_s"] for r in timed], 0.5)
        out["ttft_ms_p99"] = 1e3 * _quantile([r["first_s"] for r in timed], 0.99)
        out["tpot_ms_p50"] = 1e3 * _quantile([(r["last_s"] - r["first_s"]) / (new - 1) for r in timed], 0.5)
        out["longest_gap_ms_p99"] = 1e3 * _quantile([r["longest_gap_s"] for r in timed], 0.99)
    return out


def _quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of the server's event loop (its main thread) and of its busiest other
    thread (the engine's), from ``/proc`` (empty where there is none)."""
    tick = os.sysconf("SC_CLK_TCK")
    loop, others = None, []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            seconds = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
            if task.name == str(pid):
                loop = seconds
            else:
                others.append(seconds)
    except OSError:
        return {}
    return {"event loop": loop, "engine thread": max(others)} if loop is not None and others else {}


def measured(pid: int, port: int, texts: list[str], new: int, stream: bool) -> dict:
    """One round, with the server threads' CPU milliseconds per generated token."""
    before = thread_cpu(pid)
    result = asyncio.run(round_trip(port, texts, new, stream))
    after = thread_cpu(pid)
    for name in before.keys() & after.keys():
        result[f"{name} cpu us per token"] = 1e6 * (after[name] - before[name]) / (len(texts) * new)
    return result


def start_server(
    model: str, device: str, port: int, batch: int, new: int, log: Path, stub_step_s: float | None = None,
    under: Sequence[str] = (),
) -> subprocess.Popen:
    """``tiered-kv serve`` (``under`` a command such as valgrind); with ``stub_step_s``, its
    engine's steps stubbed (``stub_serve.py``)."""
    if stub_step_s is None:
        program = ["-c", "from tiered_kv.cli import main; main()"]
    else:
        program = [str(Path(__file__).resolve().parent / "stub_serve.py"), str(stub_step_s)]
    args = [*under, sys.executable, *program, "serve",
            "--model", model, "--served-model-name", "bench", "--device", device, "--port", str(port),
            "--max-num-seqs", str(batch), "--max-model-len", str(64 + new + 16),
            "--kv-offloading-size", "0", "--kv-disk-size", "0", "--log-level", "warning"]
    return subprocess.Popen(args, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})


def wait_healthy(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n")
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError("the server did not become healthy")


OFFLINE = """
import json, sys, time
from engine import LLM, SamplingParams
model, device, batch, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
texts = json.loads(sys.stdin.read())
llm = LLM(model, device=device, max_num_seqs=batch, max_model_len=64 + new + 16)
params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
llm.generate(texts, params)  # warm-up
best = None
for _ in range(int(sys.argv[5])):
    start = time.perf_counter()
    llm.generate(texts, params)
    s = time.perf_counter() - start
    best = s if best is None else min(best, s)
print(json.dumps({"s": best, "tok_s": batch * new / best}))
"""


def offline(model: str, device: str, texts: list[str], new: int, rounds: int) -> dict:
    """The engine alone on the same prompts: the fastest of ``rounds`` timed generates."""
    proc = subprocess.run([sys.executable, "-c", OFFLINE, model, device, str(len(texts)), str(new), str(rounds)],
                          input=json.dumps(texts), capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO),
                               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    if proc.returncode != 0:
        raise RuntimeError(f"the offline run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def count_instructions(args: argparse.Namespace, texts: list[str], work: Path) -> None:
    """``--callgrind``: the stubbed server under callgrind, counting only while one streamed
    round runs (after a warm-up); prints and writes the event loop's instructions per event."""
    folder, port, log = work / "callgrind", free_port(), work / "server.log"
    folder.mkdir()
    under = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
             f"--callgrind-out-file={folder}/cg.%p"]
    proc = start_server("tiny", args.device, port, args.batch, args.new, log, args.stub_step_ms / 1e3, under)
    try:
        wait_healthy(proc, port, log)
        asyncio.run(round_trip(port, texts[:4], args.new, True))  # warm-up
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
        result = asyncio.run(round_trip(port, texts, args.new, True))
        subprocess.run(["callgrind_control", "-i", "off", str(proc.pid)], check=True, capture_output=True)
    finally:
        proc.terminate()
        proc.wait(120)
    loop = folder / f"cg.{proc.pid}-01"  # callgrind's thread 1: the main thread, the event loop's
    totals = [line for line in loop.read_text().splitlines() if line.startswith(("totals:", "summary:"))]
    per_event = int(totals[-1].split()[1]) / (result["events_per_request"] * len(texts))
    print(f"{args.batch} streamed completions × {args.new} new tokens, stub engine, "
          f"{args.stub_step_ms:g} ms steps, under callgrind")
    print(f"{result['events_per_request']:.0f} events per request; event loop: "
          f"{per_event / 1e3:.1f} k instructions per event")
    write_json(args.out, {"machine": machine(), "stub_step_ms": args.stub_step_ms, "callgrind": True,
                          "batch": args.batch, "new": args.new,
                          "events_per_request": result["events_per_request"],
                          "event_loop_instructions_per_event": per_event})


def model_folder(shape: str, device: str, work: Path) -> str:
    if shape == "tiny":
        return "tiny"
    from bench_common import write_random_llama
    from engine.config import DTYPES

    spec = SHAPES[shape]
    path = work / f"model-{shape}"
    write_random_llama(path, spec.llama_config(256), SEED, device=device, dtype=DTYPES[spec.dtype])
    return str(path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["tiny", "1b"], default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--stub-step-ms", type=float, default=None,
                    help="stub the engine: each step sleeps this long and gives every request one token")
    ap.add_argument("--callgrind", action="store_true",
                    help="with --stub-step-ms: count the event loop's instructions per event under callgrind")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks/results/serve_stream.json")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.new < 2 or args.rounds < 1:
        sys.exit("--batch >= 1, --new >= 2 and --rounds >= 1")
    if args.callgrind and (args.stub_step_ms is None or shutil.which("valgrind") is None):
        sys.exit("--callgrind needs --stub-step-ms and valgrind")
    texts = prompts(args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.callgrind:
            count_instructions(args, texts, work)
            return
        model = model_folder(args.shape, args.device, work)
        stub_s = args.stub_step_ms / 1e3 if args.stub_step_ms is not None else None
        engine_alone = offline(model, args.device, texts, args.new, args.rounds) if stub_s is None else None
        port, log = free_port(), work / "server.log"
        proc = start_server(model, args.device, port, args.batch, args.new, log, stub_s)
        try:
            wait_healthy(proc, port, log)
            asyncio.run(round_trip(port, texts[:4], args.new, True))  # warm-up
            runs: dict[str, list[dict]] = {"not streamed": [], "streamed": []}
            cpu_before = resource.getrusage(resource.RUSAGE_SELF)
            for _ in range(args.rounds):
                for mode in runs:
                    runs[mode].append(measured(proc.pid, port, texts, args.new, mode == "streamed"))
            cpu_after = resource.getrusage(resource.RUSAGE_SELF)
        finally:
            proc.terminate()
            proc.wait(30)
    client_cpu = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
    rows = {"engine alone": engine_alone} if engine_alone is not None else {}
    for mode, results in runs.items():
        rows[mode] = {"tok_s": statistics.median(r["tok_s"] for r in results),
                      "tok_s_runs": [r["tok_s"] for r in results],
                      "events_per_request": results[-1]["events_per_request"]}
        for key in results[0]:
            if key.endswith(("cpu us per token", "_p50", "_p99")):
                rows[mode][key] = statistics.median(r[key] for r in results)
    source = f"{args.shape} on {args.device}" if stub_s is None else f"stub engine, {args.stub_step_ms:g} ms steps"
    print(f"{args.batch} completions × {args.new} new tokens, {source} "
          f"(median of {args.rounds} rounds; client CPU {client_cpu:.1f} s over all rounds)")
    print("| run | tok/s | / engine alone | events per request | event loop CPU µs / token "
          "| engine thread CPU µs / token |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        events = f"{row['events_per_request']:.0f}" if "events_per_request" in row else "–"
        loop, engine = (f"{row[k]:.1f}" if k in row else "–"
                        for k in ("event loop cpu us per token", "engine thread cpu us per token"))
        ratio = f"{row['tok_s'] / engine_alone['tok_s']:.2f}" if engine_alone is not None else "–"
        print(f"| {name} | {row['tok_s']:,.0f} | {ratio} | {events} "
              f"| {loop} | {engine} |")
    streamed = rows["streamed"]
    if "ttft_ms_p50" in streamed:
        print(f"streamed: time to first text {streamed['ttft_ms_p50']:.1f} ms (p99 "
              f"{streamed['ttft_ms_p99']:.1f}), then {streamed['tpot_ms_p50']:.2f} ms a token (median); "
              f"longest wait for events {streamed['longest_gap_ms_p99']:.1f} ms (p99 of requests)")
    write_json(args.out, {"machine": machine(), "shape": args.shape, "device": args.device,
                          "stub_step_ms": args.stub_step_ms,
                          "batch": args.batch, "new": args.new, "rounds": args.rounds,
                          "client_cpu_s": client_cpu, "rows": rows})


if __name__ == "__main__":
    main()
