"""The live routers over a scripted backend that the tool and reasoning tests share
(test_router_tools.py, test_router_reasoning.py, test_router_tool_refusals.py): a pytest plugin
(`pytest_plugins = ["tests.scripted_chat_router"]` in each), so that one router per parsing
configuration, session-scoped, serves every test of the three. Import what the tests send and
ask from tests/scripted_chat.py, not from here.

The tokenizer is the tiny model's with a Qwen3.6-shaped template (tests/chat_templates.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.tokenizer import Tokenizer, load_tokenizer
from tests.chat_templates import QWEN_STYLE_TEMPLATE
from tests.scripted_chat import ScriptedRouters, scripted_routers_of


@pytest.fixture(scope="session")
def qwen_style_tokenizer(tiny_model_dir: Path) -> Tokenizer:
    """The tiny model's tokenizer with the Qwen3.6-shaped chat template."""
    tiny = load_tokenizer(tiny_model_dir)
    return Tokenizer(tiny.backend, tiny.eos_token_ids, QWEN_STYLE_TEMPLATE, tiny.special_tokens)


@pytest.fixture(scope="session")
def scripted_routers(qwen_style_tokenizer: Tokenizer) -> Iterator[ScriptedRouters]:
    """A live router per parsing configuration of CONFIGS, with the Qwen3.6-shaped template."""
    with scripted_routers_of(qwen_style_tokenizer) as out:
        yield out
