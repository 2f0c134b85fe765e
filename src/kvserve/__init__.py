"""kvserve: an LLM inference server that never prefills the same text twice."""

from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.llm import LLM

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]
