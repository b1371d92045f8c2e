"""Structured outputs on a CUDA GPU: the token bitmask is filled on the host while the device runs the
forward and applied to the logits on the device. The CPU path is the oracle: in float32 the same
grammar-constrained greedy requests give the same tokens on both devices.

Skipped where no GPU (or no CUDA build) is present; scripts/gpu_check.sh runs it.
"""

import json

import jsonschema
import pytest
import torch

from pagedserve import LLM, SamplingParams, StructuredOutputsParams, _core

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and _core.has_cuda), reason="needs a CUDA GPU and USE_CUDA=ON"),
]

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
PROMPTS = ["A person as JSON:", "Describe a cat as a JSON object:", "JSON please:"]


def _run(device):
    llm = LLM(dtype="float32", device=device, seed=0, max_model_len=512)
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=spec),
                          use_tqdm=False)
    sampled = llm.generate(PROMPTS[:1], SamplingParams(temperature=1.0, n=4, seed=1, max_tokens=64,
                                                       structured_outputs=spec), use_tqdm=False)
    return [o.outputs[0].token_ids for o in greedy], [c.text for c in sampled[0].outputs]


def test_json_schema_on_cuda_matches_the_cpu_path():
    cuda_greedy, cuda_samples = _run("cuda")
    cpu_greedy, _ = _run("cpu")
    assert cuda_greedy == cpu_greedy
    for text in cuda_samples:
        jsonschema.validate(json.loads(text), SCHEMA)
