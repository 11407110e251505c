"""One HTTP request's run after its parse: its engine requests (:class:`Job`), and OpenAI's response
shapes out of their events, whole or streamed (server-sent events)."""
from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid

from tritune.model.serve.client import Seq
from tritune.model.serve.schema import APIError
from tritune.model.serve.text import TextOut


class Job:
    """One HTTP request's engine requests: acceptance, then merged per-choice events, then the abort of
    whatever has not ended when the response ends (the client went away, or a stop string was found)."""

    def __init__(self, client, n: int, prefix: str, t_arrival: float):
        self.client = client          # the EngineClient
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.sink: asyncio.Queue = asyncio.Queue()
        self.seqs = [Seq(f"{self.id}-{i}", i, self.sink, t_arrival) for i in range(n)]
        self.early: list = []       # events that came in while waiting for the acceptances
        self.n_prompt = [0] * n
        self.n_out = [0] * n

    async def accepted(self) -> None:
        left = len(self.seqs)
        try:
            while left:
                ev = await self.sink.get()
                i, accepted, _, finish, error = ev
                if finish is not None and accepted is None and not self.n_prompt[i]:
                    if finish == "rejected":
                        raise APIError(400, error or "rejected by the engine", "prompt")
                    raise APIError(500, f"the engine could not take the request: {error}", type="server_error")
                if accepted is not None:
                    self.n_prompt[i] = accepted
                    left -= 1
                self.early.append(ev)
        except BaseException:
            self.close()
            raise

    async def events(self):
        """Batches of (index, tokens, finish, error), merged per choice: one await per wake-up. A None
        in the sink (the disconnect watcher's) yields None and ends."""
        ended = 0
        n = len(self.seqs)
        while ended < n:
            evs, self.early = self.early, []
            if not evs:
                evs.append(await self.sink.get())
            while not self.sink.empty():
                evs.append(self.sink.get_nowait())
            if None in evs:
                yield None
                return
            merged: dict = {}
            for i, _, tokens, finish, error in evs:
                if i in merged:
                    merged[i][0].extend(tokens)
                    if finish is not None:
                        merged[i][1:] = [finish, error]
                else:
                    merged[i] = [list(tokens), finish, error]
            out = []
            for i, (tokens, finish, error) in merged.items():
                self.n_out[i] += len(tokens)
                ended += finish is not None
                out.append((i, tokens, finish, error))
            yield out

    def close(self) -> None:
        for s in self.seqs:
            self.client.abort(s)

    def usage(self) -> dict:
        p, c = sum(self.n_prompt), sum(self.n_out)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


FINISH = {"stop": "stop", "length": "length", "abort": "abort", "error": "error"}


class Format:
    """OpenAI's response and chunk shapes."""

    def __init__(self, model_name: str, job, chat, token_ids):
        self.model_name, self.job, self.chat, self.token_ids = model_name, job, chat, token_ids
        self.created = int(time.time())
        self.head = {"id": job.id, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": self.created, "model": model_name}
        # A streamed chunk is the head, the choices and the tail: only the choices are encoded per chunk.
        self.pre = "data: " + json.dumps(self.head, separators=(",", ":"))[:-1] + ',"choices":['

    def chunk(self, choices: list[str], include_usage: bool) -> str:
        return self.pre + ",".join(choices) + ('],"usage":null}\n\n' if include_usage else "]}\n\n")

    def choice_text(self, i, text, finish, ids) -> str:
        """One streamed choice, as JSON text (the hot path: one per choice per engine step)."""
        fin = "null" if finish is None else json.dumps(finish)
        ids = f',"token_ids":[{",".join(map(str, ids))}]' if self.token_ids else ""
        if self.chat:
            delta = '{"content":%s}' % json.dumps(text) if text or not finish else "{}"
            return f'{{"index":{i},"delta":{delta},"logprobs":null,"finish_reason":{fin}{ids}}}'
        return f'{{"index":{i},"text":{json.dumps(text)},"logprobs":null,"finish_reason":{fin}{ids}}}'

    def choice(self, i, text, finish, ids, first=False):
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text or not finish
                                                                            else {})
            c = {"index": i, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": i, "text": text, "logprobs": None, "finish_reason": finish}
        if self.token_ids:
            c["token_ids"] = ids
        return c

    def whole(self, texts, finishes, ids) -> dict:
        choices = []
        for i, (text, fin) in enumerate(zip(texts, finishes)):
            if self.chat:
                c = {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": fin}
            else:
                c = {"index": i, "text": text, "logprobs": None, "finish_reason": fin}
            if self.token_ids:
                c["token_ids"] = ids[i]
            choices.append(c)
        return {"id": self.job.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model_name, "choices": choices,
                "usage": self.job.usage()}


def finish_of(out: TextOut, finish):
    return "stop" if out.stopped else FINISH.get(finish, finish)


async def whole_response(job, outs, fmt, request) -> dict:
    """The whole response once every choice has ended; a client that goes away ends it early."""
    n = len(outs)
    texts, ids, finishes = [""] * n, [[] for _ in range(n)], [None] * n

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        job.sink.put_nowait(None)       # wakes the consumer below

    watcher = asyncio.ensure_future(disconnected())
    try:
        async for batch in job.events():
            if batch is None:
                return {}               # the client went away; nobody reads this
            for i, tokens, finish, error in batch:
                ids[i] += tokens
                texts[i] += outs[i].feed(tokens)
                if outs[i].stopped and finish is None:
                    job.client.abort(job.seqs[i])
                if finish is not None:
                    if finish == "error":
                        raise APIError(500, f"generation failed: {error}", type="server_error")
                    texts[i] += outs[i].finish()
                    finishes[i] = finish_of(outs[i], finish)
        return fmt.whole(texts, finishes, ids)
    finally:
        watcher.cancel()
        job.close()


def sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def stream_response(job, outs, fmt, include_usage: bool):
    """The response's server-sent events: one chunk per wake-up, with every choice's news since the last."""
    head = fmt.head
    extra = {"usage": None} if include_usage else {}
    try:
        if fmt.chat:     # the role first, as OpenAI does
            yield sse({**head, "choices": [fmt.choice(i, "", None, [], first=True) for i in range(len(outs))],
                        **extra})
        async for batch in job.events():
            choices = []
            for i, tokens, finish, error in batch:
                if finish == "error":
                    yield sse({"error": APIError(500, f"generation failed: {error}", type="server_error").body()
                                ["error"]})
                    yield "data: [DONE]\n\n"
                    return
                text = outs[i].feed(tokens)
                if outs[i].stopped and finish is None:
                    job.client.abort(job.seqs[i])
                if finish is not None:
                    text += outs[i].finish()
                    finish = finish_of(outs[i], finish)
                if text or finish or (fmt.token_ids and tokens):
                    choices.append(fmt.choice_text(i, text, finish, tokens))
            if choices:
                yield fmt.chunk(choices, include_usage)
        if include_usage:
            yield sse({**head, "choices": [], "usage": job.usage()})
        yield "data: [DONE]\n\n"
    finally:
        job.close()


@functools.cache
def _sse_response_class():
    from starlette.responses import StreamingResponse

    class SSE(StreamingResponse):
        """Aborts the job's unfinished requests however the response ends (a disconnect cancels the
        streaming task, possibly while the generator is suspended, where its own finally would wait)."""

        def __init__(self, job, gen):
            super().__init__(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
            self.job = job

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.job.close()

    return SSE


def sse_response(job, gen):
    return _sse_response_class()(job, gen)
