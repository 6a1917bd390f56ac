"""Tokenizers trained offline with the `tokenizers` library, saved as transformers saves them (no network)."""
from __future__ import annotations

from pathlib import Path

SPECIALS = ["<unk>", "<s>", "</s>"]


def byte_level_bpe(corpus: list[str], vocab_size: int):
    """GPT-2 / Llama 3 style: byte-level pre-tokenizer and decoder, merges trained on `corpus`, so every
    character outside it is one or more byte tokens."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    t = tokenizers.Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return t


def save_pretrained(t, folder: Path, chat_template: str | None = None):
    """`t` as a transformers fast tokenizer (<unk>, <s>, </s>), saved in `folder`; returns it."""
    import transformers

    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=t, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    if chat_template is not None:
        hf.chat_template = chat_template
    hf.save_pretrained(str(folder))
    return hf
