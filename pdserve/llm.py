"""The offline API: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine, RequestOutput
from pdserve.sampling.params import SamplingParams


class LLM:
    """Runs a Qwen3.5/3.6-MoE checkpoint in this process.

    Keyword arguments are `EngineConfig` fields: `device`, `dtype`, `load_format`,
    `max_num_seqs`, `max_model_len`, `max_num_batched_tokens`, `page_size`, ...
    """

    def __init__(self, model: str, **kwargs: object) -> None:
        self.engine = LLMEngine(EngineConfig(model=str(model), **kwargs))

    @property
    def tokenizer(self):  # noqa: ANN201 - pdserve.tokenizer.Tokenizer
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); results in prompt order.

        All prompts are validated before any runs: a bad one raises ValueError and nothing is queued.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else sampling_params
        )
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        seqs = [self.engine.make_sequence(p, sp) for p, sp in zip(prompts, params, strict=True)]
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
