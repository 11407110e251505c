"""The API's request bodies and their checks: OpenAI's error shape (:class:`APIError`), the body as JSON
(UTF-8, no NaN), the pydantic models (strict types, every string bounded), and the sampling parameters a
body asks for, checked before anything reaches the engine."""
from __future__ import annotations

import functools
import json
import math

OPENAI_SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": 0}   # the API's defaults for absent fields
MAX_STOPS = 16
# Characters of the short string fields (a prompt or a message's content is bounded by the body's size
# and the context instead): a field past its bound is a 400 naming it, before any work on the request.
MAX_NAME_CHARS = 256        # model, user, a message's name
MAX_STOP_CHARS = 256        # each stop string (held back and searched per streamed piece)
MAX_ROLE_CHARS = 64
DEFAULT_MAX_BODY_BYTES = 1 << 20    # at least this; 256 bytes per token of the context where that is more
BODY_BYTES_PER_TOKEN = 256          # a token id as JSON takes 6; a token of text escaped as \uXXXX, tens


def default_max_body_bytes(n_positions: int) -> int:
    """The body bound when none is given: a whole context of the most verbose tokens, with room."""
    return max(DEFAULT_MAX_BODY_BYTES, BODY_BYTES_PER_TOKEN * int(n_positions))


def min_temperature() -> float:
    """Below this (and above 0) a temperature samples as greedy: the engine's floor where it states one
    (``tritune.model.engine.sampling.TEMPERATURE_FLOOR``), else 1e-5. Dividing logits by 1e-40 overflows
    to inf and the draw's softmax to NaN; the distribution it stands for is the argmax."""
    from tritune.model.engine import sampling

    floor = getattr(sampling, "TEMPERATURE_FLOOR", getattr(sampling, "MIN_TEMPERATURE", 1e-5))
    return float(floor)


class APIError(Exception):
    """An answer in OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, *, type: str = "invalid_request_error",
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is over this server's limit of {limit} bytes (--max-body-bytes)",
                    code="body_too_large")


# ---------------------------------------------------------------------------------------------------
# Request bodies (pydantic, built on first use so `tritune` runs without the serve extra)
# ---------------------------------------------------------------------------------------------------
@functools.cache
def bodies():
    """(Completion, Chat): the pydantic models of the two generation bodies."""
    from typing import Annotated

    from pydantic import BaseModel, ConfigDict, StringConstraints

    Name = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS)]
    Stop = Annotated[str, StringConstraints(max_length=MAX_STOP_CHARS)]

    class Common(BaseModel):
        # strict: "5" is not a number; unknown fields are ignored (clients send fields of newer APIs)
        model_config = ConfigDict(strict=True, extra="ignore")
        model: Name | None = None
        max_tokens: int | None = None
        temperature: float | None = None
        top_p: float | None = None
        top_k: int | None = None            # extension
        stop: Stop | list[Stop] | None = None
        seed: int | None = None
        n: int | None = 1
        stream: bool | None = False
        stream_options: dict | None = None
        presence_penalty: float | None = 0.0
        frequency_penalty: float | None = 0.0
        logit_bias: dict | None = None
        user: Name | None = None
        ignore_eos: bool | None = False     # extension: run to max_tokens
        return_token_ids: bool | None = False   # extension

    class Completion(Common):
        prompt: str | list[str] | list[int] | list[list[int]]
        logprobs: int | None = None
        echo: bool | None = False
        best_of: int | None = None
        suffix: str | None = None

    class Message(BaseModel):
        model_config = ConfigDict(strict=True, extra="allow")
        role: Annotated[str, StringConstraints(max_length=MAX_ROLE_CHARS)]
        content: str | list[dict] | None = None
        name: Name | None = None

    class Chat(Common):
        messages: list[Message]
        max_completion_tokens: int | None = None
        logprobs: bool | None = False
        top_logprobs: int | None = None
        tools: list | None = None
        tool_choice: Name | dict | None = None
        response_format: dict | None = None

    return Completion, Chat


def validation_error(e) -> APIError:
    """pydantic's first error as a 400 naming its field (of a union's errors, one that is not a type
    mismatch: ``stop: ["ok", <10 kB>]`` is a list whose item is too long, not a string)."""
    errs = e.errors()
    err = next((x for x in errs if x["loc"][:1] == errs[0]["loc"][:1] and not x["type"].endswith("_type")),
               errs[0])
    loc = [str(x) for x in err.get("loc", ()) if not isinstance(x, int)]
    param = loc[0] if loc else None
    got = ""
    if "input" in err and err.get("type") != "missing":
        got = repr(err["input"])
        got = f" (got {got[:200]}{'...' if len(got) > 200 else ''})"
    where = f"{param}: " if param else ""
    return APIError(400, f"{where}{err.get('msg', 'invalid value')}{got}"[:500], param)


def _forbid_nan(s):
    raise ValueError(f"{s} is not valid JSON")


def parse_body(raw: bytes, chat: bool):
    """The body's bytes as a Completion or a Chat; APIError 400 for what is not one."""
    from pydantic import ValidationError

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"the body is not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 4]!r}): JSON "
                       "bodies and every string in them (the prompt too) must be UTF-8", code="invalid_encoding"
                       ) from None
    try:
        data = json.loads(text, parse_constant=_forbid_nan)
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(data).__name__}")
    Completion, Chat = bodies()
    try:
        return (Chat if chat else Completion).model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None


def check_text(text: str, param: str) -> None:
    """A string the tokenizer will read: Unicode text (JSON's ``\\ud800`` escapes make lone surrogates,
    which no UTF-8 tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(400, f"{param}: not valid Unicode text (a lone surrogate {text[e.start]!r} at character "
                       f"{e.start})", param.split("[")[0].split(".")[0]) from None


# ---------------------------------------------------------------------------------------------------
# Sampling parameters
# ---------------------------------------------------------------------------------------------------
def check_supported(body, chat: bool) -> None:
    """Fields this server takes only at their defaults."""
    for name, bad in (("n", body.n not in (None, 1)), ("presence_penalty", bool(body.presence_penalty)),
                      ("frequency_penalty", bool(body.frequency_penalty)), ("logit_bias", bool(body.logit_bias))):
        if bad:
            raise APIError(400, f"{name}: not supported by this server (only its default)", name)
    if chat:
        if body.logprobs or body.top_logprobs is not None:
            raise APIError(400, "logprobs: not supported by this server", "logprobs")
        if body.tools or body.tool_choice not in (None, "none"):
            raise APIError(400, "tools: not supported by this server", "tools")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise APIError(400, "response_format: only text is supported", "response_format")
    else:
        for name, bad in (("logprobs", body.logprobs is not None), ("echo", bool(body.echo)),
                          ("best_of", body.best_of not in (None, 1)), ("suffix", body.suffix is not None)):
            if bad:
                raise APIError(400, f"{name}: not supported by this server", name)


def max_new_tokens(body, n_prompt: int, chat: bool, ctx: int) -> int:
    max_tokens = body.max_tokens if body.max_tokens is not None else getattr(body, "max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = ctx - n_prompt if chat else 16
    if max_tokens < 1:
        raise APIError(400, f"max_tokens: must be >= 1, got {max_tokens}", "max_tokens")
    if n_prompt + max_tokens > ctx:
        raise APIError(400, f"prompt of {n_prompt} tokens + max_tokens={max_tokens} exceeds the context "
                       f"({ctx} tokens); shorten the prompt or lower max_tokens", "prompt" if n_prompt >= ctx
                       else "max_tokens", code="context_length_exceeded")
    return max_tokens


def sampling_params(body, n_prompt: int, chat: bool, ctx: int, defaults: dict, vocab: int | None = None):
    """The engine's SamplingParams for one prompt of ``body``; APIError 400 naming the field otherwise.
    A temperature under the engine's floor is greedy; a top_k of the whole vocabulary or more is none."""
    from tritune.model.engine.scheduler import SamplingParams

    check_supported(body, chat)
    max_tokens = max_new_tokens(body, n_prompt, chat, ctx)
    t = defaults["temperature"] if body.temperature is None else body.temperature
    top_p = defaults["top_p"] if body.top_p is None else body.top_p
    top_k = defaults["top_k"] if body.top_k is None else body.top_k
    if not (math.isfinite(t) and t >= 0):
        raise APIError(400, f"temperature: must be a finite number >= 0 (0 is greedy), got {t}", "temperature")
    if 0 < t < min_temperature():
        t = 0.0
    if not (0 < top_p <= 1):
        raise APIError(400, f"top_p: must be in (0, 1], got {top_p}", "top_p")
    if top_k == -1:     # vLLM's spelling of "no top-k"
        top_k = 0
    if top_k < 0:
        raise APIError(400, f"top_k: must be >= 0 (0 or -1 disables it), got {top_k}", "top_k")
    if vocab is not None and top_k >= vocab:
        top_k = 0
    if body.seed is not None and not 0 <= body.seed < 2 ** 63:
        raise APIError(400, f"seed: must be in [0, 2**63), got {body.seed}", "seed")
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stops) or len(stops) > MAX_STOPS:
        raise APIError(400, f"stop: expected up to {MAX_STOPS} non-empty strings, got {len(stops)}", "stop")
    try:
        return SamplingParams(max_new_tokens=max_tokens, temperature=float(t), top_k=top_k, top_p=float(top_p),
                              seed=body.seed, stop=tuple(stops), ignore_eos=bool(body.ignore_eos))
    except (ValueError, TypeError) as e:
        raise APIError(400, str(e)) from None
