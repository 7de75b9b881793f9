"""Private temp folders name their owner (pid and start time); `remove_orphaned_dirs` removes
those of dead owners and keeps a live owner's, an unowned one, a link, another prefix's."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from pdserve.private_dirs import (
    make_private_dir,
    owner_is_dead,
    process_start_time,
    remove_orphaned_dirs,
)


def owned_by(folder: Path, pid: int, start: str | None) -> Path:
    folder.mkdir()
    (folder / "owner").write_text(f"{pid} {start}\n")
    (folder / "internal-secret").write_text("x")
    return folder


def test_a_private_dir_names_this_process_and_is_private(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = make_private_dir("pdserve-up-")
    assert folder.parent == tmp_path and folder.name.startswith("pdserve-up-")
    assert folder.stat().st_mode & 0o777 == 0o700
    assert (folder / "owner").read_text() == f"{os.getpid()} {process_start_time(os.getpid())}\n"
    assert [p.name for p in folder.iterdir()] == ["owner"]
    assert not owner_is_dead(folder)


def test_only_the_folders_of_dead_owners_are_removed(tmp_path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone_start = process_start_time(gone.pid)
    gone.wait()
    me, my_start = os.getpid(), process_start_time(os.getpid())
    assert gone_start is not None and my_start is not None
    dead_up = owned_by(tmp_path / "pdserve-up-dead", gone.pid, gone_start)
    dead_redis = owned_by(tmp_path / "pdserve-redis-dead", gone.pid, gone_start)
    reused = owned_by(tmp_path / "pdserve-up-reused", me, str(int(my_start) - 1))  # pid used again
    live = owned_by(tmp_path / "pdserve-redis-live", me, my_start)
    unowned = tmp_path / "pdserve-up-unowned"  # an older pdserve's, or one being made
    unowned.mkdir()
    garbled = owned_by(tmp_path / "pdserve-up-garbled", gone.pid, None)  # made without /proc
    other = owned_by(tmp_path / "someone-else-dead", gone.pid, gone_start)
    link = tmp_path / "pdserve-up-link"
    link.symlink_to(dead_up)
    removed = remove_orphaned_dirs(tmp_path)
    assert sorted(removed) == sorted([dead_up, dead_redis, reused])
    assert sorted(tmp_path.iterdir()) == sorted([live, unowned, garbled, other, link])
    assert remove_orphaned_dirs(tmp_path / "missing") == []
