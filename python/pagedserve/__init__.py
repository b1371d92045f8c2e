"""pagedserve: an LLM inference engine with a paged KV cache and continuous batching."""

from pagedserve import _core

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import pagedserve` stays light (no torch import) for the bindings and tools.
    if name == "LLM":
        from pagedserve.llm import LLM
        return LLM
    if name == "SamplingParams":
        from pagedserve.sampling_params import SamplingParams
        return SamplingParams
    if name == "StructuredOutputsParams":
        from pagedserve.sampling_params import StructuredOutputsParams
        return StructuredOutputsParams
    if name == "LLMEngine":
        from pagedserve.engine.engine import LLMEngine
        return LLMEngine
    if name == "EngineConfig":
        from pagedserve.engine_config import EngineConfig
        return EngineConfig
    if name in ("RequestOutput", "CompletionOutput"):
        from pagedserve import outputs
        return getattr(outputs, name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "LLMEngine", "EngineConfig", "RequestOutput", "CompletionOutput", "_core"]
