"""fastpipe's OpenAI routes inside your own app: python examples/server.py SERVING_SET  (`fastpipe serve` runs them alone)."""
import sys

import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Mount, Route

from fastpipe.server import ServerSettings, make_app
from fastpipe.serving import Engine, Tokenizer


def build(folder: str) -> Starlette:
    llm = make_app(Engine(folder), Tokenizer.load(folder), ServerSettings(model_name="my-model"))
    return Starlette(routes=[Route("/", lambda request: PlainTextResponse("my app")), Mount("/llm", app=llm)])


if __name__ == "__main__":
    uvicorn.run(build(sys.argv[1]), port=8000)     # POST localhost:8000/llm/v1/chat/completions
