"""A decode step of one and of two sequences on a CUDA GPU, where the small-batch kernels take over (hidden size
2048: small_batch_linear for the projections, gate/up with SiLU, qkv_linear_rope_cache for the attention's
input; dependent launches inside CUDA graphs), against transformers on the same GPU: every generated token's
logprob, teacher-forced through transformers in bf16 and float32, agrees with float32 as closely as
transformers' own bf16 does (the families' rule), and every greedy token is float32's choice or a near-tie.

Random weights (Llama without biases, Qwen2 with qkv biases), two layers. Skipped without a GPU;
scripts/gpu_check.sh runs it in its engine stage.
"""

from __future__ import annotations

import pytest
import torch

from hf_helpers import make_hf_model
from pagedserve import LLM, SamplingParams
from test_gpu_families import GPU_SHAPE, pytestmark  # noqa: F401  (skipped as the families are: GPU and CUDA build)

# Hidden and intermediate 2048: every product of a one- or two-row step takes the small-batch kernels.
SHAPE = {**GPU_SHAPE, "hidden_size": 2048, "intermediate_size": 2048, "num_attention_heads": 32,
         "num_key_value_heads": 4, "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 512}
NEW_TOKENS = 32


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 512, (n,), generator=generator).tolist() for n in (7, 19)]


def _generate(path, prompts):
    llm = LLM(str(path), device="cuda", dtype="bfloat16", seed=0, block_size=16, max_num_seqs=2, max_model_len=256,
              num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return [(o.outputs[0].token_ids, [e[t].logprob for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def _teacher_forced(model, prompt, tokens, dtype):
    model = model.to("cuda", dtype)
    ids = torch.tensor([prompt + tokens[:-1]], device="cuda")
    with torch.no_grad():
        return model(ids).logits[0, len(prompt) - 1:].float().log_softmax(-1)


@pytest.mark.parametrize("family", ["LlamaConfig", "Qwen2Config"])
def test_one_and_two_row_decode_agrees_with_transformers(family, tmp_path):
    import transformers

    model = make_hf_model(getattr(transformers, family), seed=3, **SHAPE)
    model.save_pretrained(tmp_path)
    prompts = _prompts()
    alone = _generate(tmp_path, prompts[:1])  # decode steps of one row
    together = _generate(tmp_path, prompts)  # of two rows
    for prompt, (tokens, logprobs) in [(prompts[0], alone[0]), *zip(prompts, together)]:
        lp32 = _teacher_forced(model, prompt, tokens, torch.float32)
        lp16 = _teacher_forced(model, prompt, tokens, torch.bfloat16)
        chosen = torch.tensor(tokens, device="cuda")[:, None]
        ref32, ref16 = lp32.gather(1, chosen)[:, 0].cpu(), lp16.gather(1, chosen)[:, 0].cpu()
        ours = torch.tensor(logprobs)
        hf_gap, our_gap = (ref16 - ref32).abs(), (ours - ref32).abs()
        bound = torch.clamp(4 * hf_gap.max(), min=0.1)
        assert our_gap.max() <= bound, (family, our_gap.max().item(), hf_gap.max().item())
        # Greedy: float32's choice, or a token float32 rates within the same bound of its best.
        shortfall = lp32.max(-1).values.cpu() - ref32
        assert shortfall.max() <= bound, (family, shortfall.max().item())
