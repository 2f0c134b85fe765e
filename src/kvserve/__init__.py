"""kvserve: an LLM inference server that never prefills the same text twice."""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutputs", "__version__"]

if TYPE_CHECKING:
    from kvserve.engine.grammar import StructuredOutputs
    from kvserve.engine.outputs import CompletionOutput, RequestOutput
    from kvserve.engine.sampling_params import SamplingParams
    from kvserve.llm import LLM

_EXPORTS = {
    "LLM": "kvserve.llm",
    "CompletionOutput": "kvserve.engine.outputs",
    "RequestOutput": "kvserve.engine.outputs",
    "SamplingParams": "kvserve.engine.sampling_params",
    "StructuredOutputs": "kvserve.engine.grammar",
}


def __getattr__(name: str) -> Any:
    # Resolved on first use, so that `kvserve bench` and the CLI's help start without loading torch.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
