"""GGUF models run from their blocks, against independent oracles.

(a) A tiny random Llama written to GGUF here with gguf.GGUFWriter (Q8_0 / Q4_0 linears
    made by gguf.quants.quantize, or a Q4_K_M-like mix of random Q4_K / Q5_K / Q6_K blocks,
    which that package cannot make; F32 norms, q/k rows permuted as llama.cpp's converter
    does): pagedserve on the file vs transformers loading the same file (which
    dequantizes it and undoes the permutation itself). Both compute in float32 on the
    same dequantized weights, so logits agree to ~1e-6 relative; asserted < 1e-4, and
    greedy tokens identical. On AVX2 CPUs and above gguf_linear rounds activations to int8
    (every block format: cpp/ops/gguf_int8.h, as llama.cpp does), which moves logits by
    ~7e-3 relative on these tiny models: so the logits are checked twice, at the float32
    kernels' ISA level (< 1e-4, greedy identical: the layout check) and at the best level
    (< 2e-2: the int8 path end to end).
(b) The default model's shipped Q4_1 file vs the bf16 directory converted from it: the
    same weights, rounded to bf16 in the directory, so logits differ by that rounding
    (observed ~4e-3 relative with float32 kernels, ~2.3e-2 with the int8-activation
    path; asserted < 4e-2) and greedy choices agree on most positions
    (teacher-forced agreement printed and asserted >= 80%: 57/57 with float32 kernels, 49-52/57 with
    activations rounded to int8 per block as llama.cpp rounds them; p3 is a run of unrelated
    tokens whose next-token choices are near ties); the GGUF model's weights
    take less than half the bytes of the bf16 ones.
(c) Bad files get errors that say what is wrong.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T, GGUFWriter, quants

from hf_helpers import make_hf_model
from paged_helpers import PagedBatchRunner, relative_error
from pagedserve import _core
from pagedserve.models import build_model
from pagedserve.models.gguf_model_dir import gguf_model_dir
from pagedserve.models.model_config import ModelConfig
from pagedserve.testing.gguf_blocks import random_blocks

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0)
PROMPTS = {"a": [1, 17, 99, 4, 250, 31, 7], "b": [5, 6, 200, 13]}
_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to q/k rows (interleaves each head's rope halves)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2) \
        .reshape(weight.shape)


K_QUANT_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)


def random_k_blocks(qtype: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, row_bytes] random K-quant blocks whose weights stay below ~0.1 (float16 d and dmin of 1e-4..3e-4;
    Q6_K's int8 scales times d 4e-4..1.2e-3)."""
    scale = 4e-4 if qtype == T.Q6_K else 1e-4
    return random_blocks(qtype.name, n, k, rng, scale, 3 * scale)


def write_tiny_gguf(path: Path, hf_model, linear_types: dict[str, T], embed_type: T, output_type,
                    arch: str = "llama") -> Path:
    """hf_model as a GGUF of ``arch``: linears of the given types (default Q8_0), norms and biases F32;
    output_type None = tied. Only llama's q/k rows are permuted, as llama.cpp's converter does."""
    config = hf_model.config
    writer = GGUFWriter(str(path), arch)
    if arch == "qwen3":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_theta if hasattr(config, "rope_theta") else 10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)

    rng = np.random.default_rng(7)

    def add(name: str, tensor: torch.Tensor, qtype) -> None:
        data = tensor.detach().float().numpy()
        if qtype in (None, T.F32):
            writer.add_tensor(name, np.ascontiguousarray(data))
        elif qtype in K_QUANT_TYPES:  # gguf.quants cannot make these: random blocks (both engines read the file)
            writer.add_tensor(name, random_k_blocks(qtype, *data.shape, rng), raw_dtype=qtype)
        else:
            writer.add_tensor(name, quants.quantize(np.ascontiguousarray(data), qtype), raw_dtype=qtype)

    state = hf_model.state_dict()
    add("token_embd.weight", state["model.embed_tokens.weight"], embed_type)
    add("output_norm.weight", state["model.norm.weight"], None)
    if output_type is not None:
        add("output.weight", state["lm_head.weight"], output_type)
    names = dict(_GGUF_NAMES, **({"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
                                 if arch == "qwen3" else {}))
    for layer in range(config.num_hidden_layers):
        for ours, theirs in names.items():
            weight = state[f"model.layers.{layer}.{ours}.weight"]
            if arch == "llama" and ours == "self_attn.q_proj":
                weight = torch.from_numpy(llama_cpp_permute(weight.numpy(), config.num_attention_heads))
            if arch == "llama" and ours == "self_attn.k_proj":
                weight = torch.from_numpy(llama_cpp_permute(weight.numpy(), config.num_key_value_heads))
            qtype = None if weight.dim() == 1 else linear_types.get(theirs, T.Q8_0)
            add(f"blk.{layer}.{theirs}.weight", weight, qtype)
            bias = state.get(f"model.layers.{layer}.{ours}.bias")
            if bias is not None:
                add(f"blk.{layer}.{theirs}.bias", bias, None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def ours_from(model_dir: Path, dtype: str = "float32"):
    return build_model(ModelConfig.from_model_dir(model_dir, dtype=dtype, device="cpu"), "cpu")


INT8_ACTIVATIONS_TOLERANCE = 2e-2  # logits relative error with int8 activations (observed ~7e-3)


@contextmanager
def float_kernels():
    """Runs gguf_linear's float32 kernels: its int8-activation path runs at the AVX2 level and above."""
    before = _core.ops.cpu_isa()
    _core.ops.set_cpu_isa("baseline")
    try:
        yield
    finally:
        _core.ops.set_cpu_isa(before)


def run_prompts(model, prompts=PROMPTS) -> dict[str, torch.Tensor]:
    runner = PagedBatchRunner(model, block_size=4, num_blocks=64)
    for name, ids in prompts.items():
        runner.add(name, ids)
    return {name: logits.float() for name, logits in runner.step([(n, len(i)) for n, i in prompts.items()]).items()}


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    runner = PagedBatchRunner(model, block_size=4, num_blocks=64)
    runner.add("s", prompt)
    logits = runner.step([("s", len(prompt))])["s"][-1]
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        runner.append("s", tokens[-1])
        logits = runner.step([("s", 1)])["s"][-1]
    return tokens


def hf_greedy(hf_model, prompt: list[int], steps: int) -> list[int]:
    out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    return out[0, len(prompt):].tolist()


CASES = {
    "q8_0-untied": (dict(), T.Q8_0, T.Q4_0),
    # A Q4_K_M-like mix of K-quants (random blocks), K a multiple of their 256-weight super-blocks.
    "k-quants": (dict(attn_q=T.Q4_K, attn_k=T.Q4_K, attn_v=T.Q6_K, attn_output=T.Q4_K, ffn_gate=T.Q5_K,
                      ffn_up=T.Q4_K, ffn_down=T.Q6_K), T.Q6_K, T.Q6_K),
    # attn_v in another type than q/k: the merged qkv keeps one segment per type; tied LM head on Q4_0 blocks.
    "q4_0-mixed-tied": (dict(attn_q=T.Q4_0, attn_k=T.Q4_0, attn_output=T.Q4_0, ffn_gate=T.Q4_0, ffn_up=T.Q4_0,
                             ffn_down=T.Q4_0), T.Q4_0, None),
}


@pytest.mark.parametrize("case", CASES)
def test_tiny_gguf_matches_transformers_on_the_same_file(case, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, LlamaConfig

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    linear_types, embed_type, output_type = CASES[case]
    shape = dict(TINY, hidden_size=256, intermediate_size=512) if embed_type in K_QUANT_TYPES else TINY
    source = make_hf_model(LlamaConfig, seed=3, tie_word_embeddings=output_type is None, **shape)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", source, linear_types, embed_type, output_type)
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ours = ours_from(gguf_model_dir(path, tmp_path / "cache"))
    assert ours.model.embed_tokens.weight is None and ours.lm_head_kernel is not None  # blocks kept
    if _core.ops.cpu_isa() != "baseline":  # rows in eights: interleaved at load (cpp/ops/gguf_interleaved.h)
        assert all(segment.ggml_type >= 256 for segment in ours.lm_head_kernel.segments)

    logits = run_prompts(ours)
    with float_kernels():
        exact = run_prompts(ours)
        assert greedy(ours, PROMPTS["a"], 12) == hf_greedy(oracle, PROMPTS["a"], 12)
    for name, ids in PROMPTS.items():
        with torch.no_grad():
            expected = oracle(torch.tensor([ids])).logits[0]
        error = relative_error(logits[name], expected)
        print(f"\n{case} {name}: logits relative error vs transformers {error:.2e}")
        assert relative_error(exact[name], expected) < 1e-4, name
        assert error < INT8_ACTIVATIONS_TOLERANCE, name


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_tiny_qwen_gguf_matches_transformers(arch, tmp_path):
    """qwen2 (q/k/v biases) and qwen3 (q/k norms): no rope permutation in their files."""
    import transformers
    from transformers import AutoModelForCausalLM

    config_cls = transformers.Qwen2Config if arch == "qwen2" else transformers.Qwen3Config
    extra = dict(head_dim=16) if arch == "qwen3" else {}
    source = make_hf_model(config_cls, seed=7, tie_word_embeddings=True, **TINY, **extra)
    path = write_tiny_gguf(tmp_path / f"{arch}.gguf", source, dict(ffn_up=T.Q4_1), T.Q8_0, None, arch=arch)
    # transformers 5.23 maps no qwen3.attention.key_length to head_dim (it would take Qwen3Config's 128).
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32,
                                                  **extra).eval()
    ours = ours_from(gguf_model_dir(path, tmp_path / "cache"))
    assert ours.config.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    logits = run_prompts(ours)
    with float_kernels():
        exact = run_prompts(ours)
        assert greedy(ours, PROMPTS["b"], 8) == hf_greedy(oracle, PROMPTS["b"], 8)
    for name, ids in PROMPTS.items():
        with torch.no_grad():
            expected = oracle(torch.tensor([ids])).logits[0]
        assert relative_error(exact[name], expected) < 1e-4, name
        assert relative_error(logits[name], expected) < INT8_ACTIVATIONS_TOLERANCE, name


def test_tiny_gguf_through_the_engine(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pagedserve import LLM, SamplingParams

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    source = make_hf_model(LlamaConfig, seed=5, tie_word_embeddings=True, **TINY)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", source, dict(ffn_down=T.Q4_0), T.Q8_0, None)
    oracle = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    expected = hf_greedy(oracle, PROMPTS["a"], 10)
    # Quantized weights take a bf16 KV cache by default (worker/kv_cache.py); a float32 one when asked; a
    # GGUF file whose tensors are all F32 (dense, nothing quantized) keeps the exact mode's float32 cache.
    dense = write_tiny_gguf(tmp_path / "dense.gguf", source, {name: T.F32 for name in _GGUF_NAMES.values()},
                            T.F32, None)
    for gguf, kv_cache_dtype, kv_dtype in ((path, "auto", torch.bfloat16), (path, "float32", torch.float32),
                                           (dense, "auto", torch.float32)):
        llm = LLM(model=str(gguf), num_kv_blocks=64, device="cpu",  # a GPU host's attention has no head dim 16
                  kv_cache_dtype=kv_cache_dtype)
        assert llm.llm_engine.worker.kv_plan.dtype == kv_dtype, (gguf.name, kv_cache_dtype)
        if gguf == path:
            out = llm.generate([PROMPTS["a"]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
            assert list(out[0].outputs[0].token_ids) == expected, kv_cache_dtype
        llm.shutdown()


# ---------------------------------------------------------------------------
# (b) The default model's shipped Q4_1 file.

@pytest.fixture(scope="module")
def default_gguf() -> Path:
    from pagedserve.models.default_model import default_gguf_path

    return default_gguf_path()


def weight_bytes(model) -> int:
    """Bytes of every weight the model keeps (float parameters, kernels' blocks, lookup tables), each storage
    once: the tied LM head shares the embedding's blocks."""
    tensors = list(model.parameters())
    for module in model.modules():
        for attr in ("kernel", "lookup", "lm_head_kernel"):
            owner = getattr(module, attr, None)
            tensors += [segment.weight for segment in getattr(owner, "segments", ())]
            tensors += [owner.blocks] if hasattr(owner, "blocks") else []
    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(unique.values())


def test_default_q4_1_gguf_vs_its_bf16_conversion(default_gguf, default_model_path, tmp_path):
    quantized = ours_from(gguf_model_dir(default_gguf, tmp_path / "cache"))
    if _core.ops.cpu_isa() != "baseline":  # every linear and the tied head interleaved at load
        kernels = [m.kernel for m in quantized.modules() if getattr(m, "kernel", None) is not None]
        assert len(kernels) == 4 * 30 and quantized.lm_head_kernel is not None
        assert all(s.ggml_type >= 256 for k in kernels + [quantized.lm_head_kernel] for s in k.segments)
    dense = ours_from(default_model_path)
    prompts = {"p1": [1, 504, 3575, 282, 4649, 314], "p2": [1, 9690, 198, 2683, 359, 253, 5356, 30, 28, 11, 3000],
               "p3": list(range(300, 340))}
    ours, reference = run_prompts(quantized, prompts), run_prompts(dense, prompts)
    agree = total = 0
    for name in prompts:
        error = relative_error(ours[name], reference[name])
        print(f"\n{name}: logits relative error {error:.2e}")
        assert error < 4e-2, name
        agree += int((ours[name].argmax(-1) == reference[name].argmax(-1)).sum())
        total += len(prompts[name])
    print(f"\nQ4_1 GGUF vs bf16 directory: teacher-forced greedy agreement {agree}/{total}")
    assert agree >= 0.8 * total
    gguf_bytes = weight_bytes(quantized)
    bf16_bytes = sum(p.numel() for p in dense.parameters()) * 2
    print(f"weight bytes: GGUF {gguf_bytes / 2**20:.1f} MiB, bf16 {bf16_bytes / 2**20:.1f} MiB")
    assert gguf_bytes < 0.5 * bf16_bytes


# ---------------------------------------------------------------------------
# (c) Bad files.

def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        gguf_model_dir(path, tmp_path / "cache")
    with pytest.raises(ValueError, match="does not exist"):
        gguf_model_dir(tmp_path / "missing.gguf", tmp_path / "cache")


def _minimal_gguf(path: Path, arch: str, tensor_type=None) -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if tensor_type is None:
        writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    else:  # 4 rows of one 256-weight Q2_K block (84 bytes)
        writer.add_tensor("token_embd.weight", np.zeros((4, 84), dtype=np.uint8), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture(tmp_path):
    path = _minimal_gguf(tmp_path / "gpt2.gguf", "gpt2")
    with pytest.raises(ValueError, match=r"GGUF architecture 'gpt2' .* not supported; supported: llama, qwen2, qwen3"):
        gguf_model_dir(path, tmp_path / "cache")


def test_unsupported_tensor_type(tmp_path):
    path = _minimal_gguf(tmp_path / "q2k.gguf", "llama", T.Q2_K)
    with pytest.raises(ValueError, match=r"'token_embd.weight' .* has type Q2_K, which pagedserve does not support; "
                                         r"supported: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K, F32, F16, BF16"):
        gguf_model_dir(path, tmp_path / "cache")
