"""The server's limits before work, request isolation over HTTP, chat templates and the engine counters in
/metrics: uvicorn in a thread on a free port of 127.0.0.1, the packaged checkpoint on the CPU (torch
backend, fp32), driven with ``httpx``, raw sockets and the official ``openai`` client."""
import tritune.kernels.runtime  # noqa: F401  (interpreter switch before anything imports triton)

import json
import socket
import threading
import time

import pytest
import torch

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from tritune.model.engine.engine import Engine  # noqa: E402
from tritune.model.engine.scheduler import SamplingParams  # noqa: E402
from tritune.model.gpt2.model import GPT2  # noqa: E402
from tritune.model.load import default_model_dir  # noqa: E402
from tritune.model.serve.chat import load_chat_template, load_special_tokens, render_chat  # noqa: E402
from tritune.model.serve.schema import DEFAULT_MAX_BODY_BYTES  # noqa: E402
from tritune.model.serve.server import create_app  # noqa: E402
from tritune.model.tokenizer import Tokenizer  # noqa: E402

NAME = "tiny"
needs_model = pytest.mark.skipif(default_model_dir() is None, reason="no packaged checkpoint (model/default/)")


class ThreadServer:
    """uvicorn serving ``app`` in a thread, on a socket bound here (so the port is known and free)."""

    def __init__(self, app):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
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
    if default_model_dir() is None:
        pytest.skip("no packaged checkpoint (model/default/)")
    return GPT2.from_pretrained(default_model_dir(), backend="torch", dtype=torch.float32)


@pytest.fixture(scope="module")
def tok(model):
    return Tokenizer.from_dir(model.directory)


@pytest.fixture(scope="module")
def served(model, tok):
    engine = Engine(model, tokenizer=tok, num_blocks=600, block_size=16, max_num_seqs=16, cuda_graphs=False)
    app = create_app(engine, tok, NAME, max_queue=16)
    ts = ThreadServer(app)
    ts.state = app.state.server
    yield ts
    ts.close()


def post(served, body, path="/v1/completions", **kw):
    return httpx.post(served.url + path, content=body if isinstance(body, bytes) else json.dumps(body),
                      headers={"Content-Type": "application/json"}, timeout=60, **kw)


def error_of(r, status=400) -> dict:
    assert r.status_code == status, (r.status_code, r.text[:300])
    return r.json()["error"]


# ---------------------------------------------------------------------------------------------------
# Limits before work
# ---------------------------------------------------------------------------------------------------
def _send_huge_body(port: int, n: int, out: dict) -> None:
    """A POST declaring (and sending) an ``n``-byte body on a raw socket; the status line it gets back."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % n)
        chunk = b"x" * (1 << 16)
        try:
            for _ in range(n // len(chunk)):
                s.sendall(chunk)
        except OSError:     # the server answered and closed without reading it all: that is the point
            pass
        try:
            out["status_line"] = s.recv(4096).split(b"\r\n", 1)[0].decode()
        except OSError as e:
            out["status_line"] = f"no answer: {e}"
    finally:
        s.close()


@needs_model
def test_a_huge_body_and_a_slow_prompt_do_not_hold_up_health(served):
    """A 10 MB body (413 before it is read) and a body of the largest size taken whose prompt is a second of
    tokenizing (then a 400: far past the context), both while /health is polled: /health stays fast."""
    limit = served.state.max_body_bytes
    assert limit == DEFAULT_MAX_BODY_BYTES
    words = " ".join(f"w{i}x" for i in range(limit // 8))
    prompt = words[:limit - 100]
    big = {}
    slow = {}

    def slow_request():
        r = post(served, {"model": NAME, "prompt": prompt, "max_tokens": 1})
        slow["r"] = r

    lat = []
    stop = threading.Event()

    def poll():
        with httpx.Client(base_url=served.url, timeout=30) as c:
            while not stop.is_set():
                t = time.perf_counter()
                assert c.get("/health").status_code == 200
                lat.append(time.perf_counter() - t)
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.2)
    threads = [threading.Thread(target=_send_huge_body, args=(served.port, 10 << 20, big)),
               threading.Thread(target=slow_request)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    took = time.perf_counter() - t0
    time.sleep(0.1)
    stop.set()
    poller.join(30)
    worst = max(lat)
    print(f"/health while a 10 MB body and a {len(prompt) >> 10} KiB prompt were refused ({took:.2f} s): "
          f"{len(lat)} polls, worst {worst * 1e3:.1f} ms, median {sorted(lat)[len(lat) // 2] * 1e3:.1f} ms")
    assert big["status_line"].startswith("HTTP/1.1 413"), big
    err = error_of(slow["r"])
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
    assert worst < 0.25, f"/health took {worst * 1e3:.0f} ms while the large requests ran"


@needs_model
def test_a_chunked_body_over_the_limit_is_413(served):
    limit = served.state.max_body_bytes

    def chunks():
        for _ in range(limit // (1 << 16) + 2):
            yield b" " * (1 << 16)

    r = httpx.post(served.url + "/v1/completions", content=chunks(), timeout=60)
    err = error_of(r, 413)
    assert err["code"] == "body_too_large" and str(limit) in err["message"]


@needs_model
def test_text_that_is_not_utf8_is_a_clear_400(served):
    err = error_of(post(served, b'{"model": "tiny", "prompt": "caf\xe9 \xff", "max_tokens": 2}'))
    assert "UTF-8" in err["message"] and err["code"] == "invalid_encoding", err
    # JSON's escapes make a lone surrogate: valid JSON, not text a tokenizer takes
    err = error_of(post(served, b'{"model": "tiny", "prompt": "ab\\ud800cd", "max_tokens": 2}'))
    assert err["param"] == "prompt" and "surrogate" in err["message"], err
    err = error_of(post(served, b'{"model": "tiny", "prompt": ["ok", "ab\\udfffcd"], "max_tokens": 2}'))
    assert err["param"] == "prompt" and "prompt[1]" in err["message"], err


@needs_model
@pytest.mark.parametrize("field,value", [("user", "u" * 10_000), ("model", "m" * 10_000), ("stop", "s" * 10_000),
                                         ("stop", ["ok", "s" * 10_000])])
def test_string_fields_are_bounded(served, field, value):
    err = error_of(post(served, {"model": NAME, "prompt": "Hello", "max_tokens": 2, field: value}))
    assert err["param"] == field and "at most" in err["message"], err
    assert len(err["message"]) <= 500


@needs_model
def test_a_chat_message_role_is_bounded(served):
    served.state.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    try:
        err = error_of(post(served, {"model": NAME, "messages": [{"role": "r" * 1000, "content": "hi"}]},
                            "/v1/chat/completions"))
        assert err["param"] == "messages" and "at most" in err["message"], err
    finally:
        served.state.chat_template = None


def test_max_body_bytes_is_checked():
    from types import SimpleNamespace

    from tritune.model.serve.stub import StubEngine

    tok = SimpleNamespace(encode=lambda s: [1], decode=lambda ids: "")
    for bad in (0, 10, -1, True, 2.5):
        with pytest.raises(ValueError, match="max_body_bytes"):
            create_app(StubEngine(), tok, max_body_bytes=bad)
    assert create_app(StubEngine(n_positions=65536), tok).state.server.max_body_bytes == 256 * 65536


# ---------------------------------------------------------------------------------------------------
# Isolation: bad sampling parameters beside streams in flight
# ---------------------------------------------------------------------------------------------------
@needs_model
def test_bad_sampling_requests_beside_six_streams_disturb_none(served, model, tok):
    """Six greedy streams in flight; meanwhile a temperature of 1e-40 (under the engine's floor: sampled
    as greedy), a seed that is a string and one of 2**70 (400s naming the field), a top_k of 2**40 (over
    the vocabulary: no top-k). The six complete with the tokens the engine gives them alone, and the tiny
    temperature's request with greedy's."""
    prompts = [f"Story {i}: once upon a time" for i in range(6)]
    max_tokens = 40
    ref = Engine(model, tokenizer=tok, num_blocks=300, block_size=16, max_num_seqs=8, cuda_graphs=False)
    want = [c.token_ids for c in ref.generate([tok.encode(p) for p in prompts],
                                              SamplingParams(max_new_tokens=max_tokens, ignore_eos=True))]
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    got: dict = {}
    started = threading.Barrier(len(prompts) + 1, timeout=120)

    def stream(i):
        ids, first = [], True
        for ch in client.completions.create(model=NAME, prompt=prompts[i], max_tokens=max_tokens, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True, "return_token_ids": True}):
            c = ch.choices[0]
            ids += (c.model_extra or {}).get("token_ids") or []
            if first and ids:
                first = False
                started.wait()
            got.setdefault(i, {})["finish"] = c.finish_reason or got.get(i, {}).get("finish")
        got[i]["ids"] = ids

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    started.wait()      # every stream has its first tokens: all six are in flight
    for seed in ("abc", 2 ** 70):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=NAME, prompt="Hello", max_tokens=4, seed=seed)
        assert e.value.body["param"] == "seed", e.value.body
    tiny = client.completions.create(model=NAME, prompt=prompts[0], max_tokens=max_tokens, temperature=1e-40,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    wide = client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0.7, seed=1,
                                     extra_body={"top_k": 2 ** 40, "ignore_eos": True})     # top_k: none
    assert wide.choices[0].finish_reason == "length"
    for t in threads:
        t.join(300)
    assert sorted(got) == list(range(6))
    for i in range(6):
        assert got[i]["finish"] == "length" and got[i]["ids"] == want[i], i
    assert tiny.choices[0].model_extra["token_ids"] == want[0]
    h = httpx.get(served.url + "/health").json()
    assert h["status"] == "ok"


# ---------------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------------
CHATML = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
          "{{ raise_exception('the system message goes first') }}{% endif %}"
          "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WITH_JSON = ("{% for m in messages %}{{ m | tojson }}{% if loop.index == 2 %}{% break %}{% endif %}\n{% endfor %}"
             "{{ eos_token }}")


@pytest.mark.parametrize("template", [CHATML, WITH_JSON])
@pytest.mark.parametrize("gen", [True, False])
def test_render_chat_renders_as_transformers_does(template, gen):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer, models

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=HFTokenizer(models.WordLevel({"<s>": 0, "</s>": 1},
                                                                                          unk_token="<s>")),
                                              bos_token="<s>", eos_token="</s>")
    hf.chat_template = template
    msgs = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Ça va? «ok»"},
            {"role": "assistant", "content": "Oui."}]
    want = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert render_chat(template, msgs, add_generation_prompt=gen, bos_token="<s>", eos_token="</s>") == want


def test_render_chat_errors():
    with pytest.raises(ValueError, match="the system message goes first"):
        render_chat(CHATML, [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])
    with pytest.raises(ValueError, match="template"):
        render_chat("", [])


def test_chat_template_and_special_tokens_from_a_checkpoint(tmp_path):
    assert load_chat_template(tmp_path) is None and load_special_tokens(tmp_path) == {}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"chat_template": "from tokenizer.json"}))
    assert load_chat_template(tmp_path) == "from tokenizer.json"
    (tmp_path / "chat_template.jinja").write_text("from the jinja file")
    assert load_chat_template(tmp_path) == "from the jinja file"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "named"}],
        "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>", "pad_token": None}))
    assert load_chat_template(tmp_path) == "named"
    assert load_special_tokens(tmp_path) == {"bos_token": "<s>", "eos_token": "</s>"}
    if default_model_dir() is not None:     # GPT-2's checkpoint has none: the chat endpoint says so
        assert load_chat_template(default_model_dir()) is None


# ---------------------------------------------------------------------------------------------------
# Engine counters in /metrics
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kept", [True, False])
def test_metrics_show_the_engines_spec_skipped_rows_when_it_counts_them(kept):
    from tokenizers import Tokenizer as HFTokenizer, models

    from tritune.model.serve.stub import StubEngine

    engine = StubEngine(vocab_size=64, n_positions=128, max_num_seqs=4)
    if kept:
        engine.stats = {"spec_skipped_rows": 0}
    stok = Tokenizer(HFTokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0")))
    ts = ThreadServer(create_app(engine, stok, NAME))
    try:
        if kept:
            engine.stats["spec_skipped_rows"] = 5
        r = httpx.post(ts.url + "/v1/completions", json={"model": NAME, "prompt": [1, 2, 3], "max_tokens": 4})
        assert r.status_code == 200, r.text
        text = httpx.get(ts.url + "/metrics").text
    finally:
        ts.close()
    lines = [ln for ln in text.splitlines() if ln.startswith("tritune_spec_skipped_rows")]
    assert lines == (["tritune_spec_skipped_rows_total 5.0"] if kept else []), lines
