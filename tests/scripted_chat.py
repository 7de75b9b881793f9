"""Chat requests to live routers over a scripted backend, for the tool and reasoning tests
(test_router_tools.py, test_router_reasoning.py, test_router_tool_refusals.py): the tools and
tool calls they send and expect, the parsing configurations, `scripted_routers_of` (a router per
configuration) and `ask`. The shared routers are tests/scripted_chat_router.py's fixtures.

The backend is scripted (the tiny random model never writes a tool call): it answers each request
with a set text, three characters an event, and remembers the requests (prompt ids, params)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Iterator

import openai

from pdserve.tokenizer import Tokenizer
from router.app import create_app
from router.backend import GenerateRequest, TokenEvent
from router.chat_output import ChatParsingConfig
from tests.live_server import serving

MODEL = "tiny-qwen36"
CHAT = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
TOOLS = [WEATHER, TIME]
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)
CONFIGS = {
    "qwen3_coder": ChatParsingConfig("qwen3_coder", "qwen3", enable_auto_tool_choice=True),
    "hermes": ChatParsingConfig("hermes", None, enable_auto_tool_choice=True),
    "plain": ChatParsingConfig(),
}


class ScriptedBackend:
    """Answers every request with `text`, three characters an event; keeps the requests."""

    def __init__(self) -> None:
        self.text = ""
        self.requests: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TokenEvent, None]:
        self.requests.append(req)
        pieces = [self.text[i : i + 3] for i in range(0, len(self.text), 3)] or [""]
        for k, piece in enumerate(pieces):
            last = k == len(pieces) - 1
            yield TokenEvent([7], piece, None, last, "stop" if last else None)

    async def health(self) -> dict:
        return {}

    def max_model_len(self) -> int:
        return 4096


ScriptedRouters = dict[str, tuple[openai.OpenAI, ScriptedBackend]]  # by parsing configuration


@contextlib.contextmanager
def scripted_routers_of(
    tokenizer: Tokenizer, names: tuple[str, ...] = tuple(CONFIGS)
) -> Iterator[ScriptedRouters]:
    """A live router for each named parsing configuration, each with its own scripted backend,
    and an `openai` client of it."""
    with contextlib.ExitStack() as stack:
        out: ScriptedRouters = {}
        for name in names:
            backend = ScriptedBackend()
            app = create_app(backend, tokenizer, MODEL, chat_parsing=CONFIGS[name])
            url = stack.enter_context(serving(app))
            out[name] = (openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30), backend)
        yield out


def ask(routers: ScriptedRouters, name: str, text: str, **kwargs: object) -> tuple[object, ScriptedBackend]:
    """A chat completion from router `name` whose backend answers `text`; and that backend."""
    client, backend = routers[name]
    backend.text = text
    return client.chat.completions.create(
        model=MODEL, messages=kwargs.pop("messages", CHAT), **kwargs
    ), backend


def joined_stream(chunks: list) -> dict:
    """A streamed answer joined as a client joins it: content, reasoning, calls by index."""
    out: dict = {"content": "", "reasoning": "", "calls": [], "finish": None, "first_call_chunks": []}
    for chunk in chunks:
        choice = chunk.choices[0]
        delta = choice.delta
        out["content"] += delta.content or ""
        out["reasoning"] += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or ():
            if call.index == len(out["calls"]):
                assert call.id.startswith("call_") and call.type == "function" and call.function.name, call
                out["calls"].append({"id": call.id, "name": call.function.name, "arguments": ""})
            out["calls"][call.index]["arguments"] += call.function.arguments or ""
        out["finish"] = choice.finish_reason or out["finish"]
    return out
