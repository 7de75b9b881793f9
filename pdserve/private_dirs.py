"""Private temp folders that name the process owning them, and the removal of those whose owner
is dead.

    folder = make_private_dir("pdserve-up-")   # mode 0700, with an `owner` file: "PID STARTTIME"
    remove_orphaned_dirs()                     # at `pdserve up`'s start: the pdserve-up-* and
                                               # pdserve-redis-* folders of dead owners

A `pdserve up` killed with SIGKILL cannot remove its folder (the internal secret, the wrapper of
redis-server) nor its Redis server's; the next `pdserve up` does. The owner is a pid and its start
time (Linux: /proc/PID/stat), so a pid used again by another process does not keep a folder
alive. A folder is removed only when it is ours (same uid, not a link), holds an `owner` file
that names a process, and that process is gone: a live stack's folders, and folders of other
users or without an owner (made by an older pdserve, or being made right now), stay.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

OWNER_FILE = "owner"
PREFIXES = ("pdserve-up-", "pdserve-redis-")


def process_start_time(pid: int) -> str | None:
    """The start time of process `pid` (clock ticks after boot), or None when it does not run (no
    such process, or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the name, which may hold spaces
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]  # field 22 of proc(5); fields[0] is field 3


def make_private_dir(prefix: str) -> Path:
    """A new folder in the temp folder (mode 0700) whose `owner` file names this process."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    pid = os.getpid()
    (folder / f"{OWNER_FILE}.tmp").write_text(f"{pid} {process_start_time(pid)}\n")
    (folder / f"{OWNER_FILE}.tmp").rename(folder / OWNER_FILE)  # never read half written
    return folder


def owner_is_dead(folder: Path) -> bool:
    """Whether `folder`'s `owner` file names a process that no longer runs (False when there is
    no readable owner: nothing proves it dead)."""
    try:
        pid_text, start = (folder / OWNER_FILE).read_text().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return False
    return start.isdigit() and process_start_time(pid) != start  # "None": no /proc when made


def _is_my_folder(entry: os.DirEntry) -> bool:
    """A folder (not a link to one) of this user."""
    try:
        return entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.getuid()
    except OSError:
        return False


def remove_orphaned_dirs(root: Path | None = None, prefixes: tuple[str, ...] = PREFIXES) -> list[Path]:
    """Remove the folders in `root` (default: the temp folder) named `prefix*` whose owner is dead;
    the ones removed."""
    root = Path(tempfile.gettempdir()) if root is None else root
    removed = []
    try:
        entries = list(os.scandir(root))
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(prefixes) and _is_my_folder(entry):
            folder = Path(entry.path)
            if owner_is_dead(folder):
                shutil.rmtree(folder, ignore_errors=True)
                if not folder.exists():
                    removed.append(folder)
    return removed
