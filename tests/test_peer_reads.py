"""pdserve.peer_reads, the one READ loop of the decode role and the prefix cache: a done READ
releases its handle and calls back once, a failed one (or one that cannot start) forgets the
peer, a cancelled one never calls back; the holder's answer comes back, and a holder that
cannot answer is an answer of None with why (never a lost exception, never a hang)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from kvtransfer import POOL_UNIT_DIMS, LocalCopyAgent, TransferState, pool_units
from pdserve.peer_reads import PeerReads
from pdserve.rpc import RpcError

MODEL, PAGE = "qwen3_5_moe_text:test", 4


def pools(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "kv": torch.randn(2, 2, 8, PAGE, 2, 4, generator=g),
        "conv": torch.randn(2, 3, 8, 3, generator=g),
        "recurrent": torch.randn(2, 3, 2, 4, 4, generator=g),
    }


class FakePeers:
    """A peer directory whose holders answer from `answers` (an exception is raised)."""

    def __init__(self, answers: dict[str, object]) -> None:
        self.answers = answers
        self.forgotten: list[str] = []
        self.calls: list[tuple[str, str, dict]] = []

    def forget(self, agent: str) -> None:
        self.forgotten.append(agent)

    def client(self, agent: str) -> SimpleNamespace:
        async def unary(method: str, msg: dict, timeout: float) -> object:
            self.calls.append((agent, method, msg))
            answer = self.answers[agent]
            if isinstance(answer, BaseException):
                raise answer
            return answer

        if agent not in self.answers:
            raise LookupError(f"agent {agent!r} is not connected")
        return SimpleNamespace(unary=unary)


def reader(name: str, peers: FakePeers, loop: asyncio.AbstractEventLoop | None = None) -> PeerReads:
    agent = LocalCopyAgent(name, pools(2), POOL_UNIT_DIMS, MODEL, PAGE)
    host = SimpleNamespace(agent=agent, loop=loop, thread=SimpleNamespace(post=lambda fn, *a: fn(*a)))
    return PeerReads(host, peers)


def test_done_read_copies_calls_back_once_and_releases() -> None:
    holder = LocalCopyAgent("holder-a", pools(1), POOL_UNIT_DIMS, MODEL, PAGE)
    peers = FakePeers({})
    reads = reader("reader-a", peers)
    peer = reads.host.agent.add_peer(holder.endpoint())
    done, failed = [], []
    started = reads.start(
        "r1", "holder-a", peer, pool_units([5, 1], 2), pool_units([0, 7], 1), done.append, failed.append
    )
    assert started and len(reads) == 1
    assert reads.tick() is False and len(reads) == 0
    assert [h.state for h in done] == [TransferState.DONE] and failed == []
    assert done[0].xfer is None  # released
    assert torch.equal(reads.host.agent.pools["kv"][:, :, 7], holder.pools["kv"][:, :, 1])
    assert holder.take_done_notifications() == ["r1"]
    reads.tick()
    assert len(done) == 1 and peers.forgotten == []
    # a second read of an id in flight does not start: its caller hears why (and frees its
    # memory), the first goes on, the peer is not forgotten
    assert reads.start(
        "r2", "holder-a", peer, pool_units([1], 0), pool_units([1], 0), done.append, failed.append
    )
    assert not reads.start(
        "r2", "holder-a", peer, pool_units([2], 1), pool_units([2], 1), done.append, failed.append
    )
    assert len(failed) == 1 and "still in flight" in failed[0] and len(reads) == 1
    while reads.tick():
        pass
    assert len(done) == 2 and len(failed) == 1 and peers.forgotten == []


def test_a_dead_peer_is_forgotten_whether_the_read_fails_or_cannot_start() -> None:
    holder = LocalCopyAgent("holder-b", pools(1), POOL_UNIT_DIMS, MODEL, PAGE)
    peers = FakePeers({})
    reads = reader("reader-b", peers)
    peer = reads.host.agent.add_peer(holder.endpoint())
    done, failed = [], []
    del holder  # the holder dies: its READ fails
    assert reads.start(
        "r1", "holder-b", peer, pool_units([1], 0), pool_units([1], 0), done.append, failed.append
    )
    reads.tick()
    assert done == [] and len(failed) == 1 and "READ failed" in failed[0] and "gone" in failed[0]
    assert peers.forgotten == ["holder-b"] and len(reads) == 0
    # a peer the agent does not know (dropped meanwhile): the READ cannot start
    assert not reads.start(
        "r2", "holder-x", "nobody", pool_units([1], 0), pool_units([1], 0), done.append, failed.append
    )
    assert "cannot start" in failed[1] and peers.forgotten == ["holder-b", "holder-x"] and len(reads) == 0


def test_a_cancelled_read_never_calls_back() -> None:
    holder = LocalCopyAgent("holder-c", pools(1), POOL_UNIT_DIMS, MODEL, PAGE)
    reads = reader("reader-c", FakePeers({}))
    peer = reads.host.agent.add_peer(holder.endpoint())
    calls: list[object] = []
    reads.start("r1", "holder-c", peer, pool_units([1], 0), pool_units([1], 0), calls.append, calls.append)
    assert reads.cancel("r1") and not reads.cancel("r1")
    reads.tick()
    assert calls == [] and len(reads) == 0


def test_the_holders_answer_or_why_there_is_none() -> None:
    async def scenario() -> list[tuple[str, dict | None, str]]:
        peers = FakePeers({"ok": {"intact": True}, "refuses": RpcError("ABORTED", "no"), "odd": [1]})
        reads = reader("reader-d", peers, asyncio.get_running_loop())
        answers: list[tuple[str, dict | None, str]] = []
        for agent in ("ok", "refuses", "odd", "unknown"):
            reads.let_go(
                agent,
                "release",
                {"lease_id": "x"},
                then=lambda a, w, agent=agent: answers.append((agent, a, w)),
            )
        reads.let_go("refuses", "unpin_prefix", {"pin_id": "p"})  # no `then`: a warning, no error
        for _ in range(50):
            if len(answers) == 4:
                break
            await asyncio.sleep(0.01)
        return sorted(answers, key=lambda a: a[0])

    answers = asyncio.run(scenario())
    assert [a[0] for a in answers] == ["odd", "ok", "refuses", "unknown"]
    assert answers[1][1:] == ({"intact": True}, "")
    assert answers[0][1] is None and "malformed" in answers[0][2]
    assert answers[2][1] is None and "no" in answers[2][2]
    assert answers[3][1] is None and "not connected" in answers[3][2]
