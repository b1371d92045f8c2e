"""pagedserve: an LLM inference engine with a paged KV cache and continuous batching."""

from pagedserve import _core

__version__ = "0.1.0"
__all__ = ["_core"]
