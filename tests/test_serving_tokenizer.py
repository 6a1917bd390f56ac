"""fastpipe.serving.tokenizer on real tokenizers made offline with the `tokenizers` library (a byte-level BPE as
GPT-2 and Llama 3 have, a SentencePiece-style BPE with byte fallback as Llama 2 has), saved and loaded from a
folder as a serving set holds them: encode/decode round trips, streaming detokenisation equal to the full
decode and never half a character (emoji, CJK and accented letters split over several tokens), the chat
template and its absence, one-line load errors; and the names fastpipe.serving exports."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from hypothesis import given, settings, strategies as st  # noqa: E402
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402

from fastpipe.errors import InputError  # noqa: E402
from fastpipe.serving.tokenizer import REPLACEMENT, TextStream, Tokenizer, has_tokenizer  # noqa: E402
from tests import offline_tokenizers  # noqa: E402
from tests.offline_tokenizers import SPECIALS, save_pretrained  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ["the quick brown fox jumps over the lazy dog", "Hello world, a naive cafe", "once upon a time there was"]
TEXTS = [
    "Hello world",
    "Crème brûlée, naïve façade, Ærøskøbing, Ωμέγα",      # 2-byte characters
    "日本語のテキストと中文字符，한국어",                       # 3-byte characters
    "emoji 🙂👍🏽 👩‍👩‍👧 🇫🇷 🎉!",                             # 4-byte characters, skin tone, ZWJ, flags
    "mixed: año 2024 — 東京 🗼 ok",
]
CHAT = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")


def byte_level_bpe():
    """GPT-2 / Llama 3 style: byte-level pre-tokenizer and decoder, merges trained on ASCII text, so every
    non-ASCII character is several byte tokens."""
    return offline_tokenizers.byte_level_bpe(CORPUS * 4, vocab_size=400)


def byte_fallback_bpe():
    """Llama 2 style: "▁" for spaces, a space prepended, unknown characters spelled as <0xNN> byte tokens, a
    decoder that drops the leading space of a decode's first token."""
    t = tokenizers.Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    t.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=150, special_tokens=SPECIALS,
                                                          show_progress=False))
    trained = json.loads(t.to_str())["model"]
    vocab = dict(trained["vocab"])
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    out = tokenizers.Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    out.add_special_tokens(SPECIALS)
    out.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    out.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return out


def save(t, folder: Path, chat_template=None) -> Path:
    save_pretrained(t, folder, chat_template)
    return folder


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def tok(request, tmp_path_factory):
    make = {"byte_level": byte_level_bpe, "byte_fallback": byte_fallback_bpe}[request.param]
    folder = save(make(), tmp_path_factory.mktemp(request.param))
    assert has_tokenizer(folder)
    return Tokenizer.load(folder)


def pieces_of(tok, ids):
    """What a TextStream returns for each id, then what finish() returns."""
    s = tok.stream()
    return [s.add(i) for i in ids], s.finish()


# ------------------------------------------------------------------------------------------ encode / decode
@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok, text):
    ids = tok.encode(text)
    assert ids and all(type(i) is int for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.decode(ids + [2]) == text and tok.decode([2], skip_special_tokens=False) == "</s>"


def test_encode_refuses_what_is_not_text(tok):
    with pytest.raises(InputError, match="prompt: expected text \\(a str\\), found list"):
        tok.encode([5, 7])


# ------------------------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_the_full_decode_and_never_splits_a_character(tok, text):
    ids = tok.encode(text, add_special_tokens=False) + [2]        # EOS at the end, as a request ends
    split = [i for i in ids if REPLACEMENT in tok.decode([i])]     # tokens holding part of a character
    if not text.isascii():
        assert split, "the test text should split a character over tokens"
    pieces, rest = pieces_of(tok, ids)
    assert "".join(pieces) + rest == tok.decode(ids) == text
    assert rest == ""                                              # nothing held back at a complete end
    written = ""
    for piece in pieces:
        assert REPLACEMENT not in piece                            # never half a character
        written += piece
        assert text.startswith(written)                            # never text that changes later
    if split:
        assert "" in pieces                                        # held back while a character was incomplete
    assert list(tok.decode_stream(iter(ids))) == [p for p in pieces if p]


@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory):
    return Tokenizer.load(save(byte_level_bpe(), tmp_path_factory.mktemp("byte_level_any")))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(data=st.data())
def test_stream_of_any_ids_equals_the_full_decode(data, byte_tok):
    """Any ids (bytes that never make a character too), on the byte-level tokenizer: the pieces are the full
    decode, and what was written is a prefix of it after every token."""
    tok = byte_tok
    ids = data.draw(st.lists(st.integers(0, len(tok.hf) - 1), max_size=24))
    pieces, rest = pieces_of(tok, ids)
    full = tok.decode(ids)
    assert "".join(pieces) + rest == full
    written = ""
    for piece in pieces:
        assert not piece.endswith(REPLACEMENT)
        written += piece
        assert full.startswith(written)


def test_stream_writes_an_incomplete_character_only_at_the_end(tok):
    ids = tok.encode("ok 🙂", add_special_tokens=False)
    cut = ids[:-1]                                                  # the emoji's last byte never made
    pieces, rest = pieces_of(tok, cut)
    assert "".join(pieces) == "ok "
    assert "".join(pieces) + rest == tok.decode(cut) and rest.endswith(REPLACEMENT)


class Words:
    """Words joined by spaces, cleaned up across tokens as clean_up_tokenization_spaces does (" ," -> ","), and
    "--" written as a dash: a piece's text depends on its neighbours."""

    words = {0: "a", 1: ",", 2: "b", 3: "-", 4: "-c"}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.words[i] for i in ids).replace(" ,", ",").replace("- -", "\u2014")


def test_stream_decodes_each_piece_with_its_neighbours():
    s = TextStream(Words())
    assert [s.add(i) for i in (0, 2, 1, 0)] == ["a", " b", ",", " a"] and s.finish() == ""
    assert s.text == Words().decode([0, 2, 1, 0]) == "a b, a"


def test_stream_holds_back_text_that_stops_extending_what_was_written():
    s = TextStream(Words())
    assert [s.add(i) for i in (0, 3, 4, 2)] == ["a", " -", "", ""]     # "a -" then "a \u2014c": held back
    assert s.finish() == "\u2014c b"                                    # the full decode's tail, at the end
    assert Words().decode([0, 3, 4, 2]) == "a \u2014c b"


def test_stream_takes_any_object_with_decode():
    class Bytes:
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    s = TextStream(Bytes())
    assert [s.add(b) for b in "aé€🙂!".encode()] == ["a", "", "é", "", "", "€", "", "", "", "🙂", "!"]
    assert s.finish() == "" and s.text == "aé€🙂!"


# --------------------------------------------------------------------------------------------- chat template
@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    return Tokenizer.load(save(byte_level_bpe(), tmp_path_factory.mktemp("chat"), chat_template=CHAT))


def test_chat_template_is_applied(chat_tok):
    assert chat_tok.has_chat_template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Où est 東京? 🙂"}]
    ids = chat_tok.apply_chat_template(messages)
    want = "<s>system: Be brief.\n<s>user: Où est 東京? 🙂\nassistant:"
    assert chat_tok.decode(ids, skip_special_tokens=False) == want
    assert ids == chat_tok.encode(want, add_special_tokens=False) and ids.count(1) == 2   # the template's BOS only
    assert chat_tok.decode(chat_tok.apply_chat_template(messages, add_generation_prompt=False),
                           skip_special_tokens=False) == want.removesuffix("assistant:")


def test_chat_template_refuses_messages_it_cannot_take(chat_tok):
    for bad, expected in [([], "messages: expected a non-empty list"), ("hi", "messages: expected a non-empty list"),
                          ([{"content": "hi"}], "messages[0]: expected {\"role\": str, \"content\": ...}")]:
        with pytest.raises(InputError) as e:
            chat_tok.apply_chat_template(bad)
        assert expected in str(e.value) and "\n" not in str(e.value)


def test_no_chat_template_is_one_line_error(tok):
    assert not tok.has_chat_template
    with pytest.raises(InputError) as e:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    msg = str(e.value)
    assert msg.startswith("chat template: expected a tokenizer with one (chat_template in tokenizer_config.json, or "
                          "chat_template.jinja), found none in \"") and str(tok.folder) in msg and "\n" not in msg


# ---------------------------------------------------------------------------------------------- loading
def test_load_errors_are_one_line(tmp_path, monkeypatch):
    assert not has_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    assert has_tokenizer(tmp_path)
    with pytest.raises(InputError) as e:
        Tokenizer.load(tmp_path, otherwise="send token ids")
    msg = str(e.value)
    assert msg.startswith(f"tokenizer: expected one transformers can load from \"{tmp_path}\", found: ")
    assert msg.endswith("; send token ids") and "\n" not in msg

    monkeypatch.setitem(sys.modules, "transformers", None)        # as without the [hf] extra
    with pytest.raises(InputError) as e:
        Tokenizer.load(tmp_path, who="server")
    assert str(e.value) == (f"server: needs transformers (pip install 'fastpipe[hf]') to read the tokenizer in "
                            f"\"{tmp_path}\", not installed")


# ------------------------------------------------------------------------------------- the package's names
def test_the_package_exports_its_names_lazily():
    import fastpipe.serving as serving

    assert sorted(serving.__all__) == sorted(serving._EXPORTS)
    for name in serving.__all__:
        obj = getattr(serving, name)
        assert obj.__module__ == f"fastpipe.serving.{serving._EXPORTS[name]}", name
    with pytest.raises(AttributeError):
        serving.nothing_here
    code = ("import sys, fastpipe.serving, fastpipe.serving.tokenizer\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr
