"""pdserve: disaggregated prefill/decode serving for Qwen3.6 hybrid-MoE models."""

from pdserve.llm import LLM
from pdserve.sampling.params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
