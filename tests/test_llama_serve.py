"""Serving a Llama-family checkpoint: ``tritune serve``'s own builder (engine_spec -> model_engine ->
load_model) over a tiny random LlamaForCausalLM with a Llama-3-style chat template, on a real socket of
127.0.0.1 driven by the ``openai`` client; the rendered chat prompt equal to transformers'
``apply_chat_template``, the completion equal to transformers' greedy ``generate``; serve-bench over a
Llama checkpoint and over a random checkpoint of a named shape; the packaged Llama-style model."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tritune.model.load import default_model_dir  # noqa: E402

# A Llama-3-style template (header tokens around each role, an end-of-turn token, the BOS first); the
# header tokens are not in the GPT-2 vocabulary the tiny model uses, so they tokenize as plain text.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = 'You are a helpful assistant.' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + system + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")
MESSAGES = [{"role": "system", "content": "Answer in verse. "},
            {"role": "user", "content": "Who is Romeo?"},
            {"role": "assistant", "content": "A lover."},
            {"role": "user", "content": "And Juliet?"}]

pytestmark = pytest.mark.skipif(default_model_dir() is None, reason="no packaged tokenizer (model/default/)")


def tiny_llama(folder, model_type="llama"):
    """A random 2-layer Llama (or Qwen2) with the packaged GPT-2 tokenizer and a Llama-3-style template."""
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[model_type]
    cfg = cls[0](vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                 bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    cls[1](cfg).save_pretrained(str(folder))
    shutil.copy(default_model_dir() / "tokenizer.json", folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "chat_template": LLAMA3_TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


def test_chat_template_renders_as_transformers(ckpt):
    from tritune.model.serve.chat import load_chat_template, load_special_tokens, render_chat

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
    template = load_chat_template(ckpt)
    assert template == LLAMA3_TEMPLATE
    for msgs in (MESSAGES, MESSAGES[1:2]):
        for gen in (True, False):
            ours = render_chat(template, msgs, add_generation_prompt=gen, **load_special_tokens(ckpt))
            assert ours == hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def hf_greedy(ckpt, ids, n):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def _serve(app):
    """uvicorn serving ``app`` in a thread on a free port of 127.0.0.1 (``.url``, ``.thread``)."""
    import socket
    import threading
    import time

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    server.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    server.thread.start()
    t0 = time.time()
    while not server.started:
        assert time.time() - t0 < 30 and server.thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    return server


def test_serve_a_llama_checkpoint_with_its_chat_template(ckpt):
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from tritune.harness.cli import build_parser
    from tritune.model.serve.server import _build_app
    from tritune.model.tokenizer import Tokenizer

    args = build_parser().parse_args(["serve", str(ckpt), "--engine", "thread", "--no-warm-up", "--backend", "torch",
                                      # fp32 as transformers' reference (serve's default is bf16 on a GPU)
                                      "--dtype", "fp32", "--served-model-name", "tiny-llama"])
    app, engine, mode, _ = _build_app(args, None)
    assert mode == "thread" and type(engine.model).__name__ == "Llama"
    ts = _serve(app)
    try:
        client = openai.OpenAI(base_url=ts.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=8, temperature=0)
        hf_tok = transformers.AutoTokenizer.from_pretrained(str(ckpt))
        prompt = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        tok = Tokenizer.from_dir(ckpt)
        ids = tok.encode(prompt)
        assert r.usage.prompt_tokens == len(ids)
        want = hf_greedy(ckpt, ids, 8)
        assert r.usage.completion_tokens == 8 and r.choices[0].message.content == tok.decode(want)
        c = client.completions.create(model="tiny-llama", prompt="ROMEO:", max_tokens=6, temperature=0)
        assert c.choices[0].text == tok.decode(hf_greedy(ckpt, tok.encode("ROMEO:"), 6))
        metrics = httpx.get(ts.url + "/metrics").text
        assert "tritune_request_errors_total 0.0" in metrics
    finally:
        ts.should_exit = True
        ts.thread.join(15)


def test_engine_counters_travel_with_the_load():
    from types import SimpleNamespace

    from tritune.model.serve.client import engine_load

    load = engine_load(SimpleNamespace(stats={"spec_over_batch_steps": 3, "request_errors": 1, "steps": 9}))
    assert load["spec_over_batch_steps"] == 3 and load["request_errors"] == 1 and "steps" not in load


def _serve_bench(ckpt, tmp_path, *flags) -> dict:
    """serve-bench's torch mode on the checkpoint with ``flags``: its results file, the mode run without error."""
    from tritune.harness.cli import build_parser
    from tritune.model.bench import serve_bench as S

    out = tmp_path / "res.json"
    args = build_parser().parse_args(["serve-bench", "--model", str(ckpt), "--modes", "torch", "--naive-requests",
                                      "0", "--batch-sweep", "", "-q", "--out", str(out), *flags])
    assert S.run(args) == 0
    res = json.loads(out.read_text())
    assert "error" not in res["modes"]["torch"], res["modes"]["torch"]
    assert res["modes"]["torch"]["run"]["output_tokens"] == res["workload"]["output_tokens"]
    return res


def test_serve_bench_on_a_llama_checkpoint(ckpt, tmp_path):
    res = _serve_bench(ckpt, tmp_path, "-n", "4", "--prompt-len", "4:8", "--output-len", "3:5", "--hf-requests", "2",
                       "--hf-batch-size", "2", "--decode-tokens", "4")
    assert res["transformers"]["output_tok_s"] > 0


def test_serve_bench_chunks_prefill_under_a_budget_below_the_context(ckpt, tmp_path):
    """A --max-batch-tokens under the model's context (Llama-3.2-1B's is 131,072 against the default 8,192):
    the engine is built with chunked prefill, so prompts over the budget run in pieces instead of the run
    being refused."""
    res = _serve_bench(ckpt, tmp_path, "-n", "3", "--prompt-len", "9:12", "--output-len", "2:3",
                       "--max-batch-tokens", "8", "--hf-requests", "-1", "--decode-tokens", "0")
    engine = res["modes"]["torch"]["engine"]
    assert engine["chunked_prefill"] and engine["max_batch_tokens"] == 8


def test_serve_bench_runs_report_the_median_run_and_the_spread(ckpt, tmp_path, monkeypatch):
    """--runs 3: the workload timed three times on the warm engine, each starting with an empty prefix cache
    (a repeat would find every prompt cached: no prefill); the result is the median run, with each run's
    output tok/s, TTFT and TPOT beside it."""
    from tritune.model.engine.kv_cache import BlockPool

    resets = []
    real = BlockPool.reset_cache
    monkeypatch.setattr(BlockPool, "reset_cache", lambda self: (resets.append(1), real(self))[1])
    res = _serve_bench(ckpt, tmp_path, "-n", "3", "--prompt-len", "4:8", "--output-len", "2:3", "--hf-requests",
                       "-1", "--decode-tokens", "0", "--runs", "3")
    run = res["modes"]["torch"]["run"]
    sp = run["spread"]
    assert sp["runs"] == 3 and len(sp["output_tok_s"]) == len(sp["ttft_p50_ms"]) == len(sp["tpot_p50_ms"]) == 3
    assert sorted(sp["output_tok_s"])[1] == run["output_tok_s"]
    assert sp["output_tok_s_min"] <= run["output_tok_s"] <= sp["output_tok_s_max"] and len(resets) >= 3


def test_random_checkpoint_of_a_shape(monkeypatch):
    """Without --model, serve-bench writes a random checkpoint of the named shape with transformers (a
    small stand-in shape here: the real ones are GPU-sized) and loads it through load_model."""
    from tritune.model.bench import runs

    monkeypatch.setitem(runs.SHAPES, "tiny-qwen2", dict(
        model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=128))
    config, directory, hf = runs.load_models(None, torch.float32, "cpu", need_hf=True, shape="tiny-qwen2")
    assert config.model_type == "qwen2" and config.vocab_size == 512 and type(hf).__name__ == "Qwen2ForCausalLM"
    m = runs.build_model(config, directory, "torch", torch.float32, "cpu")
    ids = [[3, 1, 4, 1, 5, 9]]
    want = hf(torch.tensor(ids)).logits[0]
    torch.testing.assert_close(m.forward(ids)[0], want, rtol=1e-4, atol=1e-4)
    for name in ("qwen2.5-0.5b", "llama-3.2-1b"):
        transformers.AutoConfig.for_model(runs.SHAPES[name]["model_type"],
                                          **{k: v for k, v in runs.SHAPES[name].items() if k != "model_type"})
    with pytest.raises(ValueError, match="shape"):
        runs.random_checkpoint("gpt-5", "/nonexistent")
