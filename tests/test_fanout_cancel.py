"""router.fanout.cancel: a cancelled task is held until its cancellation has run (its finally
blocks with it), then let go. The soak's router once logged 'Task was destroyed but it is
pending!' for a non-streaming request whose client left (collect_choices, cancelled inside
Ticket.next's wait_for and referenced by no one); that collection is not reproduced here, the
holding that prevents it is."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from router import fanout


async def _waits_forever(cleaned: list[str]) -> None:
    try:
        await asyncio.wait_for(asyncio.Event().wait(), timeout=60)  # as Ticket.next waits
    finally:
        cleaned.append("finally ran")


def test_a_cancelled_task_held_by_no_one_finishes_its_cleanup(caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> list[str]:
        cleaned: list[str] = []
        task = asyncio.ensure_future(_waits_forever(cleaned))
        await asyncio.sleep(0)  # it is waiting now
        fanout.cancel(task)
        assert task in fanout._CANCELLING
        del task
        gc.collect()
        for _ in range(10):
            await asyncio.sleep(0)
        assert not fanout._CANCELLING  # let go once done
        return cleaned

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        assert asyncio.run(scenario()) == ["finally ran"]
    assert "destroyed" not in caplog.text


def test_cancelling_a_finished_task_keeps_nothing() -> None:
    async def scenario() -> None:
        task = asyncio.ensure_future(asyncio.sleep(0))
        await task
        fanout.cancel(task)
        assert not fanout._CANCELLING and not task.cancelled()

    asyncio.run(scenario())
