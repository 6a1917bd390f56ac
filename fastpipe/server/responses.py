"""OpenAI's answer shapes: a whole completion or chat completion, and the chunks of a streamed one.

    shape = Shapes("chat", model="llama")
    shape.whole("Hello", "stop", usage)              # {"object": "chat.completion", "choices": [{"message": ...}], ...}
    shape.chunk("Hel", token_ids=None)               # {"object": "chat.completion.chunk", "choices": [{"delta": ...}]}
    sse(shape.chunk(...))                            # b'data: {...}\\n\\n'; DONE ends a stream

A stream is: (chat) a first chunk with the assistant's role, a chunk per piece of text, a last chunk with
the finish_reason and no text, (stream_options.include_usage) a chunk with no choices and the usage, then
`data: [DONE]`. An error after the answer started is an event {"error": {...}} before [DONE], as OpenAI
sends it (the openai client raises it as an APIError).
"""
from __future__ import annotations

import json
import time
import uuid

DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Shapes:
    def __init__(self, route: str, *, model: str, include_usage: bool = False):
        self.chat = route == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model, self.include_usage = model, include_usage

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str, use: dict, token_ids: list[int] | None = None) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": use}

    def chunk(self, text: str | None, *, finish_reason: str | None = None, token_ids: list[int] | None = None,
              role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        out = {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}
        if self.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, use: dict) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": use}
