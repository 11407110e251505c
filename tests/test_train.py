"""model/train.py on the CPU: data cleaning, and a few steps of a tiny GPT-2 that lower the loss and leave a
checkpoint that tritune's loader (and transformers, when installed) reads as any Hugging Face GPT-2."""
import json

import pytest
import torch

from tritune.model import train as T
from tritune.model.gpt2.model import GPT2
from tritune.model.tokenizer import Tokenizer

PLAY = """ACT I.

Scene I. Verona. A public place.

[Enter Romeo and Juliet.]

Romeo.
But soft, what light through yonder window breaks?
It is the east, and Juliet is the sun.

Juliet.
O Romeo, Romeo! wherefore art thou Romeo?
Deny thy father and refuse thy name.

LADY CAPULET.
What, ho! my lord! my lord!

[Exeunt.]
"""


def test_clean_turns_speaker_headings_into_name_colon_and_strips_gutenberg():
    raw = ("The Project Gutenberg EBook of Romeo\n*** START OF THIS PROJECT GUTENBERG EBOOK ROMEO ***\n"
           + PLAY + "\n\n\n\nEnd of the Project Gutenberg EBook of Romeo\nlicence text\n")
    text = T.clean(raw)
    assert "Gutenberg" not in text and "licence" not in text
    assert "\nROMEO:\nBut soft" in text and "\nJULIET:\nO Romeo" in text and "\nLADY CAPULET:\n" in text
    assert "ACT I." in text and "Scene I. Verona" in text       # headings are not speakers
    assert "\n\n\n" not in text


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    data = tmp_path_factory.mktemp("texts")
    names = ["a_gut", "b_gut", "c_gut"]
    for i, n in enumerate(names):
        (data / f"{n}.txt").write_text((PLAY * (4 + i)).replace("Verona", f"Verona {i}"))
    out = tmp_path_factory.mktemp("ckpt")
    args = ["--data", str(data), "--out", str(out), "--vocab-size", "320", "--n-layer", "2", "--n-embd", "32",
            "--n-head", "2", "--n-positions", "32", "--dropout", "0", "--batch-size", "8", "--max-steps", "40",
            "--warmup", "5", "--lr", "3e-3", "--eval-every", "10", "--device", "cpu", "--sample-tokens", "8"]
    assert T.main(args) == 0
    return out


def test_training_lowers_the_loss_and_records_metrics(trained):
    m = json.loads((trained / "metrics.json").read_text())
    hist = m["training"]["history"]
    assert hist[-1]["train_loss"] < hist[0]["train_loss"] - 1.0
    assert min(h["val_loss"] for h in hist) < hist[0]["val_loss"] - 1.0
    assert m["validation_loss"] == pytest.approx(min(h["val_loss"] for h in hist), abs=2e-3)  # fp16 round trip
    assert m["validation_perplexity"] == pytest.approx(torch.tensor(m["validation_loss"]).exp().item(), rel=1e-3)
    assert (trained / "sample.txt").read_text().count("ROMEO:") >= 2


def test_checkpoint_loads_through_tritune_and_matches_the_training_model(trained):
    cfg = json.loads((trained / "config.json").read_text())
    assert cfg["model_type"] == "gpt2" and cfg["architectures"] == ["GPT2LMHeadModel"]
    tok = Tokenizer.from_dir(trained)
    eos = tok.token_id(T.EOS)
    assert eos is not None and cfg["eos_token_id"] == eos == cfg["bos_token_id"]
    assert tok.decode(tok.encode("ROMEO:\nBut soft!")) == "ROMEO:\nBut soft!"

    model = GPT2.from_pretrained(trained, backend="torch", dtype=torch.float32, device="cpu")
    assert model.config.eos_token_id == eos and model.config.n_layer == 2
    # The training module with the saved (fp16) weights computes the same logits as the loader's forward.
    from safetensors.torch import load_file

    lm = T.GPT2LM(T.ModelArgs(vocab_size=cfg["vocab_size"], n_positions=32, n_embd=32, n_layer=2, n_head=2,
                              dropout=0.0))
    lm.load_state_dict({k: v.float() for k, v in load_file(str(trained / "model.safetensors")).items()})
    ids = tok.encode("ROMEO:\nIt is the east, and Juliet is the sun.")[:32]
    with torch.no_grad():
        ref = lm.eval()(torch.tensor([ids]))[0]
    torch.testing.assert_close(model.forward([ids])[0], ref, rtol=1e-4, atol=1e-4)


def test_checkpoint_loads_in_transformers(trained):
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(trained), torch_dtype=torch.float32).eval()
    model = GPT2.from_pretrained(trained, backend="torch", dtype=torch.float32, device="cpu")
    ids = Tokenizer.from_dir(trained).encode("JULIET:\nO Romeo, Romeo!")
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(model.forward([ids])[0], ref, rtol=1e-4, atol=1e-4)


def test_oversized_model_is_refused(tmp_path):
    (tmp_path / "a_gut.txt").write_text(PLAY * 3)
    (tmp_path / "b_gut.txt").write_text(PLAY * 3)
    with pytest.raises(SystemExit, match="MiB"):
        T.main(["--data", str(tmp_path), "--out", str(tmp_path / "o"), "--vocab-size", "300",
                "--n-layer", "12", "--n-embd", "768", "--n-head", "12", "--device", "cpu"])


def test_packaged_default_checkpoint_loads_and_generates():
    from tritune.model.load import default_model_dir
    from tritune.model.engine.generate import generate

    d = default_model_dir()
    if d is None:
        pytest.skip("no packaged checkpoint (model/default/config.json) in this checkout")
    assert (d / "model.safetensors").stat().st_size <= T.MAX_CHECKPOINT_BYTES
    m = json.loads((d / "metrics.json").read_text())
    assert m["validation_perplexity"] == pytest.approx(torch.tensor(m["validation_loss"]).exp().item(), rel=1e-3)
    model = GPT2.from_pretrained(d, backend="torch", dtype=torch.float32, device="cpu")
    tok = Tokenizer.from_dir(d)
    assert model.config.eos_token_id == tok.token_id(T.EOS)
    r = generate(model, "ROMEO:", tokenizer=tok, max_new_tokens=16)
    assert len(r.tokens) == 16 and r.text.strip()


@pytest.fixture(scope="module")
def trained_llama(tmp_path_factory, trained):
    """A tiny --arch llama run reusing the GPT-2 run's tokenizer (as the packaged Llama-style model does)."""
    data = tmp_path_factory.mktemp("texts_llama")
    for i, n in enumerate(["a_gut", "b_gut", "c_gut"]):
        (data / f"{n}.txt").write_text((PLAY * (4 + i)).replace("Verona", f"Verona {i}"))
    out = tmp_path_factory.mktemp("ckpt_llama")
    args = ["--arch", "llama", "--data", str(data), "--tokenizer", str(trained), "--out", str(out), "--n-layer", "2",
            "--n-embd", "64", "--n-head", "2", "--n-kv-head", "1", "--intermediate", "96", "--n-positions", "32",
            "--dropout", "0", "--batch-size", "8", "--max-steps", "40", "--warmup", "5", "--lr", "3e-3",
            "--eval-every", "10", "--device", "cpu", "--sample-tokens", "8"]
    assert T.main(args) == 0
    return out


def test_llama_training_writes_an_hf_llama_checkpoint(trained_llama, trained):
    d = trained_llama
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["num_key_value_heads"] == 1 and cfg["tie_word_embeddings"]
    assert (d / "tokenizer.json").read_bytes() == (trained / "tokenizer.json").read_bytes()
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == cfg["eos_token_id"]
    m = json.loads((d / "metrics.json").read_text())
    hist = m["training"]["history"]
    assert hist[-1]["train_loss"] < hist[0]["train_loss"] - 1.0
    assert m["val"]["loss"] == pytest.approx(min(h["val_loss"] for h in hist), abs=2e-2)   # fp16 rounding
    transformers = pytest.importorskip("transformers")
    from tritune.model.load import load_model

    hf = transformers.LlamaForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    ours = load_model(d, backend="torch", dtype=torch.float32, device="cpu")
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours.forward([ids])[0], want, rtol=1e-4, atol=1e-4)


def test_packaged_llama_checkpoint_loads_and_generates_through_the_engine(capsys):
    from tritune.model.engine.engine import Engine
    from tritune.model.engine.scheduler import SamplingParams
    from tritune.model.load import default_model_dir, load_model

    d = default_model_dir("llama")
    if d is None:
        pytest.skip("no packaged Llama-style checkpoint (model/default_llama/config.json) in this checkout")
    assert (d / "model.safetensors").stat().st_size <= T.MAX_CHECKPOINT_BYTES
    m = json.loads((d / "metrics.json").read_text())
    assert m["validation_perplexity"] == pytest.approx(torch.tensor(m["validation_loss"]).exp().item(), rel=1e-3)
    model = load_model("llama", backend="torch", dtype=torch.float32)      # the short name
    assert type(model).__name__ == "Llama" and model.directory == d
    tok = Tokenizer.from_dir(d)
    assert model.config.eos_token_id == tok.token_id(T.EOS)
    eng = Engine(model, tokenizer=tok, num_blocks=64, block_size=16, cuda_graphs=False)
    r, = eng.generate([tok.encode("ROMEO:")], SamplingParams(max_new_tokens=16))
    assert len(r.token_ids) == 16 and tok.decode(r.token_ids).strip()
    from tritune.harness.cli import main

    assert main(["generate", "ROMEO:", "--model", "llama", "--max-new-tokens", "16"]) == 0
    assert tok.decode(r.token_ids) in capsys.readouterr().out      # the CLI's greedy text is the engine's
