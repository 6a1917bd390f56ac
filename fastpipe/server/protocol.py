"""OpenAI's request bodies, checked: what a completion or chat request asks for, or one ApiError line.

    ask = parse_request("chat", body_bytes, model="llama")     # -> Ask, or raises ApiError (status 400 / 404)

What is taken (docs/serving.md, "fastpipe serve"):
- completions: `prompt` (text, or token ids: a list of ints), chat: `messages` ({"role", "content"}; content
  text or a list of {"type": "text", "text"} parts), rendered by the tokenizer's chat template;
- `max_tokens` (chat also `max_completion_tokens`), `temperature` (default 1, as OpenAI's), `top_p`, `seed`,
  `stop` (a string or up to 4), `stream`, `stream_options.include_usage`, `n` (1 only), `user`, `model`
  (the served model's name, or absent);
- extensions, as vLLM spells them: `top_k`, `ignore_eos`, `return_token_ids` (each choice carries the
  token ids it generated: the route for clients that tokenise themselves).
A field OpenAI defines and this server does not implement (logprobs, echo, penalties, tools, ...) is
taken at its neutral value (null, 0, false, empty) and refused with any other; a field OpenAI does not
define is refused, as OpenAI refuses it ("Unrecognized request argument supplied").
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from fastpipe.serving.sampling import MIN_TEMPERATURE, SamplingParams

MAX_STOPS = 4                    # OpenAI's limit on `stop`
COMPLETIONS_DEFAULT_MAX_TOKENS = 16   # OpenAI's default for /v1/completions (chat: the rest of the context)


class ApiError(Exception):
    """An answer other than 200: the status and OpenAI's error object (message, type, param, code)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(" ".join(str(message).split()))
        self.status, self.type, self.param, self.code = status, type, param, code
        self.headers = headers or {}

    @property
    def message(self) -> str:
        return str(self)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, expected: str, found: Any) -> ApiError:
    """A 400 naming the field: '<param>: expected <expected>, found <found>'."""
    shown = found if isinstance(found, str) and found.startswith("<") else json.dumps(found)[:80]
    return ApiError(400, f"{param}: expected {expected}, found {shown}", param=param.split(".")[0].split("[")[0])


@dataclass
class Ask:
    """A checked request: its prompt (text, token ids, or chat messages) and how to generate."""
    route: str                                 # "completions" or "chat"
    prompt: str | list[int] | None = None      # completions
    messages: list[dict] | None = None         # chat: [{"role": str, "content": str}]
    max_tokens: int | None = None              # None: the route's default
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    ignore_eos: bool = False


# fields OpenAI defines that are refused unless neutral: field -> the neutral values (null always is)
_NEUTRAL_BOTH = {"presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},)}
_NEUTRAL = {
    "completions": {**_NEUTRAL_BOTH, "echo": (False,), "best_of": (1,), "logprobs": (0,), "suffix": ("",)},
    "chat": {**_NEUTRAL_BOTH, "logprobs": (False,), "top_logprobs": (0,), "tools": ([],), "functions": ([],),
             "tool_choice": ("none", "auto"), "function_call": ("none", "auto"), "parallel_tool_calls": (True, False),
             "response_format": ({"type": "text"},), "modalities": (["text"],), "store": (False,),
             "service_tier": ("auto", "default"), "reasoning_effort": (), "audio": (), "prediction": (),
             "web_search_options": ()},
}
_TAKEN = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "user",
          "top_k", "ignore_eos", "return_token_ids"}
_FIELDS = {"completions": _TAKEN | {"prompt"} | set(_NEUTRAL["completions"]),
           "chat": _TAKEN | {"messages", "max_completion_tokens", "metadata"} | set(_NEUTRAL["chat"])}


def parse_json(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except ValueError as e:                     # JSONDecodeError, or bytes that are not UTF-8
        raise ApiError(400, f"body: expected a JSON object, found invalid JSON ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"body: expected a JSON object, found a JSON {type(data).__name__}")
    return data


def parse_request(route: str, body: bytes, *, model: str) -> Ask:
    """Check a completions or chat body (module docstring); raises ApiError for the first bad field."""
    data = parse_json(body)
    unknown = sorted(set(data) - _FIELDS[route])
    if unknown:
        raise ApiError(400, f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0],
                       code="unrecognized_argument")
    for name, neutral in _NEUTRAL[route].items():
        v = data.get(name)
        if v is not None and not any(_same(v, n) for n in neutral):
            shown = " or ".join(json.dumps(n) for n in ("null",) + neutral).replace('"null"', "null")
            raise ApiError(400, f"{name}: not supported by this server: expected {shown}, found {json.dumps(v)[:80]}",
                           param=name, code="unsupported_parameter")
    requested = data.get("model")
    if requested is not None and requested != model:
        if not isinstance(requested, str):
            raise bad("model", "a string", requested)
        raise ApiError(404, f"model: expected \"{model}\" (the model this server runs), found \"{requested[:80]}\"",
                       param="model", code="model_not_found")
    ask = Ask(route=route)
    if route == "completions":
        ask.prompt = _prompt(data.get("prompt"))
        ask.max_tokens = _count(data, "max_tokens")
    else:
        ask.messages = _messages(data.get("messages"))
        a, b = _count(data, "max_completion_tokens"), _count(data, "max_tokens")
        ask.max_tokens = a if a is not None else b
    n = data.get("n")
    if n is not None and n != 1:
        raise ApiError(400, f"n: expected 1 (one choice per request; send n requests for n choices), found "
                            f"{json.dumps(n)[:40]}", param="n", code="unsupported_parameter")
    ask.sampling = _sampling(data)
    ask.stop = _stop(data.get("stop"))
    ask.stream = _flag(data, "stream")
    ask.ignore_eos = _flag(data, "ignore_eos")
    ask.return_token_ids = _flag(data, "return_token_ids")
    options = data.get("stream_options")
    if options is not None:
        if not ask.stream:
            raise bad("stream_options", "null unless stream is true", options)
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise bad("stream_options", "{\"include_usage\": true or false}", options)
        ask.include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    user = data.get("user")
    if user is not None and not isinstance(user, str):
        raise bad("user", "a string", user)
    return ask


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _same(v, neutral) -> bool:
    """v is the neutral value: numbers by value (0 == 0.0), anything else of the same type (false is not 0)."""
    return v == neutral and (type(v) is type(neutral) or (_number(v) and _number(neutral)))


def _flag(data: dict, name: str, where: str | None = None) -> bool:
    v = data.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(where or name, "true or false", v)
    return v


def _count(data: dict, name: str) -> int | None:
    v = data.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise bad(name, "an integer >= 1", v)
    return v


def _prompt(v) -> str | list[int]:
    if isinstance(v, str):
        if not v:
            raise bad("prompt", "non-empty text or token ids", v)
        return v
    if isinstance(v, list) and v and all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        return list(v)
    if isinstance(v, list) and len(v) == 1 and (isinstance(v[0], str) or isinstance(v[0], list)):
        return _prompt(v[0])                  # a batch of one prompt
    if isinstance(v, list) and v and all(isinstance(x, (str, list)) for x in v):
        raise bad("prompt", "one prompt (send one request per prompt)", f"<a list of {len(v)} prompts>")
    if v is None:
        raise bad("prompt", "text or a list of token ids", "none")
    raise bad("prompt", "text or a non-empty list of token ids", v)


def _messages(v) -> list[dict]:
    if not isinstance(v, list) or not v:
        raise bad("messages", "a non-empty list of {\"role\": ..., \"content\": ...}", v if v is not None else "<none>")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(where, "{\"role\": string, \"content\": ...}", m)
        content = m.get("content")
        if isinstance(content, list):          # content parts: text only
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"{where}.content[{j}]", "{\"type\": \"text\", \"text\": string} (text only)", part)
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad(f"{where}.content", "a string or a list of text parts", content)
        out.append({"role": m["role"], "content": content})
    return out


def _sampling(data: dict) -> SamplingParams:
    t = data.get("temperature", 1.0)
    t = 1.0 if t is None else t
    if not _number(t) or not math.isfinite(t) or not 0 <= t <= 2:
        raise bad("temperature", "a number in [0, 2]", t)
    if 0 < t < MIN_TEMPERATURE:
        raise bad("temperature", f"0 (greedy) or at least {MIN_TEMPERATURE:g}", t)
    p = data.get("top_p", 1.0)
    p = 1.0 if p is None else p
    if not _number(p) or not 0 < p <= 1:
        raise bad("top_p", "a number in (0, 1]", p)
    k = data.get("top_k", 0)
    k = 0 if k is None or k == -1 else k             # vLLM's -1: off
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise bad("top_k", "an integer >= 0 (0 or -1: off)", k)
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad("seed", "an integer", seed)
    return SamplingParams(temperature=float(t), top_k=k, top_p=float(p),
                          seed=None if seed is None else seed % 2**64)


def _stop(v) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop", "a string or a list of strings", v)
    if len(stops) > MAX_STOPS:
        raise bad("stop", f"at most {MAX_STOPS} strings", f"<{len(stops)} strings>")
    return [s for s in stops if s]
