"""What a request gets for the sampling fields it leaves unset, as vLLM does it; torch-free (the
router and the offline `LLM` both use it).

  generation_config.json   the model's recommended sampling (`--generation-config`, vLLM's):
                           "auto" reads the model folder's, "vllm" none, a folder path that
                           folder's. Read: temperature, top_p, top_k, min_p,
                           repetition_penalty, and max_new_tokens (the output budget of a request
                           that sets no max_tokens). `do_sample` is not read (vLLM does not).
  --seed                   a request without a seed gets the next of a stream of seeds drawn from
                           it: the answers of a run repeat when the requests do, in the same order,
                           whatever they shared a batch with; without --seed they are unseeded
  choice_seed              choice j of a seeded request with n > 1 samples with seed + j
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.sampling.params import INT64_MIN, SamplingParams

log = logging.getLogger("pdserve")
# generation_config.json key -> the request field it is the default of
GENERATION_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a seeded request: seed + choice, wrapped within int64."""
    return (seed + choice - INT64_MIN) % 2**64 + INT64_MIN


def read_generation_defaults(model_dir: str | Path, generation_config: str = "auto") -> dict[str, float]:
    """The sampling defaults of `--generation-config` (see the module doc): request field ->
    value. A folder named explicitly must hold a generation_config.json."""
    if generation_config == "vllm":
        return {}
    folder = Path(model_dir) if generation_config == "auto" else Path(generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config == "auto":
            return {}
        raise ValueError(f"--generation-config {generation_config}: no generation_config.json in it")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    defaults = {}
    for key, name in GENERATION_FIELDS.items():
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{path}: {key} must be a number, got {value!r}")
        defaults[name] = value
    return defaults


@dataclass(frozen=True, slots=True)
class RequestDefaults:
    """The defaults themselves: checked when built (a bad generation_config.json stops the start,
    instead of failing every request)."""

    sampling: Mapping[str, float] = field(default_factory=dict)  # read_generation_defaults
    seed: int | None = None  # --seed

    def __post_init__(self) -> None:
        unknown = set(self.sampling) - set(GENERATION_FIELDS.values())
        if unknown:
            raise ValueError(f"unknown sampling defaults {sorted(unknown)}")
        max_tokens = self.sampling.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise ValueError(
                f"generation_config.json: max_new_tokens must be a positive integer, got {max_tokens!r}"
            )
        try:
            SamplingParams(**self.sampling_fields(), seed=self.seed)
        except ValueError as e:
            raise ValueError(f"sampling defaults: {e}") from e

    @classmethod
    def load(
        cls, model_dir: str | Path, generation_config: str = "auto", seed: int | None = None
    ) -> RequestDefaults:
        defaults = cls(read_generation_defaults(model_dir, generation_config), seed)
        if defaults.sampling:
            log.info(
                "sampling defaults from generation_config.json (requests may override): %s", defaults.sampling
            )
        return defaults

    def sampling_fields(self) -> dict[str, float]:
        """The defaults that are SamplingParams fields (all but max_tokens)."""
        return {k: v for k, v in self.sampling.items() if k != "max_tokens"}

    @property
    def max_tokens(self) -> int | None:
        """The output budget of a request that sets none (None: the room left in the context)."""
        value = self.sampling.get("max_tokens")
        return None if value is None else int(value)


class SeedStream:
    """The seeds handed to requests that set none (`--seed`); None for each when there is no seed."""

    def __init__(self, seed: int | None) -> None:
        self._rng = None if seed is None else random.Random(seed)

    def next_seed(self) -> int | None:
        return None if self._rng is None else self._rng.getrandbits(63)
