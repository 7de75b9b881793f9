"""`pdserve.ops.bench_overlap.layer_by_layer`, the layer-at-a-time forward the overlap benchmark
launches between decode steps, computes what the model's forward does."""

from __future__ import annotations

import torch

from pdserve import LLM
from pdserve.model.forward_batch import ForwardBatch
from pdserve.ops.bench_overlap import layer_by_layer
from tests.helpers import random_prompts


def test_layer_by_layer_equals_the_forward(plain_llm: LLM) -> None:
    runner = plain_llm.engine.runner
    kv, states = runner.kv_pool, runner.state_pool
    (prompt,) = random_prompts((37,), seed=71)
    table, slot = kv.allocate(kv.pages_for(len(prompt))), states.allocate()
    try:
        batch = ForwardBatch.build([prompt], [0], [table], [slot], runner.config.page_size, runner.device)
        before = states.conv[:, slot].clone(), states.recurrent[:, slot].clone()
        want = runner.model.compute_logits(runner.model(batch)[-1:])
        states.conv[:, slot], states.recurrent[:, slot] = before  # the pass moved the slot on
        layers, steps = layer_by_layer(runner, batch), 0
        while True:
            try:
                next(layers)
            except StopIteration as done:
                got = done.value
                break
            steps += 1
        assert steps == len(runner.model.model.layers)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        kv.free(table)
        states.free(slot)
