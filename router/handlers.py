"""The handlers of the generation routes (/v1/chat/completions, /v1/completions): `OpenAIRouter`.
router.app builds the app around them; steps 3-7 are router.generation's.

Request lifecycle (chat and completions alike):
  0. gate     router.gate, before the body is read: 413 body too large (chunked too), 401 API key,
              429 the key's concurrency limit
  1. parse    FastAPI + the pydantic models of router.protocol; bad JSON, types, ranges -> 400
  2. check    model name (any served name, else 404 model_not_found), logprobs within
              --max-logprobs, the unset sampling fields filled in (generation_config.json and
              --seed: pdserve.request_defaults), tools and tool_choice (router.tools), prompt
              -> token ids (chat template with the tools, router.chat_template; a text too
              long to fit max_model_len whatever its tokens is a 400 before it is tokenized;
              encode), length against max_model_len and max_tokens (a default capped by
              generation_config.json's max_new_tokens), SamplingParams (ValueError
              -> 400); a chat request's output parsing (router.chat_output: reasoning, tool
              calls), one parser per choice
  3. admit    router.admission: the request's generations join the queue of those waiting for a
              first token, or 503 + Retry-After when it is full
  4. fan out  one GenerateRequest per choice (prompt p, copy j: id "<response id>-<k>", seed + j),
              each pumped by a task into one merged queue (`router.fanout.Fanout`), followed by
              RouterMetrics
  5. first    wait for the first event of any choice (or for the client to leave, or the queue
              timeout: 503 + Retry-After): a BackendError now is a JSON error with the backend's
              status (400/500/503)
  6. answer   stream=false: collect until every choice finished -> one JSON body
              stream=true: SSE chunks (chat: a role chunk per choice, then deltas; each choice's
              last chunk has its finish_reason), a usage chunk with include_usage, `data: [DONE]`;
              a BackendError (or the queue timeout of a choice not started yet) mid-stream ->
              `data: {"error": {...}}`, then [DONE]
  7. cleanup  however it ends (done, error, timeout, client gone), `Fanout.close()` cancels the
              pumps (a backend generator closed early aborts its request and frees its memory) and
              the request leaves the queue
"""

from __future__ import annotations

from dataclasses import replace

from fastapi import Request, Response

from pdserve.request_defaults import SeedStream, choice_seed
from pdserve.tokenizer import Tokenizer
from router.admission import Admission
from router.api_flags import ApiOptions
from router.backend import Backend, GenerateRequest
from router.batch_encode import EncodeBatcher
from router.chat_output import ChatParsingConfig, OutputParsing, tags_decode_to_nothing
from router.chat_template import render_chat
from router.drain import Drain
from router.errors import BackendError, OpenAIError
from router.gate import arrival_of
from router.generation import Generations
from router.metrics import RouterMetrics
from router.prompt_chars import max_chars_per_token_async
from router.protocol import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from router.request_fields import check_token_ids
from router.response_formats import ChatFormat, CompletionFormat
from router.responses import ResponseFormat
from router.tools import resolve_tools, tool_choice_kind

MAX_CHOICES = 256  # prompts x n of one request (n=200 must work): a typo must not queue millions
ENCODE_INLINE_CHARS = 2_000  # longer texts (~500+ tokens) are tokenized on a worker thread


class OpenAIRouter:
    """The handlers behind the routes: turn requests into backend generations and answers."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: Tokenizer,
        names: tuple[str, ...],
        metrics: RouterMetrics,
        admission: Admission,
        drain: Drain,
        chat_parsing: ChatParsingConfig,
        api: ApiOptions,
    ) -> None:
        self.backend = backend
        self.chat_parsing = chat_parsing
        self.hidden_tags = tags_decode_to_nothing(tokenizer)
        self.drain = drain
        self.tokenizer = tokenizer
        self.encoder = EncodeBatcher(tokenizer)
        self.names = names  # every one is accepted in `model`
        self.model = names[0]  # the one answers carry
        self.api = api
        self.seeds = SeedStream(api.defaults.seed)
        self.metrics = metrics
        self.admission = admission
        self.generations = Generations(backend, metrics, admission, drain)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.names:
            served = ", ".join(f"`{name}`" for name in self.names)
            message = f"The model `{model}` does not exist (this server serves {served})."
            raise OpenAIError(message, 404, param="model", code="model_not_found")

    def fill_in(self, body: OpenAIRequest) -> None:
        """The request's unset sampling fields from the defaults (generation_config.json, --seed),
        after a 400 for logprobs beyond --max-logprobs."""
        asked = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
        for field in (asked, "prompt_logprobs"):
            value = getattr(body, field, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > self.api.max_logprobs:
                raise OpenAIError(
                    f"{field} is {value}, more than this server returns ({self.api.max_logprobs}, its "
                    "--max-logprobs)",
                    param=field,
                )
        for field, value in self.api.defaults.sampling_fields().items():
            if getattr(body, field) is None:
                setattr(body, field, value)
        if body.seed is None:
            body.seed = self.seeds.next_seed()

    async def encode(self, text: str, param: str, add_special_tokens: bool = False) -> list[int]:
        """Tokenize off the event loop, batched with the texts that arrive meanwhile
        (`router.batch_encode`: a burst of long prompts must not wait for each other, nor stall
        every other stream), unless the text is short or too long to fit whatever its tokens: a
        400 for `param` at once. (`add_special_tokens`: /tokenize's; a generation prompt is
        rendered with its own.)"""
        if len(text) < ENCODE_INLINE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        max_model_len = self.backend.max_model_len()
        chars_per_token = await max_chars_per_token_async(self.tokenizer)
        if chars_per_token is not None and len(text) > max_model_len * chars_per_token:
            raise OpenAIError(
                f"This model's maximum context length is {max_model_len} tokens, and a token covers at "
                f"most {chars_per_token} characters: a prompt of {len(text)} characters cannot fit. "
                "Please reduce the length of the prompt.",
                param=param,
            )
        return await self.encoder.encode(text, add_special_tokens)

    def chat_text(self, body: ChatCompletionRequest) -> tuple[str, list[dict] | None, bool]:
        """(the prompt text through the chat template, the tools it got, whether the output is
        parsed for tool calls)."""
        tools, parse_tools = resolve_tools(body.tools, body.tool_choice, self.chat_parsing)
        messages = body.template_messages()
        text = render_chat(
            self.tokenizer, messages, body.add_generation_prompt, tools, body.chat_template_kwargs
        )
        return text, tools, parse_tools

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = arrival_of(request)
        self.check_model(body.model)
        self.fill_in(body)
        text, tools, parse_tools = self.chat_text(body)
        parallel = body.parallel_tool_calls is not False
        named = tool_choice_kind(body.tool_choice, bool(tools)) == "named"
        parsing = OutputParsing.for_request(
            self.chat_parsing, text, tools, parse_tools, parallel, body.include_reasoning, named
        )
        if parsing.active and self.hidden_tags and "skip_special_tokens" not in body.model_fields_set:
            body.skip_special_tokens = False  # the parsers must see <think>, <tool_call>, ...
        fmt = ChatFormat(self.model, self.tokenizer, body.n, body.include_usage, parsing)
        return await self.serve(request, body, fmt, [(await self.encode(text, "messages"), "")], arrival)

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = arrival_of(request)
        self.check_model(body.model)
        self.fill_in(body)
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError("prompt must not be empty", param="prompt")
        prompts = []
        for item in prompt:
            ids = await self.encode(item, "prompt") if isinstance(item, str) else list(item)
            if not ids:
                raise OpenAIError("prompt must not be empty", param="prompt")
            check_token_ids(ids, self.tokenizer.vocab_size, "prompt")
            if not body.echo:
                echo = ""
            elif isinstance(item, str):
                echo = item
            else:  # vLLM's prompt text of token ids: special tokens kept, as the echoed logprobs show
                echo = self.tokenizer.decode(ids, skip_special_tokens=False)
            prompts.append((ids, echo))
        fmt = CompletionFormat(self.model, self.tokenizer, body.n, body.include_usage)
        return await self.serve(request, body, fmt, prompts, arrival)

    async def serve(
        self,
        request: Request,
        body: OpenAIRequest,
        fmt: ResponseFormat,
        prompts: list[tuple[list[int], str]],
        arrival: float,
    ) -> Response:
        """Step 2's limits and params, then steps 3-7 (router.generation); `prompts` are
        (token ids, echo text)."""
        if body.n * len(prompts) > MAX_CHOICES:
            raise OpenAIError(f"n x prompts must be at most {MAX_CHOICES}", param="n")
        max_model_len, vocab_size = self.backend.max_model_len(), self.tokenizer.vocab_size
        fmt.continuous_usage = body.continuous_usage
        requests, choices = [], []
        for ids, echo in prompts:
            max_tokens = body.max_tokens_for(len(ids), max_model_len)
            if body.requested_max_tokens() is None and self.api.defaults.max_tokens is not None:
                max_tokens = min(max_tokens, self.api.defaults.max_tokens)  # generation_config.json's
            try:
                params = body.sampling_params(max_tokens, vocab_size)
            except ValueError as e:  # SamplingParams names the field first: "top_p must be in (0, 1]"
                field = str(e).split(" ", 1)[0]
                raise OpenAIError(str(e), param=field if field in type(body).model_fields else None) from e
            for j in range(params.n):
                seed = None if params.seed is None else choice_seed(params.seed, j)
                req_id = f"{fmt.id}-{len(requests)}"
                requests.append(GenerateRequest(req_id, ids, replace(params, n=1, seed=seed)))
                choices.append(fmt.new_choice(len(choices), len(ids), echo))
        try:
            return await self.generations.answer(request, body.stream, fmt, requests, choices, arrival)
        except BackendError as e:  # the engine's compile error names its spec kind, not the field
            field = body.structured_field()
            if e.status != 400 or field is None or not e.message.startswith("structured_outputs "):
                raise
            raise OpenAIError(f"{field}: {e.message}", param=field) from e
