"""Seeded OpenAI traffic for the soak test (tests/test_soak.py): closed-loop clients that send a
mix of chat and completion requests, streamed or not, n of 1-3, random max_tokens, and about a
quarter of them leave at a random moment (a stream closed after a few events, or a client
timeout shorter than the answer). Each request ends as one `Outcome`; nothing here asserts.

    outcomes = await client_loops(url, "tiny", clients=64, seconds=120, seed=0, hang_s=60)

Kinds of outcome: "ok" (a complete, well-formed answer), "refused" (503 with Retry-After: the
client waits that long, then goes on), "left" (the client disconnected on purpose), "hung" (no
end within `hang_s`), "bad" (any other status, a 503 without Retry-After, a malformed answer or
stream, an error event in a stream): `detail` says what.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

WORDS = ["rivers", "GPUs", "owls", "tea", "clocks", "moss", "ships", "bees", "maps", "salt"]
PROMPTS = [f"Soak prompt {i}: tell me about {w}" for i, w in enumerate(WORDS)]
PROMPTS += [" ".join(PROMPTS) * 3 + f" Finally, {w}?" for w in WORDS[:4]]  # ~300 tokens, shared prefix
MAX_TOKENS = 48
LEAVE_SHARE = 0.25
ADMISSION_CODES = ("queue_full", "queue_timeout")  # router.admission's 503s


@dataclass(slots=True)
class Outcome:
    kind: str  # ok | refused | left | hung | bad
    seconds: float
    status: int | None = None
    detail: str = ""
    retry_after: float = 0.0  # of a "refused"
    key: tuple = ()  # what determines the texts: (path, prompt, max_tokens, temperature, seed, ignore_eos)
    texts: list[str] = field(default_factory=list)  # per choice index, for "ok"


@dataclass(slots=True)
class Plan:
    """One request: where, what, and how the client leaves (if it does)."""

    path: str
    body: dict
    leave_after_events: int | None = None  # stream: close after this many SSE events
    leave_after_s: float | None = None  # give up (disconnect) after this long

    @property
    def choices(self) -> int:
        return self.body["n"]

    @property
    def key(self) -> tuple:
        b = self.body
        prompt = b["messages"][0]["content"] if "messages" in b else b["prompt"]
        return (self.path, prompt, b["max_tokens"], b["temperature"], b.get("seed"), b["ignore_eos"])


def plan_request(rng: random.Random, model: str) -> Plan:
    chat = rng.random() < 0.5
    prompt = rng.choice(PROMPTS)
    body: dict = {
        "model": model,
        "max_tokens": rng.randint(1, MAX_TOKENS),
        "n": rng.choices([1, 2, 3], weights=[7, 2, 1])[0],
        "stream": rng.random() < 0.5,
        "ignore_eos": rng.random() < 0.7,
        "temperature": rng.choice([0.0, 0.0, 0.8]),
    }
    if body["temperature"]:
        body["seed"] = rng.randrange(1000)
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    body |= {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    plan = Plan("/v1/chat/completions" if chat else "/v1/completions", body)
    if rng.random() < LEAVE_SHARE:
        if body["stream"] and rng.random() < 0.5:
            plan.leave_after_events = rng.randint(0, body["max_tokens"])
        else:
            plan.leave_after_s = rng.uniform(0.01, 3.0)
    return plan


def check_json(plan: Plan, answer: dict) -> tuple[str, list[str]]:
    """("" or what is wrong, texts by choice index) of a non-streamed answer."""
    choices = sorted(answer.get("choices", []), key=lambda c: c["index"])
    if [c["index"] for c in choices] != list(range(plan.choices)):
        return f"choice indexes {[c['index'] for c in choices]}", []
    chat = "messages" in plan.body
    texts = [c["message"]["content"] if chat else c["text"] for c in choices]
    reasons = [c["finish_reason"] for c in choices]
    return _check_ends(plan, reasons, answer.get("usage")), texts


def check_stream(plan: Plan, events: list[str]) -> tuple[str, list[str]]:
    """("" or what is wrong, texts by choice index) of a complete SSE stream (its data lines)."""
    if not events or events[-1] != "[DONE]":
        return f"stream does not end with [DONE]: {events[-2:]}", []
    texts, reasons, usage = [""] * plan.choices, [None] * plan.choices, None
    for data in events[:-1]:
        chunk = json.loads(data)
        if "error" in chunk:
            return f"error event: {chunk['error']}", []
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            i = c["index"]
            texts[i] += (c["delta"].get("content") or "") if "delta" in c else c["text"]
            reasons[i] = c["finish_reason"] or reasons[i]
    if plan.body.get("stream_options") is None:
        usage = {}  # not asked for: nothing to compare
    return _check_ends(plan, reasons, usage), texts


def admission_event(events: list[str]) -> str | None:
    """The code of a stream's admission error event (the form a 503 takes once a stream started)."""
    if len(events) < 2 or events[-1] != "[DONE]":
        return None
    error = json.loads(events[-2]).get("error") or {}
    return error["code"] if error.get("code") in ADMISSION_CODES else None


def _check_ends(plan: Plan, reasons: list, usage: dict | None) -> str:
    if any(r not in ("stop", "length") for r in reasons):
        return f"finish reasons {reasons}"
    if plan.body["ignore_eos"] and set(reasons) != {"length"}:
        return f"ignore_eos but finish reasons {reasons}"
    if usage is None:
        return "no usage"
    if (
        usage
        and plan.body["ignore_eos"]
        and usage["completion_tokens"] != plan.choices * plan.body["max_tokens"]
    ):
        return f"usage {usage} for {plan.choices} x {plan.body['max_tokens']} tokens"
    return ""


async def send(client: httpx.AsyncClient, plan: Plan) -> Outcome:
    """Send one planned request and read it to its end (or leave as planned)."""
    start = time.monotonic()
    events: list[str] = []
    async with client.stream("POST", plan.path, json=plan.body) as response:
        if response.status_code != 200:
            await response.aread()
            retry_after = response.headers.get("retry-after")
            seconds = time.monotonic() - start
            if response.status_code == 503 and retry_after is not None:
                code = json.loads(response.text)["error"]["code"]
                return Outcome(
                    "refused",
                    seconds,
                    503,
                    f"{code}, Retry-After {retry_after}",
                    retry_after=float(retry_after),
                )
            return Outcome("bad", seconds, response.status_code, response.text[:500])
        if plan.leave_after_events == 0:
            return Outcome("left", time.monotonic() - start, 200, "after the headers")
        if not plan.body["stream"]:
            problem, texts = check_json(plan, json.loads(await response.aread()))
        else:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                if plan.leave_after_events is not None and len(events) >= plan.leave_after_events:
                    return Outcome("left", time.monotonic() - start, 200, f"after {len(events)} events")
            problem, texts = check_stream(plan, events)
    seconds = time.monotonic() - start
    if code := admission_event(events):  # the queue timeout of a choice not started: a 503 mid-stream
        return Outcome("refused", seconds, 200, f"{code} mid-stream", retry_after=1.0)
    if problem:
        return Outcome("bad", seconds, 200, problem)
    return Outcome("ok", seconds, 200, key=plan.key, texts=texts)


async def send_bounded(client: httpx.AsyncClient, plan: Plan, hang_s: float) -> Outcome:
    """`send` under the plan's own patience (a planned disconnect) and the hang bound."""
    start = time.monotonic()
    patience = hang_s if plan.leave_after_s is None else min(plan.leave_after_s, hang_s)
    try:
        return await asyncio.wait_for(send(client, plan), patience)
    except TimeoutError:
        seconds = time.monotonic() - start
        if plan.leave_after_s is not None and patience < hang_s:
            return Outcome("left", seconds, None, f"timeout {patience:.2f} s")
        return Outcome("hung", seconds, None, f"{plan.path} {json.dumps(plan.body)[:300]}")
    except (httpx.HTTPError, ValueError, KeyError) as e:  # connection reset, bad JSON, missing field
        return Outcome("bad", time.monotonic() - start, None, f"{type(e).__name__}: {e}")


async def client_loops(
    url: str, model: str, clients: int, seconds: float, seed: int, hang_s: float
) -> list[Outcome]:
    """`clients` closed loops against `url` for `seconds` (each finishes its last request)."""
    outcomes: list[Outcome] = []
    stop = time.monotonic() + seconds

    async def loop(client: httpx.AsyncClient, i: int) -> None:
        rng = random.Random(seed * 10_000 + i)
        while time.monotonic() < stop:
            outcome = await send_bounded(client, plan_request(rng, model), hang_s)
            outcomes.append(outcome)
            if outcome.kind == "refused":
                await asyncio.sleep(outcome.retry_after * rng.uniform(0.5, 1.5))

    limits = httpx.Limits(max_connections=2 * clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=hang_s, limits=limits) as client:
        await asyncio.gather(*(loop(client, i) for i in range(clients)))
    return outcomes
