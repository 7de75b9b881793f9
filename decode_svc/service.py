"""The decode service: pulls each handed-over request's KV pages and GDN state from its prefill
instance (NIXL READ), then decodes it with every other running request and streams its tokens.

Request lifecycle:
  1. `decode` RPC (server streaming): validated, the prefill instance added as a transfer peer
     (handshake checks protocol version + compatibility hash) on first contact;
  2. transfer queue: waits for free KV pages + a state slot (admission control), then
     READs the prefill instance's pages/slot into its own;
  3. READ done (the prefill side is notified and frees its copy) -> running: the first token,
     sampled by prefill, is fed first; the state already holds every prompt token;
  4. each decode step streams {token_ids, text_delta, logprobs, finished, finish_reason};
     finished or the stream cancelled -> pages and slot freed.
A failed or timed-out READ ends the stream with an error and frees what was allocated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from kvtransfer import RequestPayload, TransferHandle, TransferState
from kvtransfer.payload import pool_units
from pdserve.engine.llm_engine import RequestOutput
from pdserve.engine.sequence import Sequence
from pdserve.rpc import RpcClient
from pdserve.sampling.params import SamplingParams
from pdserve.serving import EngineService, ServiceConfig

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DecodeConfig(ServiceConfig):
    """The one config object of a decode process."""

    transfer_timeout_s: float = 10.0
    # give up on a request that found no memory for this long; must stay below the prefill
    # side's handoff timeout, after which its copy of the state is gone
    admission_timeout_s: float = 30.0


@dataclass(slots=True)
class Pending:
    """A request in the transfer queue: waiting for memory, then for its READ."""

    seq: Sequence
    payload: RequestPayload
    peer: str
    first_token: int
    first_logprobs: list | None
    handle: TransferHandle | None = None
    pages: list[int] | None = None
    slot: int | None = None
    arrived: float = field(default_factory=time.monotonic)


class DecodeService(EngineService):
    def __init__(self, config: DecodeConfig) -> None:
        self.pending: dict[str, Pending] = {}
        self.streams: dict[str, asyncio.Queue] = {}
        self._peers: dict[str, str] = {}  # prefill agent name -> peer name
        self._peer_lock = asyncio.Lock()
        super().__init__(config, config.transfer_timeout_s)

    def load(self) -> dict:
        report = super().load()
        report["waiting"] += len(self.pending)
        return report

    # ---- RPC handler
    async def decode(self, msg: dict):
        rid = msg["request_id"]
        payload = RequestPayload(**msg["payload"])
        payload.check_pages(self.config.engine.page_size)
        peer = await self._peer(payload.prefill_agent, msg["prefill_address"])
        if rid in self.streams:  # a second stream must not take over (or cancel) the first
            raise ValueError(f"request id {rid!r} is already streaming here")
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = queue
        finished = False
        try:
            await self.thread.call(self._admit, msg, payload, peer)
            while not finished:
                event = await queue.get()
                if "error" in event:
                    raise RuntimeError(event["error"])
                finished = event["finished"]
                yield event
        finally:
            self.streams.pop(rid, None)
            if not finished:
                await self.thread.call(self._cancel, rid)

    async def _peer(self, agent_name: str, address: str) -> str:
        async with self._peer_lock:
            if agent_name not in self._peers:
                client = RpcClient(address, "pdserve.Prefill")
                try:
                    endpoint = await client.unary("endpoint", {}, timeout=10.0)
                finally:
                    await client.close()
                self._peers[agent_name] = await self.thread.call(self.agent.add_peer, endpoint)
            return self._peers[agent_name]

    # ---- on the engine thread
    def _admit(self, msg: dict, payload: RequestPayload, peer: str) -> None:
        params = SamplingParams(**msg["params"])
        seq = self.engine.make_sequence(msg["prompt_token_ids"], params, msg["request_id"])
        if payload.num_tokens != seq.num_prompt_tokens:
            raise ValueError(
                f"payload holds {payload.num_tokens} tokens, the prompt has {seq.num_prompt_tokens}"
            )
        self.pending[seq.request_id] = Pending(
            seq, payload, peer, msg["first_token"], msg.get("first_logprobs")
        )

    def _tick(self) -> bool:
        kv, states = self.engine.runner.kv_pool, self.engine.runner.state_pool
        for rid, p in list(self.pending.items()):
            if p.handle is None:
                need = len(p.payload.kv_pages)
                if need > kv.num_free or states.num_free == 0:  # admission control: wait for memory
                    if time.monotonic() - p.arrived > self.config.admission_timeout_s:
                        del self.pending[rid]
                        self._post(
                            rid, {"error": f"no memory for {rid} on {self.config.instance_id} in time"}
                        )
                    continue
                p.pages, p.slot = kv.allocate(need), states.allocate()
                try:
                    p.handle = self.agent.pull(
                        p.peer, rid, p.payload.remote_units(), pool_units(p.pages, p.slot)
                    )
                except Exception as e:  # a bad payload or a peer gone: this request only
                    del self.pending[rid]
                    self._free(p)
                    self._post(rid, {"error": f"cannot pull the state of {rid}: {e}"})
                    continue
            state = self.agent.poll(p.handle)
            if state is TransferState.TRANSFERRING:
                continue
            del self.pending[rid]
            self.agent.release(p.handle)
            if state is TransferState.FAILED:
                self._free(p)
                self._post(
                    rid, {"error": f"state transfer from {p.payload.prefill_agent} failed: {p.handle.error}"}
                )
                continue
            if p.first_logprobs:
                p.seq.logprobs.extend(p.first_logprobs)
            self.engine.admit_prefilled(p.seq, p.first_token, p.pages, p.slot)
            self._post(rid, self._transfer_event(p))
        return bool(self.pending)

    def _transfer_event(self, p: Pending) -> dict:
        return {
            "token_ids": [],
            "text_delta": "",
            "logprobs": None,
            "finished": False,
            "finish_reason": None,
            "transfer": {"bytes": p.handle.nbytes, "seconds": p.handle.seconds},
        }

    def _free(self, p: Pending) -> None:
        if p.pages is not None:
            self.engine.runner.kv_pool.free(p.pages)
        if p.slot is not None:
            self.engine.runner.state_pool.free(p.slot)

    def _cancel(self, rid: str) -> None:
        p = self.pending.pop(rid, None)
        if p is not None:
            if p.handle is not None:
                self.agent.release(p.handle)
            self._free(p)
        self.engine.abort(rid)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            event = {
                "token_ids": out.new_token_ids,
                "text_delta": out.text_delta,
                "logprobs": out.logprobs[-1:] if out.logprobs else None,
                "finished": out.finished,
                "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason,
            }
            self._post(out.request_id, event)

    def _on_error(self, request_ids: list[str], message: str) -> None:
        for rid in request_ids:
            self._post(rid, {"error": message})

    def _post(self, rid: str, event: dict) -> None:
        queue = self.streams.get(rid)
        if queue is not None:
            self._loop.call_soon_threadsafe(queue.put_nowait, event)
