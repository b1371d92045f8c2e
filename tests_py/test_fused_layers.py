"""The fused decoder stack (models/fused_layers.py, cpp/ops/decoder_layer.cc) against the per-op path it replaces.

The stack calls the same ops in the same order, so everything must be bit-identical (torch.equal, never a
tolerance): the final hidden states and logits of every step, and the KV cache written along the way. Each case
runs one scenario through both paths over its own NaN-poisoned KV cache with the same block assignment: whole
prefills of a batch of prompts (1 to 40 tokens), decodes of the batch, a prompt prefilled in chunks of 8 beside
decodes, and batch-1 decodes. The random cases are tiny checkpoints of transformers' own config classes with
bf16-valued weights, so CPU packing makes every linear bf16 tiles (the stack's format); the default model
(SmolLM2-135M) runs the same scenario and the engine's greedy output with logprobs, fused and not.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from hf_helpers import make_hf_model, round_to_bf16
from paged_helpers import PagedBatchRunner
from pagedserve import LLM, SamplingParams, ops
from pagedserve.models import build_model
from pagedserve.models.cpu_weight_packing import pack_cpu_weights
from pagedserve.models.fused_layers import FusedDecoderStack, fuse_decoder_layers, unfusable_reason
from pagedserve.models.model_config import ModelConfig

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, vocab_size=256, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)
WINDOW = 8
LONGROPE = dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 3.5],
                long_factor=[1.0, 1.5, 2.5, 4.0, 6.0, 8.0, 10.0, 12.0], original_max_position_embeddings=32)
CASES = {
    "llama_gqa": ("LlamaConfig", {}),
    "llama_biases_mha": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, num_key_value_heads=4)),
    "llama_longrope": ("LlamaConfig", dict(rope_parameters=LONGROPE)),
    "mistral_window": ("MistralConfig", dict(sliding_window=WINDOW)),
    "qwen2_window_layers": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "qwen3_qk_norm_bias": ("Qwen3Config", dict(attention_bias=True)),
    "smollm3_nope_layers": ("SmolLM3Config", dict(num_hidden_layers=4, no_rope_layer_interval=2)),
    "phi3": ("Phi3Config", {}),
}


class Recorded:
    """A model as PagedBatchRunner drives it, keeping a copy of each forward's hidden states; `stack` (a
    FusedDecoderStack over the same model) replaces the per-op layers when given."""

    def __init__(self, model, stack=None):
        self.model, self.stack, self.config = model, stack, model.config
        self.hidden: list[torch.Tensor] = []

    def parameters(self):
        return self.model.parameters()

    def forward(self, input_ids, positions, attn, kv_cache):
        if self.stack is None:
            hidden = self.model.forward(input_ids, positions, attn, kv_cache)
        else:
            hidden = self.stack(input_ids, positions.to(torch.int32), attn, kv_cache)
        self.hidden.append(hidden.clone())
        return hidden

    def compute_logits(self, hidden):
        return self.model.compute_logits(hidden)


def scenario(runner: PagedBatchRunner, prompts: list[list[int]]) -> list[dict[str, torch.Tensor]]:
    """Whole prefills, batch decodes, a chunked prefill beside decodes, batch-1 decodes: each step's logits."""
    names = [f"p{i}" for i in range(len(prompts) - 1)]
    chunked = "chunked"
    for name, prompt in zip(names + [chunked], prompts):
        runner.add(name, prompt)
    steps = []

    def run(chunks):
        logits = runner.step(chunks)
        for name, count in chunks:
            seq = runner.sequences[name]
            if seq.num_computed == len(seq.token_ids):  # its last token ran: extend it greedily
                runner.append(name, int(logits[name][-1].argmax()))
        steps.append(logits)

    run([(name, len(prompt)) for name, prompt in zip(names, prompts)])
    for _ in range(3):
        run([(name, 1) for name in names])
    remaining = len(prompts[-1])
    while remaining:
        chunk = min(8, remaining)
        run([(name, 1) for name in names[:2]] + [(chunked, chunk)])
        remaining -= chunk
    for _ in range(3):
        run([(chunked, 1)])
    return steps


def prompts_for(vocab_size: int, lengths=(23, 5, 1, 40, 30)) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def assert_bit_identical(model, prompts, num_blocks: int = 96) -> None:
    assert unfusable_reason(model.model) is None
    per_op, fused = Recorded(model), Recorded(model, FusedDecoderStack(model.model))
    runners = [PagedBatchRunner(m, num_blocks=num_blocks, seed=5) for m in (per_op, fused)]
    expected, actual = (scenario(runner, prompts) for runner in runners)
    assert len(per_op.hidden) == len(fused.hidden) == len(expected)
    for step, (want, got) in enumerate(zip(per_op.hidden, fused.hidden)):
        assert torch.equal(want, got), f"step {step}: hidden states differ by {(want - got).abs().max()}"
    for step, (want, got) in enumerate(zip(expected, actual)):
        for name in want:
            assert torch.equal(want[name], got[name]), f"step {step}, {name}: logits differ"
    caches = [runner.kv_cache.view(torch.int32) if runner.kv_cache.element_size() == 4 else runner.kv_cache.view(
        torch.int16) for runner in runners]
    assert torch.equal(*caches), "the KV caches differ"


def packed_model(path, precision: str = "float32", quantization: str = "none"):
    model = build_model(ModelConfig.from_model_dir(path, dtype="float32", device="cpu"), "cpu")
    assert pack_cpu_weights(model, "auto", precision, quantization)
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case_dir(request, tmp_path_factory):
    import transformers

    class_name, overrides = CASES[request.param]
    hf_model = make_hf_model(getattr(transformers, class_name), seed=zlib.crc32(request.param.encode()) % 1000,
                             **{**COMMON, **overrides})
    path = tmp_path_factory.mktemp(request.param)
    round_to_bf16(hf_model).save_pretrained(path)
    return path


def test_random_families_bit_identical(case_dir):
    assert_bit_identical(packed_model(case_dir), prompts_for(256))


def test_one_and_several_threads_agree(case_dir):
    model = packed_model(case_dir)
    before = ops.num_threads()
    hidden = []
    try:
        for threads in (1, 2):
            ops.set_num_threads(threads)
            recorded = Recorded(model, FusedDecoderStack(model.model))
            scenario(PagedBatchRunner(recorded, num_blocks=96, seed=5), prompts_for(256))
            hidden.append(recorded.hidden)
    finally:
        ops.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(*hidden))


@pytest.fixture(scope="module")
def default_model(default_model_path):
    return packed_model(default_model_path)


def test_default_model_bit_identical(default_model):
    assert_bit_identical(default_model, prompts_for(default_model.config.vocab_size), num_blocks=64)


@pytest.mark.parametrize("precision, quantization", [("float32", "none"), ("float32", "int8")])
def test_default_model_long_prefill_bit_identical(default_model_path, precision, quantization):
    """A first step of 326 tokens: the stack runs its MLP over 256 rows at a time (kMlpRows: 256 + 70),
    the per-op path over all of them at once."""
    model = packed_model(default_model_path, precision, quantization)
    assert_bit_identical(model, prompts_for(model.config.vocab_size, (170, 5, 1, 150, 30)), num_blocks=112)


def test_int8_channels_bit_identical(case_dir):
    """--quantization int8 (Int8Linear): every linear as int8 channels, int8_linear in the stack."""
    model = packed_model(case_dir, quantization="int8")
    assert {type(layer.mlp.down_proj.kernel).__name__ for layer in model.model.layers} == {"Int8Linear"}
    assert_bit_identical(model, prompts_for(model.config.vocab_size))


def test_default_model_bf16_activations_bit_identical(default_model_path):
    """cpu_precision "bfloat16" (the CPU default where a bf16 dot product exists): the stack runs
    packed_linear_bf16 as PackedBf16Activations does."""
    model = packed_model(default_model_path, "bfloat16")
    assert_bit_identical(model, prompts_for(model.config.vocab_size), num_blocks=64)


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_engine_fused_and_per_op_give_identical_outputs(default_model_path, quantization):
    prompts = [{"prompt_token_ids": p} for p in prompts_for(49152, (9, 30, 2))]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    results = {}
    for fused in (True, False):
        llm = LLM(str(default_model_path), device="cpu", cpu_fused_layers=fused, max_model_len=256,
                  max_num_batched_tokens=16, max_num_seqs=4, quantization=quantization)
        assert (llm.llm_engine.worker.model.model.fused is not None) is fused
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[fused] = [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in step.items()}
                                                    for step in o.outputs[0].logprobs]) for o in outs]
        llm.shutdown()
    assert results[True] == results[False]


def test_models_the_stack_cannot_run_keep_the_per_op_path(tmp_path):
    import transformers

    gemma = make_hf_model(transformers.GemmaConfig, seed=1, **{**COMMON, "hidden_act": "gelu_pytorch_tanh"})
    round_to_bf16(gemma).save_pretrained(tmp_path / "gemma")
    model = packed_model(tmp_path / "gemma")
    assert "embeddings are scaled" in unfusable_reason(model.model)
    assert not fuse_decoder_layers(model) and model.model.fused is None

    llama = make_hf_model(transformers.LlamaConfig, seed=1, **COMMON)
    llama.save_pretrained(tmp_path / "float32")  # not bf16-exact: "auto" keeps torch's float32 GEMMs
    unpacked = build_model(ModelConfig.from_model_dir(tmp_path / "float32", dtype="float32", device="cpu"), "cpu")
    assert not pack_cpu_weights(unpacked, "auto")
    assert "float32 weights" in unfusable_reason(unpacked.model)
    assert not fuse_decoder_layers(unpacked)


def test_bad_inputs_are_clear_errors(case_dir):
    model = packed_model(case_dir)
    stack = FusedDecoderStack(model.model)
    runner = PagedBatchRunner(Recorded(model, stack), num_blocks=16)
    runner.add("a", [5, 6, 7])
    runner.step([("a", 3)])  # a valid step first: the stack has scratch from here on
    config = model.config
    attn = runner._metadata([("a", 1)], [0], [0, 1], [1])
    ids, positions = torch.tensor([config.vocab_size], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"input_ids\[0\] = 256 is not a token id in \[0, 256\)"):
        stack(ids, positions, attn, runner.kv_cache)
    with pytest.raises(ValueError, match="DecoderStack: kv_cache must have size"):
        stack(ids - 1, positions, attn, runner.kv_cache[1:])


def test_default_model_fused_matches_transformers(default_model_path):
    """The independent oracle: the packed, fused default model's logits over a prompt and its greedy tokens
    against transformers' float32 forward (the bf16 checkpoint's weights are exact in the tiles)."""
    from transformers import AutoModelForCausalLM

    model = packed_model(default_model_path)
    assert fuse_decoder_layers(model)
    hf_model = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32,
                                                    local_files_only=True).eval()
    prompt = prompts_for(model.config.vocab_size, (37,))[0]
    runner = PagedBatchRunner(model, block_size=16, num_blocks=16)
    runner.add("s", prompt)
    ours = [runner.step([("s", len(prompt))])["s"]]
    for _ in range(4):
        runner.append("s", int(ours[-1][-1].argmax()))
        ours.append(runner.step([("s", 1)])["s"])
    tokens = prompt + [int(logits[-1].argmax()) for logits in ours[:-1]]
    with torch.no_grad():
        expected = hf_model(torch.tensor([tokens])).logits[0]
    ours_all = torch.cat(ours)
    error = ((ours_all.double() - expected.double()).norm() / expected.double().norm()).item()
    assert error < 1e-4
    assert torch.equal(ours_all.argmax(-1), expected.argmax(-1))


def test_gguf_blocks_bit_identical(tmp_path, monkeypatch):
    """A GGUF file's blocks kept as they are (GgufLinear, GgufRows): one ggml type per linear (Q8_0, the MLP
    down projection Q4_0, the tied embedding Q4_1) runs in the stack, bit-identical to the per-op path."""
    from gguf import GGMLQuantizationType as T
    from transformers import LlamaConfig

    from pagedserve.models.gguf_model_dir import gguf_model_dir
    from test_gguf_models import TINY, ours_from, write_tiny_gguf

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    source = make_hf_model(LlamaConfig, seed=5, tie_word_embeddings=True, **TINY)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", source, dict(ffn_down=T.Q4_0), T.Q4_1, None)
    model = ours_from(gguf_model_dir(path, tmp_path / "cache"))
    assert_bit_identical(model, prompts_for(TINY["vocab_size"]))


def test_gguf_projection_of_mixed_block_types_keeps_the_per_op_path(tmp_path, monkeypatch):
    """llama.cpp's Q4_K_M files quantize attn_v apart from attn_q/attn_k: the merged qkv is two kernel calls."""
    from gguf import GGMLQuantizationType as T
    from transformers import LlamaConfig

    from pagedserve.models.gguf_model_dir import gguf_model_dir
    from test_gguf_models import TINY, ours_from, write_tiny_gguf

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    source = make_hf_model(LlamaConfig, seed=5, tie_word_embeddings=True, **TINY)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", source, dict(attn_v=T.Q4_1), T.Q8_0, None)
    model = ours_from(gguf_model_dir(path, tmp_path / "cache"))
    assert "mix block types" in unfusable_reason(model.model)
    assert not fuse_decoder_layers(model)
