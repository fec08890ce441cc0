"""kvfleet: LLM serving on a paged-KV-cache engine."""

from kvfleet.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing kvfleet must not import torch
    if name == "LLM":
        from kvfleet.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)
