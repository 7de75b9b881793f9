"""The engine flags: each one set reaches EngineConfig and a child's command line; the prefix
cache's device checkpoints default to two per runnable sequence on a GPU, 32 on a CPU."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cli_args import add_engine_arguments, engine_argv, engine_config_from_args
from pdserve.config import EngineConfig


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(list(argv))


def test_prefix_checkpoints_flag_reaches_the_config_and_the_children(tiny_model_dir) -> None:
    args = parse("--model", str(tiny_model_dir), "--device", "cpu", "--num-prefix-checkpoints", "7")
    config = engine_config_from_args(args)
    assert config.num_prefix_checkpoints == 7
    assert config.num_state_slots == config.max_num_seqs + 7
    assert "--num-prefix-checkpoints" in engine_argv(args)
    with pytest.raises(ValueError, match="num_prefix_checkpoints"):
        EngineConfig(model=str(tiny_model_dir), device="cpu", num_prefix_checkpoints=0)


def test_prefix_checkpoints_default_by_device(tiny_model_dir) -> None:
    on_cpu = EngineConfig(model=str(tiny_model_dir), device="cpu", max_num_seqs=8)
    on_gpu = EngineConfig(model=str(tiny_model_dir), device="cuda", max_num_seqs=8)
    assert (on_cpu.num_prefix_checkpoints, on_gpu.num_prefix_checkpoints) == (32, 16)
    off = EngineConfig(model=str(tiny_model_dir), device="cuda", max_num_seqs=8, enable_prefix_caching=False)
    assert off.num_state_slots == 8


def test_long_attention_flag_reaches_the_config_and_the_children(tiny_model_dir) -> None:
    args = parse("--model", str(tiny_model_dir), "--device", "cpu", "--long-attention-from", "4096")
    assert engine_config_from_args(args).long_attention_from == 4096
    argv = engine_argv(args)
    assert argv[argv.index("--long-attention-from") + 1] == "4096"
    default = engine_config_from_args(parse("--model", str(tiny_model_dir), "--device", "cpu"))
    assert default.long_attention_from == 16384
    with pytest.raises(ValueError, match="long_attention_from"):
        EngineConfig(model=str(tiny_model_dir), device="cpu", long_attention_from=-1)


def test_background_launch_ms_reaches_the_config_and_the_children(tiny_model_dir) -> None:
    default = engine_config_from_args(parse("--model", str(tiny_model_dir), "--device", "cpu"))
    assert default.background_launch_ms == 5.0
    args = parse("--model", str(tiny_model_dir), "--device", "cpu", "--background-launch-ms", "8.5")
    assert engine_config_from_args(args).background_launch_ms == 8.5
    argv = engine_argv(args)
    assert argv[argv.index("--background-launch-ms") + 1] == "8.5"
    with pytest.raises(ValueError, match="background_launch_ms"):
        EngineConfig(model=str(tiny_model_dir), device="cpu", background_launch_ms=0)


def test_express_prefill_switch_reaches_the_config_and_the_children(tiny_model_dir) -> None:
    default = engine_config_from_args(parse("--model", str(tiny_model_dir), "--device", "cpu"))
    assert default.express_prefill is False
    args = parse("--model", str(tiny_model_dir), "--device", "cpu", "--express-prefill")
    assert engine_config_from_args(args).express_prefill is True
    assert "--express-prefill" in engine_argv(args)
