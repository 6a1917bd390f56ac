"""Text in and out of a serving set: its tokenizer, loaded from the folder, with streaming detokenisation.

    tok = Tokenizer.load("out/")                     # the files build_serving_set linked beside the pipelines
    ids = tok.encode("Once upon a time")             # or tok.apply_chat_template([{"role": "user", "content": ...}])
    stream = tok.stream()
    for token in engine.submit(ids, max_new_tokens=64):
        print(stream.add(token), end="")             # new text only: never half a character
    print(stream.finish())                           # what was held back

The tokenizer is transformers' (AutoTokenizer, local files only): the `[hf]` extra. Without it, or
with files transformers cannot read, loading is one InputError line.

Streaming (TextStream) decodes a short window of tokens, not the whole text at each token, as
vLLM and TGI do: the tokens of the last piece written (the prefix, decoded again for context: a
SentencePiece tokenizer drops the leading space of a decode's first token, and a piece's text can
depend on its neighbours) and the tokens after them. The new text is what decoding the window adds
to decoding the prefix. It is held back while it ends in U+FFFD (a character whose UTF-8 bytes are
split across tokens, not all of them made yet), adds nothing (a special token skipped), or does not
start with the prefix's text (a tokenizer merging or cleaning up across tokens: the text so far is
not stable yet). `finish()` writes what is left of the full decode.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

from fastpipe.errors import InputError

# any of these in a folder means it has a tokenizer (fastpipe.serving.build.SIDE_FILES links them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
REPLACEMENT = "\ufffd"      # what decoding gives for the bytes of a character not all made yet


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether the folder holds tokenizer files (TOKENIZER_FILES)."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


class Tokenizer:
    """A transformers tokenizer behind the few calls serving needs: encode, decode, stream, chat template."""

    def __init__(self, hf_tokenizer, *, folder: str | os.PathLike | None = None):
        self.hf = hf_tokenizer
        self.folder = None if folder is None else Path(folder)

    @classmethod
    def load(cls, folder: str | os.PathLike, *, who: str = "tokenizer", otherwise: str | None = None) -> "Tokenizer":
        """The tokenizer in `folder` (a serving set or a model folder), local files only.
        Errors are one InputError line starting with `who`; `otherwise`, when given, ends them with
        what the caller can do instead (the CLI: give token ids)."""
        import logging

        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            missing = isinstance(e, ModuleNotFoundError) and (e.name or "transformers").split(".")[0] == "transformers"
            why = "not installed" if missing else f"which failed to import: {_one_line(e)}"
            raise InputError(f"{who}: needs transformers (pip install 'fastpipe[hf]') to read the tokenizer in "
                             f"\"{folder}\", {why}" + (f"; or {otherwise}" if otherwise else "")) from None
        logging.getLogger("transformers").setLevel(logging.ERROR)
        try:
            hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds; all mean "unreadable here"
            raise InputError(f"tokenizer: expected one transformers can load from \"{folder}\", found: "
                             f"{type(e).__name__}: {_one_line(e)}" + (f"; {otherwise}" if otherwise else "")) from None
        return cls(hf, folder=folder)

    # ------------------------------------------------------------------------------------------ ids
    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids (with the tokenizer's BOS and the like unless add_special_tokens=False)."""
        if not isinstance(text, str):
            raise InputError(f"prompt: expected text (a str), found {type(text).__name__}")
        return [int(i) for i in self.hf.encode(text, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """The text of `ids` (special tokens such as EOS left out unless skip_special_tokens=False)."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream(self, *, skip_special_tokens: bool = True) -> "TextStream":
        """A TextStream: give it the ids one at a time, write what each returns."""
        return TextStream(self, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> Iterator[str]:
        """The text of `ids` (a request, iterated as its tokens are made) in pieces as they become
        stable: each piece non-empty, none splitting a character; together, the full decode."""
        stream = self.stream(skip_special_tokens=skip_special_tokens)
        for token in ids:
            piece = stream.add(token)
            if piece:
                yield piece
        rest = stream.finish()
        if rest:
            yield rest

    # ------------------------------------------------------------------------------- chat template
    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True) -> list[int]:
        """The prompt ids of a conversation, [{"role": "system" | "user" | "assistant", "content": text}, ...],
        rendered by the tokenizer's chat template (which writes BOS and the like itself), ending with the
        assistant's turn opened unless add_generation_prompt=False."""
        if not self.has_chat_template:
            where = f" in \"{self.folder}\"" if self.folder is not None else ""
            raise InputError(f"chat template: expected a tokenizer with one (chat_template in tokenizer_config.json, "
                             f"or chat_template.jinja), found none{where}; encode the prompt as plain text instead")
        msgs = list(messages) if isinstance(messages, (list, tuple)) else None
        if not msgs:
            raise InputError(f"messages: expected a non-empty list of {{\"role\": ..., \"content\": ...}}, found "
                             f"{messages!r:.80}")
        for i, m in enumerate(msgs):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
                raise InputError(f"messages[{i}]: expected {{\"role\": str, \"content\": ...}}, found {m!r:.80}")
        try:
            text = self.hf.apply_chat_template([dict(m) for m in msgs], tokenize=False,
                                               add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - jinja's errors, and the template's own raise_exception
            raise InputError(f"chat template: expected messages it renders, found: {type(e).__name__}: "
                             f"{_one_line(e)}") from None
        return self.encode(text, add_special_tokens=False)


class TextStream:
    """Incremental detokenisation (module docstring): add(token) returns the text that token makes
    final, "" while it holds back; finish() returns the rest. Together they write the full decode of
    the tokens (decode(ids, skip_special_tokens)) whenever what was written stays its prefix.
    `tokenizer` is anything with decode(ids, skip_special_tokens=...): a Tokenizer, or transformers'."""

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.tokens: list[int] = []
        self.text = ""            # written so far
        self.prefix_offset = 0    # tokens[prefix_offset:read_offset]: the last piece written, decoded for context
        self.read_offset = 0      # tokens[read_offset:]: not written yet
        self._prefix: str | None = ""     # the prefix's text (None: not decoded yet)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def add(self, token: int) -> str:
        self.tokens.append(int(token))
        if self._prefix is None:
            self._prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        prefix = self._prefix
        window = self._decode(self.tokens[self.prefix_offset:])
        if len(window) <= len(prefix) or window.endswith(REPLACEMENT) or not window.startswith(prefix):
            return ""
        new = window[len(prefix):]
        self.prefix_offset, self.read_offset, self._prefix = self.read_offset, len(self.tokens), None
        self.text += new
        return new

    def finish(self) -> str:
        """The rest of the full decode: the text held back (an incomplete character at the end comes out
        as U+FFFD, as decode gives it). Where the full decode does not extend what was written (a
        tokenizer that rewrites across tokens), its tail after their common prefix."""
        full = self._decode(self.tokens)
        if full.startswith(self.text):
            rest = full[len(self.text):]
        else:
            common = next((i for i, (a, b) in enumerate(zip(self.text, full)) if a != b),
                          min(len(self.text), len(full)))
            rest = full[common:]
        self.text += rest
        self.prefix_offset, self.read_offset, self._prefix = len(self.tokens), len(self.tokens), ""
        return rest
