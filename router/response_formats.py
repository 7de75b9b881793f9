"""The two `ResponseFormat`s: `ChatFormat` (messages, reasoning and tool-call parsing, chat
logprobs) and `CompletionFormat` (text, echo, completions logprobs). See router.responses."""

from __future__ import annotations

from pdserve.tokenizer import Tokenizer
from router.backend import TokenEvent
from router.chat_output import OutputParsing
from router.logprob_formats import chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from router.responses import Choice, ResponseFormat


class ChatFormat(ResponseFormat):
    id_prefix, object_name, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(
        self,
        model: str,
        tokenizer: Tokenizer,
        n: int,
        include_usage: bool = False,
        parsing: OutputParsing | None = None,
    ) -> None:
        super().__init__(model, tokenizer, n, include_usage)
        self.parsing = parsing or OutputParsing()

    def new_choice(self, index: int, prompt_tokens: int, prefix: str = "") -> Choice:
        choice = super().new_choice(index, prompt_tokens, prefix)
        choice.parser = self.parsing.new_parser()
        return choice

    def event_chunk(self, choice: Choice, event: TokenEvent) -> dict | None:
        parser = choice.parser
        if parser is None:
            return super().event_chunk(choice, event)
        parsed = parser.feed(event.text_delta)
        if event.finished:
            parsed.extend(parser.finish())
        delta = parsed.as_openai()
        if not (delta or event.logprobs or event.finished or event.prompt_logprobs is not None):
            return None
        if event.logprobs and not delta:
            delta = {"content": ""}
        logprobs = None if event.logprobs is None else self.logprobs(choice, event.logprobs)
        reason = parser.finish_reason(event.finish_reason)
        chunk = self.one_choice_chunk(choice.index, {"delta": delta}, logprobs, reason, event.stop_reason)
        if event.prompt_logprobs is not None:
            self.add_prompt_logprobs(chunk, [choice])
        return chunk

    def add_prompt_logprobs(self, body: dict, choices: list[Choice]) -> None:
        """Chat answers carry the prompt's logprobs once, at the top (vLLM's place): one prompt."""
        entries = next((c.prompt_logprobs for c in choices if c.prompt_logprobs is not None), None)
        if entries is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(self.token_text, entries)

    def final_choice(self, choice: Choice) -> dict:
        out = super().final_choice(choice)
        if (parser := choice.parser) is not None:
            parser.feed(choice.text)
            parser.finish()
            out["message"], out["finish_reason"] = (
                parser.message(),
                parser.finish_reason(choice.finish_reason),
            )
        return out

    def head_chunks(self, choices: list[Choice]) -> list[dict]:
        return [
            self.one_choice_chunk(c.index, {"delta": {"role": "assistant", "content": ""}}) for c in choices
        ]

    def delta(self, event: TokenEvent) -> dict:
        return {"delta": {"content": event.text_delta} if event.text_delta or event.logprobs else {}}

    def message(self, choice: Choice) -> dict:
        return {"message": {"role": "assistant", "content": choice.text}}

    def logprobs(self, choice: Choice, entries: list[dict]) -> dict:
        return chat_logprobs(self.token_text, entries)


class CompletionFormat(ResponseFormat):
    id_prefix, object_name, chunk_object = "cmpl", "text_completion", "text_completion"

    def new_choice(
        self, index: int, prompt_tokens: int, prefix: str = "", echo: bool | None = None
    ) -> Choice:
        """`prefix`: the prompt's text when the request echoes it (`echo`: None says so by a
        non-empty prefix)."""
        choice = super().new_choice(index, prompt_tokens, prefix)
        choice.echo = bool(prefix) if echo is None else echo
        return choice

    def delta(self, event: TokenEvent) -> dict:
        return {"text": event.text_delta}

    def message(self, choice: Choice) -> dict:
        return {"text": choice.prefix + choice.text}

    def logprobs(self, choice: Choice, entries: list[dict]) -> dict:
        """The legacy format; advances `choice.text_offset` over the tokens' text."""
        out, choice.text_offset = completion_logprobs(self.token_text, entries, choice.text_offset)
        return out
