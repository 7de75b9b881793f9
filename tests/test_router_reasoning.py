"""Reasoning through the router, end to end with the `openai` client: `<think>` becomes
reasoning_content (streamed and not; the text as it is without a reasoning parser),
`enable_thinking: false` reaches the template, and a tokenizer that makes the tags special has
parsing requests decoded with them. The shared routers over a scripted backend:
tests/scripted_chat_router.py; `ask` and the stream joined: tests/scripted_chat.py."""

from __future__ import annotations

import copy

from tokenizers import AddedToken

from pdserve.tokenizer import Tokenizer
from tests.chat_templates import QWEN_STYLE_TEMPLATE
from tests.scripted_chat import CHAT, MODEL, ScriptedRouters, ask, joined_stream, scripted_routers_of

pytest_plugins = ["tests.scripted_chat_router"]  # the shared routers and tokenizer


def test_reasoning_content(scripted_routers: ScriptedRouters, qwen_style_tokenizer: Tokenizer) -> None:
    text = "The user wants a greeting.\n</think>\n\nHello!"
    answer, backend = ask(scripted_routers, "qwen3_coder", text)
    message = answer.choices[0].message
    assert (message.reasoning_content, message.content) == ("The user wants a greeting.", "Hello!")
    assert qwen_style_tokenizer.decode(
        backend.requests[-1].prompt_token_ids, skip_special_tokens=False
    ).endswith("<think>\n")
    client, _ = scripted_routers["qwen3_coder"]
    streamed = joined_stream(list(client.chat.completions.create(model=MODEL, messages=CHAT, stream=True)))
    assert (streamed["reasoning"], streamed["content"], streamed["finish"]) == (
        "The user wants a greeting.",
        "Hello!",
        "stop",
    )
    # without a reasoning parser the text is the content, as it is
    plain, _ = ask(scripted_routers, "plain", text)
    assert plain.choices[0].message.content == text
    # an answer cut off while still thinking has no content: null, as vLLM's parser answers
    thinking, _ = ask(scripted_routers, "qwen3_coder", "Still weighing it")
    assert (thinking.choices[0].message.reasoning_content, thinking.choices[0].message.content) == (
        "Still weighing it",
        None,
    )


def test_enable_thinking_false_reaches_the_template(
    scripted_routers: ScriptedRouters, qwen_style_tokenizer: Tokenizer
) -> None:
    answer, backend = ask(
        scripted_routers,
        "qwen3_coder",
        "Hello!",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    prompt = qwen_style_tokenizer.decode(backend.requests[-1].prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert (
        answer.choices[0].message.content == "Hello!" and answer.choices[0].message.reasoning_content is None
    )


def test_parsers_see_special_tags(scripted_routers: ScriptedRouters, qwen_style_tokenizer: Tokenizer) -> None:
    """The tiny tokenizer decodes <think> and <tool_call> as text, as Qwen's own: nothing to change;
    a tokenizer that makes them special has parsing requests decoded with skip_special_tokens=false."""
    _, backend = ask(scripted_routers, "qwen3_coder", "x")
    assert backend.requests[-1].params.skip_special_tokens is True
    hiding = copy.deepcopy(qwen_style_tokenizer.backend)  # the shared one stays as it is
    hiding.add_special_tokens(  # the same added tokens, each special now
        [
            AddedToken(t.content, single_word=t.single_word, lstrip=t.lstrip, rstrip=t.rstrip,
                       normalized=t.normalized, special=True)
            for t in hiding.get_added_tokens_decoder().values()
        ]
    )  # fmt: skip
    assert all(t.special for t in hiding.get_added_tokens_decoder().values())
    special = Tokenizer(
        hiding,
        qwen_style_tokenizer.eos_token_ids,
        QWEN_STYLE_TEMPLATE,
        qwen_style_tokenizer.special_tokens,
    )
    with scripted_routers_of(special, ("qwen3_coder", "plain")) as hidden:
        _, backend = ask(hidden, "qwen3_coder", "x")
        assert backend.requests[-1].params.skip_special_tokens is False
        _, backend = ask(hidden, "qwen3_coder", "x", extra_body={"skip_special_tokens": True})
        assert backend.requests[-1].params.skip_special_tokens is True  # what the client says wins
        _, backend = ask(hidden, "plain", "x")
        assert backend.requests[-1].params.skip_special_tokens is True
