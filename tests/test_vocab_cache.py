"""xgrammar's vocabulary view kept on disk (pdserve.sampling.vocab_cache): built once, then read
back as the same vocabulary (a grammar compiled on either is the same grammar); a bad or foreign
entry is built again and replaced; an unusable folder only costs the build. One real build (~4 s
for the Qwen3.6 vocabulary); the other tests count the builds asked for, answered by a stand-in."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest
import xgrammar as xgr

from pdserve.sampling import vocab_cache
from pdserve.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def built(tokenizer: Tokenizer) -> xgr.TokenizerInfo:
    return vocab_cache.build_info(tokenizer)


@pytest.fixture
def builds(monkeypatch: pytest.MonkeyPatch, built: xgr.TokenizerInfo) -> list[Tokenizer]:
    """Each build the cache asks for, answered with the module's real one."""
    calls: list[Tokenizer] = []

    def build(tokenizer: Tokenizer) -> xgr.TokenizerInfo:
        calls.append(tokenizer)
        return built

    monkeypatch.setattr(vocab_cache, "build_info", build)
    return calls


def same_vocabulary(a: xgr.TokenizerInfo, b: xgr.TokenizerInfo) -> bool:
    fields = ("vocab_size", "vocab_type", "add_prefix_space", "stop_token_ids", "special_token_ids")
    if any(getattr(a, f) != getattr(b, f) for f in fields) or a.decoded_vocab != b.decoded_vocab:
        return False
    json_a, json_b = (
        xgr.GrammarCompiler(i, cache_enabled=False).compile_builtin_json_grammar() for i in (a, b)
    )
    return json_a.serialize_json() == json_b.serialize_json()


def test_built_once_then_read_back_as_the_same_vocabulary(
    tokenizer: Tokenizer, built: xgr.TokenizerInfo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    first = vocab_cache.vocabulary_info(tokenizer)  # a real build, written
    folder = tmp_path / "cache" / "xgrammar"
    assert [p.name for p in folder.iterdir()] == [f"{vocab_cache.cache_key(tokenizer)}.json"]
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    monkeypatch.setattr(vocab_cache, "build_info", lambda t: pytest.fail("built again"))
    again = vocab_cache.vocabulary_info(tokenizer)
    assert same_vocabulary(first, built) and same_vocabulary(again, built)


def test_an_entry_is_utf8_whatever_the_locale(
    tokenizer: Tokenizer, built: xgr.TokenizerInfo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    vocab_cache._write(tmp_path / "entry.json", built)  # the vocabulary holds non-ASCII text
    assert (tmp_path / "entry.json").read_bytes().decode("utf-8") == built.serialize_json()
    assert same_vocabulary(vocab_cache._read(tmp_path / "entry.json", tokenizer), built)


def test_a_bad_entry_is_built_again_and_replaced(
    tokenizer: Tokenizer, builds: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    path = tmp_path / "xgrammar" / f"{vocab_cache.cache_key(tokenizer)}.json"
    path.parent.mkdir(mode=0o700)
    path.write_text('{"half": ')
    with caplog.at_level(logging.WARNING, logger=vocab_cache.__name__):
        vocab_cache.vocabulary_info(tokenizer)
    assert len(builds) == 1 and "unreadable" in caplog.text
    vocab_cache.vocabulary_info(tokenizer)  # the replacement is read
    assert len(builds) == 1 and [p.name for p in path.parent.iterdir()] == [path.name]


def test_an_entry_of_another_vocabulary_is_not_used(
    tokenizer: Tokenizer,
    built: xgr.TokenizerInfo,
    builds: list,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    fewer_stops = Tokenizer(tokenizer.backend, tokenizer.eos_token_ids[:1], tokenizer.chat_template)
    assert vocab_cache.cache_key(fewer_stops) != vocab_cache.cache_key(tokenizer)
    path = tmp_path / "xgrammar" / f"{vocab_cache.cache_key(fewer_stops)}.json"
    path.parent.mkdir(mode=0o700)
    path.write_text(built.serialize_json())  # stop ids of the full tokenizer under the other's key
    vocab_cache.vocabulary_info(fewer_stops)
    assert builds == [fewer_stops]


def test_the_entries_used_last_are_kept(
    tokenizer: Tokenizer, builds: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    folder = tmp_path / "xgrammar"
    folder.mkdir(mode=0o700)
    for age in range(vocab_cache.KEPT):  # other tokenizers' entries, other0 the newest
        (folder / f"other{age}.json").write_text("{}")
        os.utime(folder / f"other{age}.json", (1000.0 - age, 1000.0 - age))
    vocab_cache.vocabulary_info(tokenizer)  # a new entry: the oldest other one goes
    kept = sorted(p.name for p in folder.iterdir())
    mine = f"{vocab_cache.cache_key(tokenizer)}.json"
    assert kept == sorted([mine] + [f"other{age}.json" for age in range(vocab_cache.KEPT - 1)])
    os.utime(folder / mine, (1.0, 1.0))  # as if long unused: a read makes it the newest again
    vocab_cache.vocabulary_info(tokenizer)
    assert len(builds) == 1 and (folder / mine).stat().st_mtime > 1000.0


@pytest.mark.parametrize("where", ["a link", "a file", "writable by others", "another user's"])
def test_no_usable_folder_only_costs_the_build(
    where: str, tokenizer: Tokenizer, builds: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "root").mkdir()
    target = tmp_path / "root" / "xgrammar"
    if where == "a link":
        (tmp_path / "real").mkdir(mode=0o700)
        target.symlink_to(tmp_path / "real")
    elif where == "a file":
        target.write_text("not a folder")
    else:
        target.mkdir(mode=0o700)
        if where == "writable by others":
            target.chmod(0o777)
        else:
            uid = os.getuid()
            monkeypatch.setattr(vocab_cache.os, "getuid", lambda: uid + 1)
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "root"))
    vocab_cache.vocabulary_info(tokenizer)
    vocab_cache.vocabulary_info(tokenizer)
    written = list(tmp_path.rglob("*.json"))
    assert len(builds) == 2 and not written


def test_no_home_folder_only_costs_the_build(
    tokenizer: Tokenizer, builds: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("PDSERVE_CACHE", raising=False)
    monkeypatch.setattr(vocab_cache.Path, "home", staticmethod(no_home))
    vocab_cache.vocabulary_info(tokenizer)
    assert len(builds) == 1


def test_the_folder_is_the_tiny_models_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    assert vocab_cache.cache_dir() == tmp_path / "xgrammar"
    monkeypatch.delenv("PDSERVE_CACHE")
    assert vocab_cache.cache_dir() == Path.home() / ".cache" / "pdserve" / "xgrammar"
