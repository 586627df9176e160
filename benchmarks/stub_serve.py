"""``tiered-kv serve`` with its engine's steps stubbed, for ``serve_stream.py --stub-step-ms``:
each step sleeps (the interpreter lock free) and gives every running request one token of
text, so that the server's event loop is all the work there is.

The engine is the tiny model's, whole but for ``add_request``, ``step``, ``abort_request``
and ``has_unfinished_requests``, replaced before its thread gets a command. A streamed
request (``DELTA`` outputs) gets an output a step; one that is not gets its last only.

    python benchmarks/stub_serve.py STEP_S serve [tiered-kv serve's options]
"""
from __future__ import annotations

import sys
import time

from engine.outputs import RequestOutput, RequestOutputKind, frozen
from tiered_kv import server
from tiered_kv.cli import main as cli_main

TEXT, TOKEN = " tok", 5  # a whole character or more per token: one event each


def output(request_id: str, prompt_ids: list[int], count: int, finished: bool) -> RequestOutput:
    text = TEXT * count
    return frozen(
        RequestOutput, request_id=request_id, prompt=None, prompt_token_ids=prompt_ids,
        token_ids=[TOKEN] * count, text=text, delta_text=text, num_cached_tokens=0,
        finish_reason="length" if finished else None, stop_reason=None, logprobs=None,
        top_logprobs=None, prompt_logprobs=None, times=None,
    )


def stubbed(build, step_s: float):
    """``server.build_async_llm``, its engine's steps stubbed."""
    def build_stubbed(config):
        llm = build(config)
        engine, running = llm.engine, {}  # request id -> [params, prompt ids, tokens so far]

        def add_request(prompt, params, request_id, **_):
            running[request_id] = [params, prompt if isinstance(prompt, list) else [TOKEN], 0]

        def step() -> list[RequestOutput]:
            time.sleep(step_s)
            outputs = []
            for request_id, state in list(running.items()):
                params, prompt_ids, done = state
                state[2] = done = done + 1
                finished = done == params.max_tokens
                if params.output_kind is RequestOutputKind.DELTA:
                    outputs.append(output(request_id, prompt_ids, 1, finished))
                elif finished:
                    outputs.append(output(request_id, prompt_ids, done, True))
                if finished:
                    del running[request_id]
            return outputs

        def abort_request(request_id: str) -> None:
            running.pop(request_id, None)

        engine.add_request, engine.step, engine.abort_request = add_request, step, abort_request
        engine.has_unfinished_requests = lambda: bool(running)
        return llm

    return build_stubbed


def main() -> None:
    step_s = float(sys.argv.pop(1))
    server.build_async_llm = stubbed(server.build_async_llm, step_s)
    cli_main()


if __name__ == "__main__":
    main()
