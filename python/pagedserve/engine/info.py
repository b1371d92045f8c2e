"""EngineInfo: what a loaded engine tells its users about itself (the server, the CLI, the page)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.engine.validation import EngineLimits


@dataclass(frozen=True)
class EngineInfo:
    model_name: str  # the model directory's name
    model_path: Path
    device: str  # "cpu" or "cuda:0"
    dtype: str  # what the model computes in, e.g. "float32"
    tokenizer: Any = field(repr=False)  # a transformers tokenizer, or None for a directory without one
    limits: EngineLimits  # every field known once loaded
    # Sampling defaults from the model's generation_config.json (temperature, top_p, top_k, min_p,
    # repetition_penalty: only the keys it sets); SamplingParams() fills the rest.
    default_sampling: dict[str, Any] = field(default_factory=dict)
    architecture: str = ""  # config.json's, e.g. "LlamaForCausalLM" (picks the tool-call parser)
    structured_outputs_backend: str = "auto"  # EngineConfig's: which grammar backend compiles a spec first
