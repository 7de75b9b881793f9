"""xgrammar's view of a tokenizer's vocabulary (its TokenizerInfo), kept on disk between processes.

Building it for the 248k-token Qwen3.6 vocabulary takes ~3.7 s of one core (transformers' wrapper
~1.7 s, xgrammar decoding every token ~2.0 s), and every engine process builds it at warm-up: a
restarted engine paid it again, and so did every stack the CPU tests start. Read back from its
JSON (~9 MB) it takes ~0.35 s, and keying it as much again.

    info = vocabulary_info(tokenizer)   # read from the cache, or built and written there

Where: `xgrammar/` (made with mode 0700) in `$PDSERVE_CACHE`, else in `~/.cache/pdserve` (where
the embedded tiny model goes too, pdserve.tiny); a folder that is a link, another user's, or one
that others may write to is not used (an entry decides which tokens a grammar allows). The key is
a SHA-256 of the tokenizer's serialized form, the vocabulary size, the stop ids and the versions
of xgrammar, transformers and tokenizers: a tokenizer edited in place, or an upgrade, gets an
entry of its own. Entries are UTF-8 whatever the locale, and written whole (a temporary file,
then a rename: engines starting together may each write one, every reader sees a complete
file). A file that does not read back as the same vocabulary (size, stop ids) is built again and
replaced; a cache that cannot be read or written only costs the build. The KEPT entries read or
written last stay, older ones are removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import os
import stat
import tempfile
import time
from pathlib import Path

import xgrammar as xgr

from pdserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)
KEPT = 8  # entries (~9 MB each for Qwen3.6): another tokenizer, or an xgrammar upgrade, adds one
BUILT_BY = ("xgrammar", "transformers", "tokenizers")  # their versions are part of the key


def cache_dir() -> Path:
    """The folder the entries go to."""
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve") / "xgrammar"


def _usable(folder: Path) -> bool:
    """Make `folder` (mode 0700) if it is missing; whether it is a real folder of this user that
    no one else may write to (an entry decides which tokens a grammar allows)."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = folder.lstat()
    except OSError:
        return False
    private = stat.S_IMODE(info.st_mode) & 0o022 == 0
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and private


def cache_key(tokenizer: Tokenizer) -> str:
    """What an entry is valid for: the tokenizer, its vocabulary size and stop ids, and the
    versions of what builds it (xgrammar, through transformers' wrapper of the tokenizer)."""
    digest = hashlib.sha256(tokenizer.backend.to_str().encode())
    stops = ",".join(map(str, sorted(tokenizer.eos_token_ids)))
    versions = ",".join(importlib.metadata.version(p) for p in BUILT_BY)
    digest.update(f"|{tokenizer.vocab_size}|{stops}|{versions}".encode())
    return digest.hexdigest()


def build_info(tokenizer: Tokenizer) -> xgr.TokenizerInfo:
    """The TokenizerInfo from the tokenizer itself (the slow way)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    stops = list(tokenizer.eos_token_ids) or None
    return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=tokenizer.vocab_size, stop_token_ids=stops)


def _read(path: Path, tokenizer: Tokenizer) -> xgr.TokenizerInfo | None:
    try:
        info = xgr.TokenizerInfo.deserialize_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RuntimeError) as e:  # unreadable, or not an entry
        log.warning("xgrammar vocabulary cache: %s is unreadable (%s): building it again", path, e)
        return None
    stops = set(tokenizer.eos_token_ids)  # none: xgrammar found its own when it was built
    same = info.vocab_size == tokenizer.vocab_size and (not stops or set(info.stop_token_ids) == stops)
    if not same:
        log.warning("xgrammar vocabulary cache: %s holds another vocabulary: building it again", path)
    return info if same else None


def _write(path: Path, info: xgr.TokenizerInfo) -> None:
    tmp = ""
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(info.serialize_json())
        os.replace(tmp, path)
    except (OSError, ValueError) as e:  # ValueError: text the file's encoding cannot hold
        log.warning("xgrammar vocabulary cache: could not write %s (%s)", path, e)
        if tmp:  # a half-written file (a full disk)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    _prune(path.parent)


def _prune(folder: Path) -> None:
    """Keep the KEPT entries used last (a read touches its entry); drop the rest, and the
    temporary files of writers killed mid-write (an hour old)."""
    try:
        entries = sorted(folder.glob("*.json"), key=lambda e: e.stat().st_mtime, reverse=True)
        stale = entries[KEPT:] + [t for t in folder.glob("*.tmp") if time.time() - t.stat().st_mtime > 3600]
        for entry in stale:
            entry.unlink()
    except OSError:  # another process pruned first
        pass


def vocabulary_info(tokenizer: Tokenizer) -> xgr.TokenizerInfo:
    """`tokenizer`'s TokenizerInfo: from the disk cache when it holds it, else built (and kept)."""
    try:
        folder = cache_dir()
    except RuntimeError:  # no home folder (a uid without a passwd entry) and no PDSERVE_CACHE
        return build_info(tokenizer)
    if not _usable(folder):
        return build_info(tokenizer)
    path = folder / f"{cache_key(tokenizer)}.json"
    start = time.monotonic()
    info = _read(path, tokenizer)
    if info is not None:
        with contextlib.suppress(OSError):
            os.utime(path)  # used: the last to be pruned
        log.info("xgrammar vocabulary read from %s (%.1f s)", path, time.monotonic() - start)
        return info
    info = build_info(tokenizer)
    _write(path, info)
    log.info("xgrammar vocabulary built in %.1f s, kept in %s", time.monotonic() - start, path)
    return info
