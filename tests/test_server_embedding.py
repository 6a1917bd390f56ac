"""examples/server.py: fastpipe's OpenAI routes mounted inside another Starlette app, answering beside its own."""
import asyncio
import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("starlette")
httpx = pytest.importorskip("httpx")

from fastpipe.serving.tokenizer import Tokenizer  # noqa: E402
from tests.server_model import build_set, make_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_the_embedding_example_serves_beside_the_host_apps_routes(tmp_path):
    make_model(tmp_path / "model")
    folder = build_set(tmp_path / "model", tmp_path / "set", max_len=64, batches=(4,), prompt_lens=(16,))
    spec = importlib.util.spec_from_file_location("server_example", ROOT / "examples" / "server.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    app = example.build(str(folder))
    engine = app.routes[1].app.state.fastpipe.engine

    async def calls():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as h:
            own = await h.get("/")
            models = await h.get("/llm/v1/models")
            chat = await h.post("/llm/v1/chat/completions", json={
                "model": "my-model", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
                "temperature": 0})
            return own, models, chat

    try:
        own, models, chat = asyncio.run(calls())
        assert own.text == "my app"
        assert [m["id"] for m in models.json()["data"]] == ["my-model"]
        tok = Tokenizer.load(folder)
        want = engine.generate([tok.apply_chat_template([{"role": "user", "content": "hello"}])], max_new_tokens=6)[0]
        assert chat.json()["choices"][0]["message"]["content"] == tok.decode(want)
    finally:
        engine.close(cancel=True)
