"""``tritune serve`` on a real socket: uvicorn in a thread (the CLI in a subprocess once) on a free port of
127.0.0.1, driven with the official ``openai`` client and ``httpx``. The packaged checkpoint, torch backend,
fp32 on the CPU. Every greedy output is checked against the same request through an in-process Engine."""
import tritune.kernels.runtime  # noqa: F401  (interpreter switch before anything imports triton)

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from tritune.model.load import default_model_dir  # noqa: E402
from tritune.model.engine.engine import Engine  # noqa: E402
from tritune.model.gpt2.model import GPT2  # noqa: E402
from tritune.model.engine.scheduler import SamplingParams  # noqa: E402
from tritune.model.serve.server import create_app  # noqa: E402
from tritune.model.serve.text import TextOut  # noqa: E402
from tritune.model.tokenizer import Tokenizer  # noqa: E402

NAME = "tiny"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")

pytestmark = pytest.mark.skipif(default_model_dir() is None, reason="no packaged checkpoint (model/default/)")


class ThreadServer:
    """uvicorn serving ``app`` in a thread, on a socket bound here (so the port is known and free)."""

    def __init__(self, app):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            assert time.time() - t0 < 30 and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)

    def close(self):
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture(scope="module")
def model():
    return GPT2.from_pretrained(default_model_dir(), backend="torch", dtype=torch.float32)


@pytest.fixture(scope="module")
def tok(model):
    return Tokenizer.from_dir(model.directory)


ENGINE_KW = dict(num_blocks=600, block_size=16, max_num_seqs=64, cuda_graphs=False)


def engine_process(**engine_kw):
    """The packaged model's engine (torch backend, fp32) in a process of its own."""
    from tritune.model.serve.proc import EngineProcess

    return EngineProcess("tritune.model.serve.proc:model_engine", {
        "model": str(default_model_dir()), "backend": "torch", "dtype": "float32", "engine": engine_kw})


@pytest.fixture(scope="module", params=["thread", "process"])
def served(request, model, tok):
    """The server over the engine in a thread of this process, or in an engine process."""
    if request.param == "thread":
        engine = Engine(model, tokenizer=tok, **ENGINE_KW)
    else:
        engine = engine_process(**ENGINE_KW)
    app = create_app(engine, tok, NAME, chat_template=CHAT_TEMPLATE, max_queue=64)
    ts = ThreadServer(app)
    ts.state = app.state.server
    ts.engine = engine
    ts.mode = request.param
    yield ts
    ts.close()
    if request.param == "process":     # the lifespan's shutdown stopped it: gone, not orphaned
        assert not engine.process.is_alive() and engine.process.exitcode == 0, engine.process.exitcode


@pytest.fixture(scope="module")
def ref(model, tok):
    """The same requests through an Engine in-process: (token ids, text, finish reason) per prompt."""
    engine = Engine(model, num_blocks=600, block_size=16, max_num_seqs=64, cuda_graphs=False, tokenizer=tok)
    eos = model.config.eos_token_id

    def run(prompts, max_tokens, stop=(), ignore_eos=False):
        ids = [tok.encode(p) if isinstance(p, str) else p for p in prompts]
        mts = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(ids)
        out = engine.generate(ids, [SamplingParams(max_new_tokens=m, stop=tuple(stop), ignore_eos=ignore_eos)
                                    for m in mts])
        res = []
        for c in out:
            toks = c.token_ids
            text = tok.decode(toks[:-1] if toks and toks[-1] == eos and not ignore_eos else toks)
            hit = [i for i in (text.find(s) for s in stop) if i >= 0]
            res.append((toks, text[:min(hit)] if hit else text, "stop" if hit else c.finish_reason))
        return res

    return run


@pytest.fixture()
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def wait_idle(served, timeout=10.0) -> dict:
    """/health once nothing is in flight (aborts land at the engine's next step)."""
    t0 = time.time()
    while True:
        h = httpx.get(served.url + "/health").json()
        if h["in_flight"] == 0 and h["running"] == 0 and h["waiting"] == 0:
            return h
        assert time.time() - t0 < timeout, h
        time.sleep(0.05)


def metric(served, name) -> float:
    for line in httpx.get(served.url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def sse(lines):
    """The JSON events of an SSE body, and whether it ended with [DONE]."""
    events, done = [], False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        assert not done, "data after [DONE]"
        if line == "data: [DONE]":
            done = True
        else:
            events.append(json.loads(line[len("data: "):]))
    return events, done


# ---------------------------------------------------------------------------------------------------
def test_models_health_metrics(served, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    h = wait_idle(served)
    assert h["status"] == "ok" and h["kv_blocks_used"] == 0 and h["kv_blocks_total"] == 600
    text = httpx.get(served.url + "/metrics").text
    for name in ("tritune_requests_total", "tritune_prompt_tokens_total", "tritune_generation_tokens_total",
                 "tritune_requests_waiting", "tritune_kv_blocks_used", "tritune_time_to_first_token_seconds_bucket",
                 "tritune_time_per_output_token_seconds_bucket"):
        assert name in text, name


def test_completions_equal_the_engine(served, client, ref, tok):
    prompt = "Once upon a time"
    (ids, text, finish), = ref([prompt], 16)
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == text and r.choices[0].finish_reason == finish
    assert r.usage.prompt_tokens == len(tok.encode(prompt)) and r.usage.completion_tokens == len(ids)
    # a list of prompts (text, then token ids) answers one choice per prompt, in order
    prompts = ["The king said", "In the morning"]
    want = ref(prompts, 8)
    r = client.completions.create(model=NAME, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [w[1] for w in want]
    r = client.completions.create(model=NAME, prompt=[tok.encode(p) for p in prompts], max_tokens=8,
                                  temperature=0, extra_body={"return_token_ids": True})
    assert [c.text for c in r.choices] == [w[1] for w in want]
    assert [c.model_extra["token_ids"] for c in r.choices] == [w[0] for w in want]


def test_streaming_chunks_usage_and_done(served, client, ref):
    prompt = "The queen"
    (ids, text, finish), = ref([prompt], 30)
    body = {"model": NAME, "prompt": prompt, "max_tokens": 30, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events, done = sse(r.iter_lines())
    assert done
    *chunks, last = events
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == len(ids)
    for c in chunks:
        assert c["object"] == "text_completion" and c["model"] == NAME and c["usage"] is None
        assert c["id"] == last["id"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert sum((c["choices"][0]["token_ids"] for c in chunks), []) == ids
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == finish
    # the official client, streaming
    got = "".join(ch.choices[0].text for ch in client.completions.create(
        model=NAME, prompt=prompt, max_tokens=30, temperature=0, stream=True))
    assert got == text


def test_stop_strings_cut_the_text(served, client, ref):
    prompt = "Once upon a time"
    (_, text, _), = ref([prompt], 40, ignore_eos=True)
    stop = text[len(text) // 2:len(text) // 2 + 4]
    assert stop.strip(), text
    (_, want, finish), = ref([prompt], 40, stop=[stop], ignore_eos=True)
    assert finish == "stop" and want == text[:text.find(stop)]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "zzzz"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_idle(served)


def test_text_out_holds_back_a_stop_string_split_across_tokens(tok):
    ids = tok.encode("one two three four five six")
    out = TextOut(tok, stops=["four fi"])
    pieces = [out.feed([t]) for t in ids]
    assert "".join(pieces) + out.finish() == "one two three "
    assert all("fo" not in p for p in pieces) and out.stopped


def test_64_concurrent_streams_equal_the_engine(served, ref):
    g = torch.Generator().manual_seed(7)
    n = 64
    prompts = [torch.randint(1, 8000, (int(k),), generator=g).tolist() for k in torch.randint(2, 40, (n,), generator=g)]
    max_tokens = [int(m) for m in torch.randint(4, 14, (n,), generator=g)]
    want = ref(prompts, max_tokens)
    steps0 = httpx.get(served.url + "/health").json()["steps"]

    async def one(c, p, m):
        text, ids = "", []
        stream = await c.completions.create(model=NAME, prompt=p, max_tokens=m, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True})
        async for ch in stream:
            text += ch.choices[0].text
            ids += ch.choices[0].model_extra["token_ids"]
        return ids, text

    async def main():
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as c:
            return await asyncio.gather(*(one(c, p, m) for p, m in zip(prompts, max_tokens)))

    got = asyncio.run(main())
    for i, ((ids, text), (wids, wtext, _)) in enumerate(zip(got, want)):
        assert ids == wids, i
        assert text == wtext, i
    # batched across HTTP requests: far fewer engine steps than the requests' tokens one at a time
    steps = httpx.get(served.url + "/health").json()["steps"] - steps0
    assert steps < sum(len(w[0]) for w in want) / 4, steps
    assert wait_idle(served)["kv_blocks_used"] == 0


def test_disconnect_mid_stream_aborts_and_frees_blocks(served):
    aborts = metric(served, 'tritune_requests_total{finish_reason="abort"}')
    body = {"model": NAME, "prompt": "It was", "max_tokens": 250, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    got = 0
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()      # held: a dropped line iterator closes the connection
        for line in lines:
            if line.startswith("data: {"):
                got += len(json.loads(line[6:])["choices"][0]["token_ids"])
                break
        assert httpx.get(served.url + "/health").json()["kv_blocks_used"] > 0
    assert 0 < got < 250
    h = wait_idle(served)
    assert h["kv_blocks_used"] == 0
    assert metric(served, 'tritune_requests_total{finish_reason="abort"}') == aborts + 1
    # a whole (non-streaming) request whose client gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
    assert wait_idle(served)["kv_blocks_used"] == 0
    assert metric(served, 'tritune_requests_total{finish_reason="abort"}') == aborts + 2


def test_disconnect_frees_blocks_in_the_engine_process(served):
    """The engine process's own account (a stats round trip): an abandoned stream's blocks come back."""
    if served.mode != "process":
        pytest.skip("the engine process's account (the thread mode's engine is read directly above)")
    ep = served.engine
    body = {"model": NAME, "prompt": "It was", "max_tokens": 250, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        st = ep.run_sync(ep.stats())
        assert st["kv_blocks_used"] > 0 and st["live"] == 1 and st["pid"] == ep.pid != os.getpid()
    t0 = time.time()
    while (st := ep.run_sync(ep.stats()))["live"] or st["kv_blocks_used"]:
        assert time.time() - t0 < 10, st
        time.sleep(0.02)
    assert not st["unfinished"] and st["running"] == st["waiting"] == 0


BAD = [
    (b'{"prompt": "x",', None),
    (b'{"prompt": "x", "temperature": NaN}', None),
    (b"[1, 2]", None),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, "top_p"),
    ({"prompt": "x", "top_k": -3}, "top_k"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 256}, "max_tokens"),
    ({"prompt": "word " * 300, "max_tokens": 4}, "prompt"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "logprobs": 2}, "logprobs"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "stop": ""}, "stop"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [5, 99999]}, "prompt"),
    ({"prompt": [[5], "x"]}, "prompt"),
]


def test_bad_requests_answer_400_and_disturb_nothing(served, ref):
    (ids, text, _), = ref(["The old man"], 64, ignore_eos=True)
    body = {"model": NAME, "prompt": "The old man", "max_tokens": 64, "temperature": 0, "stream": True,
            "ignore_eos": True}
    got = ""
    with httpx.Client(base_url=served.url, timeout=60) as h, \
            httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for bad, param in BAD:      # while the good stream is running
            resp = h.post("/v1/completions", content=bad if isinstance(bad, bytes) else json.dumps(bad),
                          headers={"content-type": "application/json"})
            assert resp.status_code == 400, (bad, resp.text)
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
            assert err["param"] == param, (bad, err)
            assert err["message"], bad
        over = h.post("/v1/completions", json={"prompt": "word " * 300, "max_tokens": 4}).json()["error"]
        assert over["code"] == "context_length_exceeded"
        r404 = h.post("/v1/completions", json={"model": "gpt-5", "prompt": "x"})
        assert r404.status_code == 404 and r404.json()["error"]["code"] == "model_not_found"
        events, done = sse(lines)
    got = "".join(e["choices"][0]["text"] for e in events)
    assert done and got == text
    assert wait_idle(served)["kv_blocks_used"] == 0


def test_an_engine_failure_answers_500_for_that_request_only(served, monkeypatch):
    if served.mode == "process":
        pytest.skip("patches the engine's methods: the thread mode's engine lives in this process")
    real = served.engine.add_request

    def add_request(ids, *a, **kw):
        if ids[:2] == [7, 7]:
            raise RuntimeError("injected")
        return real(ids, *a, **kw)

    monkeypatch.setattr(served.engine, "add_request", add_request)
    r = httpx.post(served.url + "/v1/completions", json={"prompt": [7, 7, 7], "max_tokens": 2}, timeout=60)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error" and "injected" in r.text
    r = httpx.post(served.url + "/v1/completions", json={"prompt": [8, 7], "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2 or r.json()["choices"][0][
        "finish_reason"] == "stop"
    assert httpx.get(served.url + "/health").json()["status"] == "ok"
    # a step that keeps failing ends its requests with an error instead of leaving them waiting
    monkeypatch.setattr(served.engine, "add_request", real)
    monkeypatch.setattr(served.engine, "step", lambda: 1 / 0)
    r = httpx.post(served.url + "/v1/completions", json={"prompt": [8, 7], "max_tokens": 2}, timeout=60)
    assert r.status_code == 500 and "ZeroDivisionError" in r.json()["error"]["message"]
    monkeypatch.undo()
    assert wait_idle(served)["kv_blocks_used"] == 0


def test_full_queue_answers_429_with_retry_after(served):
    st = served.state
    bound = st.max_pending
    st.max_pending = 1
    body = {"model": NAME, "prompt": "It was", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    try:
        with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()      # held: a dropped line iterator closes the connection
            next(lines)
            resp = httpx.post(served.url + "/v1/completions", json={"model": NAME, "prompt": "x"})
            assert resp.status_code == 429 and int(resp.headers["retry-after"]) >= 1
            assert resp.json()["error"]["code"] == "queue_full"
    finally:
        st.max_pending = bound
    wait_idle(served)
    assert httpx.post(served.url + "/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 2},
                      timeout=60).status_code == 200


def test_api_key_checked_on_every_request(served):
    st = served.state
    st.api_key = "sekret"
    try:
        for method, path in (("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"),
                             ("POST", "/v1/completions")):
            r = httpx.request(method, served.url + path, json={"prompt": "x"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
            r = httpx.request(method, served.url + path, json={"prompt": "x"},
                              headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401, path
        c = openai.OpenAI(base_url=served.url + "/v1", api_key="sekret", max_retries=0)
        assert c.completions.create(model=NAME, prompt="x", max_tokens=2).usage.completion_tokens >= 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=served.url + "/v1", api_key="nope", max_retries=0).models.list()
    finally:
        st.api_key = None


def test_chat_completions_with_a_template_and_refused_without(served, client, ref):
    msgs = [{"role": "user", "content": "Tell me a story"}]
    (ids, text, finish), = ref(["user: Tell me a story\nassistant:"], 12)
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == len(ids)
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == finish
    st = served.state
    saved, st.chat_template = st.chat_template, None
    try:
        r = httpx.post(served.url + "/v1/chat/completions", json={"model": NAME, "messages": msgs})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "chat_template_missing"
        assert "no chat template" in err["message"] and "/v1/completions" in err["message"], err
    finally:
        st.chat_template = saved


def test_serve_bench_url_drives_the_server(served, tmp_path):
    from tritune.harness.cli import main

    out = tmp_path / "bench.json"
    rc = main(["serve-bench", "--url", served.url, "-n", "16", "--prompt-len", "4:24", "--output-len", "4:16",
               "--rate", "200", "--max-concurrency", "8", "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    run = res["run"]
    assert run["errors"] == 0 and run["requests"] == 16 and run["completed"] == 16
    assert run["output_tokens"] == res["workload"]["output_tokens"]
    assert run["output_tok_s"] > 0 and run["ttft_ms"]["p50"] > 0 and run["itl_ms"]["p99"] is not None
    assert wait_idle(served)["kv_blocks_used"] == 0


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")    # a zombie has exited
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_cli_serve_in_a_subprocess(engine):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, TRITUNE_API_KEY="k2")
    # a small engine (4 seats, a 256-token step: the packaged model's context): the warm-up and capture run
    # in full over fewer sizes, and the KV pool leaves the GPU to the other test workers
    cli = "import sys; from tritune.harness.cli import main; sys.exit(main())"
    p = subprocess.Popen([sys.executable, "-c", cli, "serve", "--port", str(port), "--log-level", "warning",
                          "--max-num-seqs", "4", "--max-batch-tokens", "256", "--engine", engine]
                         + (["--kv-memory-fraction", "0.05"] if torch.cuda.is_available() else []),
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    auth = {"Authorization": "Bearer k2"}
    # On a GPU the server warms up (kernel variants compiled, CUDA graphs captured) after the port opens:
    # minutes on a cold compile cache, while /health answers 503 "warming up". On the CPU, no warm-up.
    bound = 300 if torch.cuda.is_available() else 60
    try:
        t0 = time.time()
        while True:
            try:
                r = httpx.get(url + "/health", headers=auth)
                if r.status_code == 200:
                    break
                assert r.status_code == 503 and r.json()["status"] == "warming up", r.text
            except httpx.TransportError:
                pass
            assert p.poll() is None, p.stdout.read().decode()
            assert time.time() - t0 < bound, f"tritune serve did not come up in {bound} s"
            time.sleep(0.2)
        assert r.json()["status"] == "ok" and r.json()["engine"] == engine
        pid = r.json().get("engine_pid")
        assert httpx.get(url + "/health").status_code == 401
        r = httpx.post(url + "/v1/completions", headers=auth, timeout=60,
                       json={"model": "tritune-default", "prompt": "Once", "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        r = httpx.post(url + "/v1/chat/completions", headers=auth, json={"messages": [{"role": "user",
                                                                                         "content": "hi"}]})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "chat_template_missing"
        assert "no chat template" in err["message"] and "/v1/completions" in err["message"], err
        # Ctrl-C (SIGINT; a terminal sends it to the engine process too, which leaves it to the server)
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 0
        if pid is not None:
            assert pid != p.pid and _gone(pid), "the engine process outlived the server"
    finally:
        if p.poll() is None:
            p.terminate()
            p.wait(20)


def _poll_health(ts, want_status: int, timeout=30.0):
    t0 = time.time()
    while True:
        r = httpx.get(ts.url + "/health")
        if r.status_code == want_status:
            return r
        assert time.time() - t0 < timeout, r.text
        time.sleep(0.02)


def test_warm_up_beside_a_listening_server(model, tok):
    """The port is open while the warm-up runs: /health and generation answer 503 "warming up" (with
    Retry-After), the engine loop starts once it is done, and then requests are served."""
    release, started = threading.Event(), threading.Event()

    def warm_up(engine):
        started.set()
        assert release.wait(30)

    engine = Engine(model, num_blocks=64, block_size=16, max_num_seqs=4, cuda_graphs=False, tokenizer=tok)
    app = create_app(engine, tok, NAME, warm_up=warm_up)
    ts = ThreadServer(app)
    try:
        assert started.wait(10)
        r = httpx.get(ts.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "warming up"
        r = httpx.post(ts.url + "/v1/completions", json={"model": NAME, "prompt": "Once", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "warming_up" and r.headers["retry-after"]
        assert not app.state.server.loop.alive  # the warm-up has the engine to itself
        release.set()
        assert _poll_health(ts, 200).json()["status"] == "ok"
        r = httpx.post(ts.url + "/v1/completions", timeout=60,
                       json={"model": NAME, "prompt": "Once", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        release.set()
        ts.close()


def test_failed_warm_up_is_reported(model, tok):
    def warm_up(engine):
        raise RuntimeError("no kernel image for this GPU")

    engine = Engine(model, num_blocks=64, block_size=16, max_num_seqs=4, cuda_graphs=False, tokenizer=tok)
    ts = ThreadServer(create_app(engine, tok, NAME, warm_up=warm_up))
    try:
        t0 = time.time()
        while "failed" not in (status := httpx.get(ts.url + "/health").json()["status"]):
            assert time.time() - t0 < 10, status
            time.sleep(0.02)
        assert status == "warm-up failed: RuntimeError: no kernel image for this GPU"
        assert httpx.get(ts.url + "/health").status_code == 503
        r = httpx.post(ts.url + "/v1/completions", json={"model": NAME, "prompt": "Once", "max_tokens": 2})
        assert r.status_code == 503 and "warm-up failed" in r.json()["error"]["message"]
    finally:
        ts.close()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["thread", "process"])
def test_gpu_graph_engine_serves_concurrent_streams(mode):
    """The GPU path: triton backend, CUDA graphs, several greedy decode steps per host sync (tokens arrive
    in bursts). 64 concurrent streams of exact lengths, no errors, every block back, the graph path used;
    the engine in a thread of the server or in an engine process."""
    from tritune.model.serve.proc import EngineProcess

    kw = dict(max_num_seqs=64, kv_memory_fraction=0.05, cuda_graphs=True)
    tok = Tokenizer.from_dir(default_model_dir())
    if mode == "thread":
        model = GPT2.from_pretrained(default_model_dir(), backend="triton", dtype=torch.bfloat16)
        engine = Engine(model, tokenizer=tok, **kw)
    else:
        engine = EngineProcess("tritune.model.serve.proc:model_engine", {
            "model": str(default_model_dir()), "backend": "triton", "dtype": "bfloat16", "engine": kw})
    ts = ThreadServer(create_app(engine, tok, NAME))
    try:
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(1, 8000, (int(k),), generator=g).tolist() for k in torch.randint(2, 100, (64,),
                                                                                                 generator=g)]
        lens = [int(m) for m in torch.randint(8, 120, (64,), generator=g)]

        async def one(c, p, m):
            ids, text = [], ""
            stream = await c.completions.create(model=NAME, prompt=p, max_tokens=m, temperature=0, stream=True,
                                                extra_body={"return_token_ids": True, "ignore_eos": True})
            async for ch in stream:
                ids += ch.choices[0].model_extra["token_ids"]
                text += ch.choices[0].text
            return ids, text

        async def main():
            async with openai.AsyncOpenAI(base_url=ts.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
                return await asyncio.gather(*(one(c, p, m) for p, m in zip(prompts, lens)))

        got = asyncio.run(main())
        for (ids, text), m in zip(got, lens):
            assert len(ids) == m and text == tok.decode(ids)
        stats = engine.stats if mode == "thread" else engine.run_sync(engine.stats())["engine_stats"]
        assert stats["graph_steps"] > 0, stats
        h = wait_idle(ts)
        assert h["kv_blocks_used"] == 0
    finally:
        ts.close()


# ---------------------------------------------------------------------------------------------------
# The HTTP path alone: the stub engine (tritune.model.serve.stub) and the multi-process bench client
# ---------------------------------------------------------------------------------------------------
def _stub_server(rate=20000.0, **kw):
    from tokenizers import Tokenizer as HFTokenizer, models

    from tritune.model.serve.stub import StubEngine
    from tritune.model.serve.server import create_app
    from tritune.model.tokenizer import Tokenizer

    eng = StubEngine(rate=rate, vocab_size=512, n_positions=256, **kw)
    tok = Tokenizer(HFTokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0")))
    return eng, ThreadServer(create_app(eng, tok, "stub", max_queue=1024))


@pytest.mark.parametrize("procs", [1, 2])
def test_stub_engine_over_http_with_client_processes(procs):
    from tritune.model.bench.http import bench
    from tritune.model.bench.workload import make_workload

    eng, ts = _stub_server(max_num_seqs=16)
    try:
        items = make_workload(48, (4, 32), (8, 40), 512, 0)
        r = bench(ts.url, items, procs=procs, model="stub", max_concurrency=32, timeout=60)
        assert r["errors"] == 0 and r["completed"] == 48, r["error_samples"]
        assert r["output_tokens"] == sum(it.output_len for it in items) == eng.tokens
        assert r["client"]["procs"] == procs and len(r["client"]["cpu_busy"]) == procs
        assert r["ttft_ms"]["p50"] > 0 and r["chunks"] >= 48
        t0 = time.time()
        while eng.has_unfinished() and time.time() - t0 < 5:
            time.sleep(0.01)
        assert eng.pool.num_used == 0 and not eng.has_unfinished()
    finally:
        ts.close()


def test_stub_engine_stream_tokens_and_disconnect_frees_blocks():
    eng, ts = _stub_server(rate=500.0, decode_steps=1, max_num_seqs=8)
    try:
        with httpx.Client(timeout=30) as c:
            r = c.post(ts.url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 6, "temperature": 0,
                                                          "return_token_ids": True})
            assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [7, 8, 9, 10, 11, 12]
            with c.stream("POST", ts.url + "/v1/completions", json={"prompt": [1], "max_tokens": 200,
                                                                      "stream": True, "ignore_eos": True}) as s:
                for line in s.iter_lines():
                    if line.startswith("data: {"):
                        break       # leaving the block closes the connection mid-stream
        t0 = time.time()
        while (eng.has_unfinished() or eng.pool.num_used) and time.time() - t0 < 10:
            time.sleep(0.02)
        assert eng.pool.num_used == 0 and eng.tokens < 200
    finally:
        ts.close()


def test_engine_process_killed_mid_stream_answers_errors_and_503():
    """The engine process dies (SIGKILL, as the OOM killer ends it) while a stream and a whole request run:
    both end with the error at once (no hang), new requests answer 503, /health says why, the server
    stays up."""
    from tokenizers import Tokenizer as HFTokenizer, models

    from tritune.model.serve.proc import EngineProcess

    ep = EngineProcess("tritune.model.serve.proc:stub_engine",
                       dict(rate=200.0, decode_steps=1, vocab_size=512, n_positions=256, max_num_seqs=8))
    stok = Tokenizer(HFTokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0")))
    ts = ThreadServer(create_app(ep, stok, "stub"))
    whole = {}

    def post():
        whole["r"] = httpx.post(ts.url + "/v1/completions", json={"prompt": [3], "max_tokens": 200,
                                                                   "ignore_eos": True}, timeout=30)

    try:
        body = {"prompt": [1], "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", ts.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            t = threading.Thread(target=post)
            t.start()
            time.sleep(0.1)
            os.kill(ep.pid, signal.SIGKILL)
            t0 = time.time()
            events, done = sse(lines)
            assert time.time() - t0 < 5
        assert done and "died" in events[-1]["error"]["message"], events[-1]
        t.join(10)
        assert whole["r"].status_code == 500 and "died" in whole["r"].json()["error"]["message"]
        h = httpx.get(ts.url + "/health")
        assert h.status_code == 503 and "the engine process died" in h.json()["status"]
        r = httpx.post(ts.url + "/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_down"
        assert httpx.get(ts.url + "/v1/models").status_code == 200
        assert 'tritune_requests_total{finish_reason="error"} 2.0' in httpx.get(ts.url + "/metrics").text
    finally:
        ts.close()
    assert not ep.process.is_alive()


def test_a_writer_behind_sends_what_piled_up_as_one_chunk(tok):
    """Several engine steps delivered before the stream's writer runs go out as one SSE chunk (all their
    tokens, in order): the chunk rate adapts to what the server can write."""
    from types import SimpleNamespace

    from tritune.model.serve.responses import Format, Job, stream_response

    client = SimpleNamespace(abort=lambda seq: None)
    ids = tok.encode(" one two three four five six")

    async def main():
        job = Job(client, 1, "cmpl", 0.0)
        for k, t in enumerate(ids):     # one event per engine step, all there before the writer runs
            job.sink.put_nowait((0, None, [t], "length" if k == len(ids) - 1 else None, None))
        fmt = Format(NAME, job, False, True)
        return [c async for c in stream_response(job, [TextOut(tok)], fmt, False)]

    events, done = sse("".join(asyncio.run(main())).split("\n"))
    assert done and len(events) == 1
    ch = events[0]["choices"][0]
    assert ch["token_ids"] == ids and ch["text"] == tok.decode(ids) and ch["finish_reason"] == "length"


def _stub_process_server(**stub):
    from tokenizers import Tokenizer as HFTokenizer, models

    from tritune.model.serve.proc import EngineProcess

    ep = EngineProcess("tritune.model.serve.proc:stub_engine",
                       dict(vocab_size=512, n_positions=256, max_num_seqs=8, **stub))
    stok = Tokenizer(HFTokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0")))
    return ep, ThreadServer(create_app(ep, stok, "stub"))


@pytest.mark.parametrize("fail, how, error", [
    ("exit", "exit code 1", "KeyboardInterrupt: stub step 4 ended the loop on purpose"),
    ("segv", "killed by signal SIGSEGV", "Fatal Python error: Segmentation fault"),
    ("kill", "killed by signal SIGKILL", None),
])
def test_engine_process_death_says_why(fail, how, error, caplog):
    """The engine process dies inside step() (an exception that ends its loop, a segfault, SIGKILL): the
    stream's error event, /health (exit code or signal, the exception's traceback, faulthandler's stacks)
    and the log say why."""
    ep, ts = _stub_process_server(rate=200.0, decode_steps=1, fail_after=3, fail=fail)
    try:
        body = {"prompt": [1], "max_tokens": 50, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", ts.url + "/v1/completions", json=body, timeout=30) as r:
            if r.status_code == 200:
                events, done = sse(r.iter_lines())
                msg = events[-1]["error"]["message"]
            else:   # on a loaded machine the process can die before its acceptance has left it: a 500
                done, msg = r.status_code == 500, json.loads(r.read())["error"]["message"]
        assert done and "the engine process died" in msg and (error is None or error in msg), msg
        t0 = time.time()
        while (h := httpx.get(ts.url + "/health").json()).get("engine_death", {}).get("exit_code") is None:
            assert time.time() - t0 < 30, h     # (a loaded 2-core CI box: seconds)
            time.sleep(0.05)
        death = h["engine_death"]
        assert how in h["status"] and how in death["how"] and (error is None or error in h["status"]), h
        if fail == "exit":
            assert death["exit_code"] == 1 and "in step" in death["traceback"], death
        if fail == "segv":
            assert death["signal"] == "SIGSEGV" and "in step" in death["faulthandler"], death
        if fail == "kill":
            assert death["signal"] == "SIGKILL" and "OOM" in death["how"], death
        assert any(how in rec.getMessage() for rec in caplog.records if rec.name == "tritune.serve")
    finally:
        ts.close()


def test_engine_step_exception_fails_its_requests_and_the_engine_goes_on():
    """step() raises (an Exception): the requests end with the error named; the engine process lives."""
    ep, ts = _stub_process_server(rate=200.0, decode_steps=1, fail_after=2, fail="raise")
    try:
        r = httpx.post(ts.url + "/v1/completions", json={"prompt": [1], "max_tokens": 20}, timeout=30)
        assert r.status_code == 500 and "RuntimeError: stub step" in r.json()["error"]["message"], r.text
        h = httpx.get(ts.url + "/health")
        assert h.status_code == 200 and ep.process.is_alive() and "engine_death" not in h.json()
    finally:
        ts.close()


def test_frame_reader_keeps_a_half_arrived_message():
    """The API process's reader on a non-blocking socket (uvloop makes a watched one so): a message whose
    body arrives in parts is returned once whole, never an error (Connection.recv raised BlockingIOError,
    which read as the engine's death)."""
    import multiprocessing as mp
    import pickle
    import struct

    from tritune.model.serve.proc import _Frames

    a, b = mp.Pipe()
    os.set_blocking(a.fileno(), False)
    fr = _Frames(a.fileno())
    big = [("step", [(f"r{i}", None, list(range(40)), None, None, 40) for i in range(2000)], {}, 1)]
    body = pickle.dumps(big)
    b._send(struct.pack("!i", len(body)))
    assert fr.read() == [] and not fr.eof
    b._send(body[:1000])
    assert fr.read() == [] and not fr.eof
    b._send(body[1000:])
    b.send([("ready", {})])
    assert fr.read() == [big, [("ready", {})]]
    b.close()
    assert fr.read() == [] and fr.eof


def test_engine_process_step_message_is_compact_and_complete():
    """The engine process's loop (tritune.model.serve.proc._Core) on the stub engine, without a process: each step's
    message carries, per request, its acceptance before its tokens, every token once and in order (read from
    the requests' output_ids: no stream callback), and its end with the output length; a rejected request
    and an aborted one end with their reasons; while requests arrive, decode runs are short."""
    from array import array

    from tritune.model.serve.proc import ARRIVAL_STEPS, _Core
    from tritune.model.serve.stub import StubEngine

    class Out:
        def __init__(self):
            self.msgs = []

        def put(self, op):
            self.msgs.append(op)

    eng = StubEngine(decode_steps=16, max_num_seqs=4, vocab_size=512, n_positions=256)
    out = Out()
    core = _Core(eng, None, out)
    for rid, n in ((1, 40), (2, 7), (3, 300), (4, 50)):
        core._op(("add", rid, [rid + 10] * 8, SamplingParams(max_new_tokens=n, ignore_eos=True)))
    core._flush()
    core._run_length()
    core.step_once()                 # an arrival just now: a short run
    core._abort(4)
    assert core.short_runs == 1 and eng.decode_steps == ARRIVAL_STEPS
    core.t_add = -1e9                # no arrival for long: full runs
    while eng.has_unfinished():
        core._run_length()
        core.step_once()
        core._flush()
    assert eng.decode_steps == 16 and core.short_runs == 1
    core._flush()
    got, ends, accepted = {}, {}, {}
    for kind, rids, counts, toks, extras, load, _ in (m for m in out.msgs if m[0] == "step"):
        assert kind == "step" and all(isinstance(a, array) for a in (rids, counts, toks))
        assert sum(counts) == len(toks) and len(rids) == len(counts)
        pos = 0
        for j, (rid, k) in enumerate(zip(rids, counts)):
            acc, fin, err, n_out = extras.get(j, (None, None, None, 0))
            if acc is not None:
                accepted[rid] = acc
            assert rid in accepted or fin == "rejected"
            got.setdefault(rid, []).extend(toks[pos:pos + k].tolist())
            pos += k
            if fin is not None:
                ends[rid] = (fin, err, n_out)
    assert accepted == {1: 8, 2: 8, 4: 8}
    assert ends[3][0] == "rejected" and "context" in ends[3][1]
    assert ends[1] == ("length", None, 40) and ends[2] == ("length", None, 7) and ends[4][0] == "abort"
    for rid, n in ((1, 40), (2, 7)):
        assert got[rid] == [(rid + 10 + 1 + k) % 512 for k in range(n)]
    assert got[4] == [(4 + 10 + 1 + k) % 512 for k in range(ARRIVAL_STEPS)]      # one short run, then aborted
    assert core.live == {} and out.msgs[-1][5]["kv_blocks_used"] == 0
