"""Chat templates: a checkpoint's Jinja template (``chat_template`` in ``tokenizer_config.json``, a
``chat_template.jinja`` file beside it, or ``chat_template`` in ``tokenizer.json``) and its rendering,
the way ``transformers``' ``apply_chat_template`` renders one: a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, loop controls, a ``tojson`` filter that keeps non-ASCII text,
``raise_exception`` and ``strftime_now``, and the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) as variables.

A checkpoint without a template (GPT-2's, the packaged one) has no chat format: ``/v1/chat/completions``
answers 400 saying so, and ``/v1/completions`` serves it.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _pick(t) -> str | None:
    if isinstance(t, list):     # named templates: the default one
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return t if isinstance(t, str) and t.strip() else None


def load_chat_template(directory) -> str | None:
    """The chat template of a checkpoint directory, or None (no template anywhere it is kept)."""
    if directory is None:
        return None
    d = Path(directory)
    t = _pick(_read_json(d / "tokenizer_config.json").get("chat_template"))
    if t is None:
        with_file = d / "chat_template.jinja"
        try:
            t = _pick(with_file.read_text()) if with_file.is_file() else None
        except OSError:
            t = None
    return t if t is not None else _pick(_read_json(d / "tokenizer.json").get("chat_template"))


def load_special_tokens(directory) -> dict:
    """The special tokens a template may use (``bos_token``, ``eos_token``, ...), as strings, from
    ``tokenizer_config.json`` (a token there may be a string or an added-token object)."""
    if directory is None:
        return {}
    cfg = _read_json(Path(directory) / "tokenizer_config.json")
    out = {}
    for name in SPECIAL_TOKENS:
        v = cfg.get(name)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[name] = v
    return out


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    import datetime

    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def render_chat(template: str, messages, add_generation_prompt: bool = True, **special_tokens) -> str:
    """``messages`` (dicts with ``role`` and ``content``) as the prompt text ``template`` makes of them.
    ``special_tokens``: ``bos_token="<s>"`` and the like, and any other variable the template reads
    (``tools``, ``documents``...). A template's ``raise_exception`` raises ValueError; a template that does
    not parse raises jinja2's TemplateSyntaxError."""
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"template: expected a non-empty Jinja template, got {template!r}")
    variables = {name: "" for name in ("bos_token", "eos_token")}
    variables.update(special_tokens)
    return _compile(template).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     **variables)
