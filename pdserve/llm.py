"""The offline API: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tqdm.auto import tqdm

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.request_defaults import RequestDefaults, SeedStream, choice_seed
from pdserve.sampling.params import SamplingParams


class LLM:
    """Runs a Qwen3.5/3.6-MoE checkpoint in this process.

    As vLLM's `LLM`: `seed` seeds the requests that set none (pdserve.request_defaults: a run
    repeats), `generation_config` ("auto", "vllm" or a folder) gives `get_default_sampling_params()`,
    used when `generate` gets no sampling params. `dummy_weight_seed` seeds the random weights of
    `load_format="dummy"`. The other keyword arguments are `EngineConfig` fields: `device`,
    `dtype`, `load_format`, `max_num_seqs`, `max_model_len`, `max_num_batched_tokens`, ...
    """

    def __init__(
        self,
        model: str,
        seed: int | None = None,
        generation_config: str = "auto",
        dummy_weight_seed: int = 0,
        **kwargs: object,
    ) -> None:
        config = EngineConfig(model=str(model), dummy_weight_seed=dummy_weight_seed, **kwargs)
        self.defaults = RequestDefaults.load(config.model, generation_config, seed)
        self.seeds = SeedStream(seed)
        self.engine = LLMEngine(config)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's method)."""
        budget = {} if self.defaults.max_tokens is None else {"max_tokens": self.defaults.max_tokens}
        return SamplingParams(**budget, **self.defaults.sampling_fields())

    @property
    def tokenizer(self):  # noqa: ANN201 - pdserve.tokenizer.Tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); results in prompt order,
        the `n` completions of a prompt next to each other (prompt i's j-th at i*n + j when all
        share one n). Copy j of a seeded prompt samples with seed + j, as the router does.

        All prompts are validated before any runs: a bad one raises ValueError and nothing is queued.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else sampling_params
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        copies = []  # (prompt, params of one completion)
        for prompt, sp in zip(prompts, params, strict=True):
            seed = self.seeds.next_seed() if sp.seed is None else sp.seed
            for j in range(sp.n):
                one = dataclasses.replace(sp, n=1, seed=None if seed is None else choice_seed(seed, j))
                copies.append((prompt, one))
        seqs = [self.engine.make_sequence(p, sp) for p, sp in copies]
        for seq in seqs:
            self.engine.enqueue(seq)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(seqs), desc="generating", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            for seq in seqs:
                self.engine.abort(seq.request_id)
        return [results[seq.request_id] for seq in seqs]


__all__ = ["LLM"]
