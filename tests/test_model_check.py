"""`python -m pdserve.model_check`: one line that says why a model folder cannot be served (what
the compose `model-check` service and the Kubernetes init containers print), without torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.model_check import check_model_folder
from tests.torch_blocked import ROOT

RUNNER = [sys.executable, str(ROOT / "tests" / "torch_blocked.py")]


def run_check(*args: str) -> subprocess.CompletedProcess:
    """The check as the containers run it, with torch and the engine blocked."""
    return subprocess.run(
        [*RUNNER, "-m", "pdserve.model_check", *args], capture_output=True, text=True, timeout=60, cwd=ROOT
    )


def test_a_servable_folder_passes(tiny_model_dir: Path) -> None:
    done = run_check(str(tiny_model_dir))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("model ok: ") and "qwen3_5_moe_text" in done.stdout
    assert done.stderr == ""


def test_an_empty_folder_says_so_with_the_hint(tmp_path: Path) -> None:
    done = run_check(str(tmp_path), "--hint", "set PDSERVE_MODELS_DIR")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"pdserve: cannot serve this model: the model folder {tmp_path} is empty; set PDSERVE_MODELS_DIR"
    ]


def test_a_missing_folder(tmp_path: Path) -> None:
    done = run_check(str(tmp_path / "nope"))
    assert done.returncode == 1
    assert f"no model folder at {tmp_path / 'nope'}" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.fixture
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "model"
    shutil.copytree(tiny_model_dir, copy)
    return copy


def test_each_missing_piece_is_named(model_copy: Path) -> None:
    (model_copy / "tokenizer.json").rename(model_copy / "tokenizer.json.bak")
    with pytest.raises(ValueError, match="no tokenizer.json in"):
        check_model_folder(model_copy)
    (model_copy / "tokenizer.json.bak").rename(model_copy / "tokenizer.json")

    shard = next(model_copy.glob("*.safetensors"))
    shard.rename(model_copy / "weights.bak")
    with pytest.raises(ValueError, match=r"no weights in .*no \*\.safetensors"):
        check_model_folder(model_copy)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ValueError, match="names shard.* not there: model-00001-of-00002.safetensors, model-00002"
    ):
        check_model_folder(model_copy)

    config = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        check_model_folder(model_copy)


def test_an_unreadable_file_names_the_uid(model_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a non-root container user sees a root-only checkpoint (CI runs as root: access is faked)."""
    real_access = os.access
    monkeypatch.setattr(
        os, "access", lambda path, mode: Path(path).name != "config.json" and real_access(path, mode)
    )
    with pytest.raises(ValueError, match=f"config.json is not readable by uid {os.getuid()}: make the"):
        check_model_folder(model_copy)
