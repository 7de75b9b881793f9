"""The flags of the OpenAI front, with `vllm serve`'s names: `pdserve router` reads them and
`pdserve up` passes them on to its router (`api_argv`).

    MODEL (positional) / --model      the model folder; the default served name, as typed
    --served-model-name NAME [NAME ...]
                                      every name is accepted in `model`; /v1/models lists them
                                      all; answers carry the first
    --generation-config auto|vllm|DIR sampling defaults from generation_config.json
                                      (pdserve.request_defaults)
    --seed N                          seeds the requests that set none (pdserve.request_defaults)
    --max-logprobs N                  the most logprobs / top_logprobs / prompt_logprobs a request
                                      may ask (default 20; more is a 400 naming the field)
    --chat-template FILE|TEMPLATE     replaces the model's chat template
    --disable-uvicorn-access-log, --disable-log-requests
                                      no access log line per request (the default: one, uvicorn's)
    --tool-call-parser, --reasoning-parser, --enable-auto-tool-choice (router.chat_output)
    --allowed-origins, --allowed-methods, --allowed-headers JSON-LIST, --allow-credentials
                                      CORS, as vLLM's (default: any origin, method and header;
                                      no credentials): a browser's preflight is answered before
                                      the API key is asked for

`ApiOptions` is what create_app takes of them beside the served names.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field

from pdserve.request_defaults import RequestDefaults
from pdserve.sampling.params import MAX_LOGPROBS
from router.chat_output import add_arguments as add_chat_parsing_arguments

# flags with a value that `pdserve up` passes on when set (dest -> flag)
VALUE_FLAGS = {
    "generation_config": "--generation-config",
    "seed": "--seed",
    "max_logprobs": "--max-logprobs",
    "chat_template": "--chat-template",
    "tool_call_parser": "--tool-call-parser",
    "reasoning_parser": "--reasoning-parser",
    "allowed_origins": "--allowed-origins",
    "allowed_methods": "--allowed-methods",
    "allowed_headers": "--allowed-headers",
}
SWITCHES = {
    "disable_uvicorn_access_log": "--disable-uvicorn-access-log",
    "disable_log_requests": "--disable-log-requests",
    "enable_auto_tool_choice": "--enable-auto-tool-choice",
    "allow_credentials": "--allow-credentials",
}
ANY = ("*",)


@dataclass(frozen=True, slots=True)
class ApiOptions:
    """How the API presents the model and fills in requests."""

    model_root: str | None = None  # /v1/models' "root": the model as given (None: the first name)
    defaults: RequestDefaults = field(default_factory=RequestDefaults)
    max_logprobs: int = MAX_LOGPROBS
    allowed_origins: tuple[str, ...] = ANY  # CORS (Starlette's CORSMiddleware)
    allowed_methods: tuple[str, ...] = ANY
    allowed_headers: tuple[str, ...] = ANY
    allow_credentials: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"--max-logprobs must be in [0, {MAX_LOGPROBS}] (the engine's most)")


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    """The model as the first positional argument (`pdserve up MODEL`), beside --model."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model folder")


def model_from_args(args: argparse.Namespace) -> str | None:
    """The model given as MODEL or --model (a ValueError when both differ); None if neither."""
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"the model is given twice: {args.model_tag} and --model {args.model}")
    return args.model_tag if args.model_tag is not None else args.model


def add_api_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of the module doc but MODEL and --model."""
    group = parser.add_argument_group("OpenAI API")
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="names clients use in `model`; answers carry the first (default: the model as typed)",
    )
    group.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="sampling defaults: auto (the model's generation_config.json), vllm (none) or a folder's",
    )
    group.add_argument(
        "--seed", type=int, default=None, help="seed the requests that set no seed (a run repeats)"
    )
    group.add_argument(
        "--max-logprobs",
        type=int,
        default=MAX_LOGPROBS,
        help=f"most logprobs a request may ask ({MAX_LOGPROBS})",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (a file or inline)",
    )
    group.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no access log line per request"
    )
    group.add_argument("--disable-log-requests", action="store_true", help="no access log line per request")
    add_chat_parsing_arguments(group)
    for name, what in (("origins", "origins"), ("methods", "HTTP methods"), ("headers", "request headers")):
        group.add_argument(
            f"--allowed-{name}",
            type=json_list,
            default=None,
            metavar="JSON-LIST",
            help=f'CORS: the {what} browsers may use, a JSON list (default ["*"])',
        )
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")


def json_list(value: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's form: '["https://a.example"]')."""
    try:
        items = json.loads(value)
    except ValueError:
        items = None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return items


def api_options_from_args(args: argparse.Namespace, model: str) -> ApiOptions:
    defaults = RequestDefaults.load(model, args.generation_config, args.seed)
    return ApiOptions(
        model_root=model,
        defaults=defaults,
        max_logprobs=args.max_logprobs,
        allowed_origins=tuple(args.allowed_origins or ANY),
        allowed_methods=tuple(args.allowed_methods or ANY),
        allowed_headers=tuple(args.allowed_headers or ANY),
        allow_credentials=args.allow_credentials,
    )


def served_names(args: argparse.Namespace, model: str) -> tuple[str, ...]:
    """--served-model-name's names, or the model as typed."""
    names = tuple(args.served_model_name or (model,))
    if any(not name for name in names) or len(set(names)) < len(names):
        raise ValueError("--served-model-name: names must be non-empty and distinct")
    return names


def access_log(args: argparse.Namespace) -> bool:
    return not (args.disable_uvicorn_access_log or args.disable_log_requests)


def api_argv(args: argparse.Namespace) -> list[str]:
    """The flags of `add_api_arguments` that differ from their defaults, for a child router."""
    argv: list[str] = []
    if args.served_model_name:
        argv += ["--served-model-name", *args.served_model_name]
    defaults = {"generation_config": "auto", "max_logprobs": MAX_LOGPROBS}
    for dest, flag in VALUE_FLAGS.items():
        value = getattr(args, dest)
        if value is not None and value != defaults.get(dest):
            text = json.dumps(value) if isinstance(value, list) else value
            argv += [f"{flag}={text}"]  # one argument: an inline template may start with "-"
    argv += [flag for dest, flag in SWITCHES.items() if getattr(args, dest)]
    return argv
