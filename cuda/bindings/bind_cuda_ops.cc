// pagedserve._core.cuda_ops: the CUDA kernels (cuda/cuda_ops.h), in the call
// shape of pagedserve._core.ops (cpp/bindings/op_binding.h). The trailing
// `stream` is the integer handle of the caller's stream,
// torch.cuda.current_stream().cuda_stream; every kernel is enqueued on it.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <optional>
#include <string_view>

#include "bindings/bindings.h"
#include "bindings/op_binding.h"
#include "cuda_ops.h"
#include "ops/tensor_view.h"

namespace py = pybind11;

namespace pagedserve::bindings {

template <>
struct FromPython<cudaStream_t> {
  using type = std::uintptr_t;
  static cudaStream_t read(std::uintptr_t handle, std::string_view /*op*/, std::string_view /*arg*/) {
    return reinterpret_cast<cudaStream_t>(handle);
  }
};

namespace {

using ops::TensorView;

// workspace may be None: no decode row spans two partitions; decode_order None: row order.
void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables, const TensorView& query_start_loc,
                     const TensorView& seq_lens, float scale, int max_query_len, int max_seq_len, int num_decodes,
                     const std::optional<TensorView>& workspace, int window, float softcap, bool fixed_split,
                     const std::optional<TensorView>& decode_order, cudaStream_t stream) {
  cuda::paged_attention(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                        max_query_len, max_seq_len, num_decodes, workspace.value_or(TensorView{}),
                        decode_order.value_or(TensorView{}), {window, softcap, fixed_split}, stream);
}

void small_batch_linear(const TensorView& out, const TensorView& x, const TensorView& weight,
                        const std::optional<TensorView>& bias, bool gated, cudaStream_t stream) {
  cuda::small_batch_linear(out, x, weight, bias.value_or(TensorView{}), gated, stream);
}

void qkv_linear_rope_cache(const TensorView& query_out, const TensorView& x, const TensorView& weight,
                           const std::optional<TensorView>& bias, const TensorView& positions,
                           const TensorView& cos_sin, const TensorView& key_cache, const TensorView& value_cache,
                           const TensorView& slot_mapping, cudaStream_t stream) {
  cuda::qkv_linear_rope_cache(query_out, x, weight, bias.value_or(TensorView{}), positions, cos_sin, key_cache,
                              value_cache, slot_mapping, stream);
}

void qkv_rope_cache(const TensorView& query_out, const TensorView& qkv, const TensorView& positions,
                    const TensorView& cos_sin, const TensorView& key_cache, const TensorView& value_cache,
                    const TensorView& slot_mapping, const std::optional<TensorView>& q_norm,
                    const std::optional<TensorView>& k_norm, float eps, cudaStream_t stream) {
  cuda::qkv_rope_cache(query_out, qkv, positions, cos_sin, key_cache, value_cache, slot_mapping,
                       {q_norm.value_or(TensorView{}), k_norm.value_or(TensorView{}), eps}, stream);
}

void sample_tokens(const TensorView& out, const TensorView& logits, const TensorView& inv_temperature,
                   const std::optional<TensorView>& allowed, uint64_t seed, cudaStream_t stream) {
  cuda::sample_tokens(out, logits, inv_temperature, allowed.value_or(TensorView{}), seed, stream);
}

}  // namespace

void bind_cuda_ops(py::module_& m) {
  const auto stream = py::arg("stream");
  constexpr Gil kHold = Gil::kHold;
  def_op<kHold>(m, "rms_norm", &cuda::rms_norm,
                "out = x / sqrt(mean(x^2) + eps) * weight, per row. x, out: [T, H]; weight: [H]. fixed_order: rows "
                "summed in an order fixed by H (batch-invariant) instead of torch's for T rows.",
                py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("fixed_order") = false,
                stream);
  def_op<kHold>(m, "fused_add_rms_norm", &cuda::fused_add_rms_norm,
                "In place: residual += x; x = rms_norm(residual) * weight (fixed_order: as rms_norm).",
                py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
                py::arg("fixed_order") = false, stream);
  def_op<kHold>(m, "rotary_embedding", &cuda::rotary_embedding,
                "In place NeoX-style rotary embedding of query [T, Hq, D] and key [T, Hkv, D] by cos_sin_cache "
                "[max_position, R] float32.",
                py::arg("positions"), py::arg("query"), py::arg("key"), py::arg("cos_sin_cache"), stream);
  def_op<kHold>(m, "silu_and_mul", &cuda::silu_and_mul, "out = silu(x[:, :I]) * x[:, I:].",
                py::arg("out"), py::arg("x"), stream);
  def_op<kHold>(m, "reshape_and_cache", &cuda::reshape_and_cache,
                "Writes each token's key/value into its cache slot; negative slots (padding) are skipped.",
                py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"),
                py::arg("slot_mapping"), stream);
  def_op<kHold>(m, "copy_blocks", &cuda::copy_blocks,
                "Copies block src to dst for each (src, dst) row, in every layer's keys and values; the copies of "
                "one call run in parallel, so no copy may read a block another writes.",
                py::arg("kv_cache"), py::arg("block_copies"), stream);
  def_op<kHold>(m, "paged_attention", &paged_attention,
                "Causal paged attention over a mixed batch: decode rows [0, num_decodes) run the split-K decode "
                "kernel, the rest the prefill kernel. workspace (or None when no decode row spans two "
                "partitions): at least paged_attention_workspace_bytes(num_decodes, Hq, D, max_seq_len) bytes. "
                "window > 0: sliding window, softcap > 0: logit soft-capping (cpp/ops/attention_options.h). "
                "decode_order (or None): an int32 permutation of [0, num_decodes), the order the decode rows' "
                "CTAs launch in (longest contexts first keeps the card busy to the end).",
                py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"),
                py::arg("block_tables"), py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"),
                py::arg("max_query_len"), py::arg("max_seq_len"), py::arg("num_decodes"),
                py::arg("workspace").none(true), py::arg("window"), py::arg("softcap"),
                py::arg("fixed_split") = false, py::arg("decode_order").none(true) = py::none(), stream);
  def_op<kHold>(m, "qkv_rope_cache", &qkv_rope_cache,
                "query_out = rotated q columns of qkv; rotated k and v written into their cache slots (one pass); "
                "q_norm / k_norm (or None): rms_norm of each q / k head first.",
                py::arg("query_out"), py::arg("qkv"), py::arg("positions"), py::arg("cos_sin_cache"), py::arg("key_cache"),
                py::arg("value_cache"), py::arg("slot_mapping"), py::arg("q_norm").none(true) = py::none(),
                py::arg("k_norm").none(true) = py::none(), py::arg("eps") = 0.0f, stream);
  def_op<kHold>(m, "small_batch_linear", &small_batch_linear,
                "out = x weight^T (+ bias) for 1..8 rows; gated: weight = [gate; up], out = silu(gate) * up.",
                py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(),
                py::arg("gated") = false, stream);
  def_op<kHold>(m, "qkv_linear_rope_cache", &qkv_linear_rope_cache,
                "qkv_rope_cache of x weight^T (+ bias) for 1..4 rows of x, in one kernel.", py::arg("query_out"),
                py::arg("x"), py::arg("weight"), py::arg("bias").none(true), py::arg("positions"),
                py::arg("cos_sin_cache"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"),
                stream);
  def_op<kHold>(m, "grouped_linear", &cuda::grouped_linear,
                "Mixture-of-experts products: out[r] = x[r] weight[e]^T for the rows [expert_offsets[e], "
                "expert_offsets[e + 1]) of each expert e (cpp/ops/grouped_linear.h).",
                py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("expert_offsets"), stream);
  def_op<kHold>(m, "sample_tokens", &sample_tokens,
                "Gumbel-max sampling of one token per row (see cpp/ops/ops.h).",
                py::arg("out"), py::arg("logits"), py::arg("inv_temperature"), py::arg("allowed").none(true),
                py::arg("seed"), stream);
  def_op<kHold>(m, "wait_for_flag", &cuda::wait_for_flag,
                "The stream waits until flag[0] >= target (a pinned int64 [2] the host raises); after timeout_seconds "
                "it sets flag[1] = 1 and goes on (see cpp/ops/ops.h).",
                py::arg("flag"), py::arg("target"), py::arg("timeout_seconds"), stream);

  m.def("prefill_attention_kernel", &cuda::prefill_attention_kernel, py::arg("head_dim"),
        "The kernel prefill rows of this head dim (float16 / bfloat16) run on here: \"wgmma\" or \"mma.sync\".");
  m.def("paged_attention_workspace_bytes", &cuda::paged_attention_workspace_bytes, py::arg("num_seqs"),
        py::arg("num_heads"), py::arg("head_dim"), py::arg("max_seq_len"),
        "Bytes of split-K scratch paged_attention needs for num_seqs decode rows (allocate once, any dtype).");
}

}  // namespace pagedserve::bindings
