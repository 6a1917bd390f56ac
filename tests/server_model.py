"""A tiny llama with a real tokenizer, built into a serving set: what the server's tests and benchmark serve.

The tokenizer is a byte-level BPE (as GPT-2 and Llama 3 have) trained offline with the `tokenizers` library
and saved as transformers saves one, with a chat template; the model's vocabulary is the tokenizer's, its
EOS the tokenizer's "</s>". Random weights (seeded): greedy text is deterministic gibberish, mixing ASCII
and multi-byte characters.
"""
from __future__ import annotations

from pathlib import Path

import torch

CORPUS = ["the quick brown fox jumps over the lazy dog", "Hello world, a naive cafe, once upon a time",
          "Crème brûlée and 東京 🙂 are not in every corpus", "assistant: user: system: hello there"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def make_tokenizer(folder: Path, *, chat_template: str | None = CHAT_TEMPLATE):
    from tests.offline_tokenizers import byte_level_bpe, save_pretrained

    return save_pretrained(byte_level_bpe(CORPUS * 4, vocab_size=320), folder, chat_template)


def make_model(folder: Path, *, seed: int = 3, layers: int = 2, hidden: int = 64):
    """(the model, its tokenizer) saved in `folder`: a llama whose vocabulary is the tokenizer's."""
    import transformers

    from fastpipe.builder.hf.random_checkpoint import save_random_checkpoint

    folder.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(folder)
    config = transformers.LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=2 * hidden, vocab_size=len(tok),
                                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                      max_position_embeddings=512)
    model = save_random_checkpoint(config, folder, seed=seed).eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.save_pretrained(str(folder))
    return model, tok


def build_set(model_folder: Path, out: Path, *, max_len: int = 64, batches=(8,), prompt_lens=(16, 32), tp: int = 1):
    from fastpipe.serving.build import build_serving_set

    build_serving_set(model_folder, out, max_len=max_len, batches=batches, prompt_lens=prompt_lens, tp=tp)
    return out


def hf_greedy(model, ids: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """transformers' own greedy generate: the new tokens (ending at EOS, which is kept)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


class ServerThread:
    """`app` served by uvicorn on a free localhost port in a thread of this process (no signal handlers):
    `url`, then stop()."""

    def __init__(self, app):
        import threading
        import time

        from fastpipe.server.run import bind, run_loop, server_for

        self.app = app
        sock = bind("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = server_for(app, grace=app.state.fastpipe.settings.grace)
        self.thread = threading.Thread(target=lambda: run_loop(self.server.serve(sockets=[sock]), self.server.config),
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)

    @property
    def state(self):
        return self.app.state.fastpipe

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
