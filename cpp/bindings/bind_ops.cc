// pagedserve._core.ops: the CPU reference ops, in the call shape of
// pagedserve._core.cuda_ops (op_binding.h): the same arguments, the
// trailing stream included (0: the CPU ops run on the calling thread).
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bindings.h"
#include "bindings/op_binding.h"
#include "ops/cpu_isa.h"
#include "ops/gguf_ops.h"
#include "ops/ops.h"
#include "ops/tensor_view.h"

namespace py = pybind11;

namespace pagedserve::bindings {
namespace {

using ops::TensorView;

// The stream a CPU op is called with: 0, the calling thread.
struct HostStream {};

}  // namespace

template <>
struct FromPython<HostStream> {
  using type = std::uintptr_t;
  static HostStream read(std::uintptr_t stream, std::string_view op, std::string_view arg) {
    if (stream != 0) {
      throw py::value_error(std::string(op) + ": " + std::string(arg) +
                            " must be 0 for the cpu ops (they run on the calling thread), got " +
                            std::to_string(stream));
    }
    return {};
  }
};

namespace {

// ops::<op> with the trailing stream of its CUDA twin.
template <auto fn>
struct OnHost;
template <typename... Params, void (*fn)(Params...)>
struct OnHost<fn> {
  static void call(Params... args, HostStream) { fn(args...); }
};

// cuda_ops.paged_attention's arguments: its launch bounds, split-K workspace
// and launch order mean nothing to the CPU kernel, which plans from the batch itself.
void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables, const TensorView& query_start_loc,
                     const TensorView& seq_lens, float scale, int /*max_query_len*/, int /*max_seq_len*/,
                     int /*num_decodes*/, const std::optional<TensorView>& /*workspace*/, int window, float softcap,
                     bool fixed_split, const std::optional<TensorView>& /*decode_order*/, HostStream) {
  ops::paged_attention(out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                       {window, softcap, fixed_split});
}

// The CPU norms always sum a row in an order fixed by its width: fixed_order changes nothing here.
void rms_norm(const TensorView& out, const TensorView& x, const TensorView& weight, float eps, bool /*fixed_order*/,
              HostStream) {
  ops::rms_norm(out, x, weight, eps);
}

void fused_add_rms_norm(const TensorView& x, const TensorView& residual, const TensorView& weight, float eps,
                        bool /*fixed_order*/, HostStream) {
  ops::fused_add_rms_norm(x, residual, weight, eps);
}

void small_batch_linear(const TensorView& out, const TensorView& x, const TensorView& weight,
                        const std::optional<TensorView>& bias, bool gated, HostStream) {
  ops::small_batch_linear(out, x, weight, bias.value_or(TensorView{}), gated);
}

void qkv_linear_rope_cache(const TensorView& query_out, const TensorView& x, const TensorView& weight,
                           const std::optional<TensorView>& bias, const TensorView& positions,
                           const TensorView& cos_sin, const TensorView& key_cache, const TensorView& value_cache,
                           const TensorView& slot_mapping, HostStream) {
  ops::qkv_linear_rope_cache(query_out, x, weight, bias.value_or(TensorView{}), positions, cos_sin, key_cache,
                             value_cache, slot_mapping);
}

void qkv_rope_cache(const TensorView& query_out, const TensorView& qkv, const TensorView& positions,
                    const TensorView& cos_sin, const TensorView& key_cache, const TensorView& value_cache,
                    const TensorView& slot_mapping, const std::optional<TensorView>& q_norm,
                    const std::optional<TensorView>& k_norm, float eps, HostStream) {
  ops::qkv_rope_cache(query_out, qkv, positions, cos_sin, key_cache, value_cache, slot_mapping,
                      {q_norm.value_or(TensorView{}), k_norm.value_or(TensorView{}), eps});
}

void sample_tokens(const TensorView& out, const TensorView& logits, const TensorView& inv_temperature,
                   const std::optional<TensorView>& allowed, uint64_t seed, HostStream) {
  ops::sample_tokens(out, logits, inv_temperature, allowed.value_or(TensorView{}), seed);
}

void rope_cos_sin_cache(const TensorView& cos_sin, double theta, double factor, double low_freq_factor,
                        double high_freq_factor, int64_t original_max_position) {
  ops::rope_cos_sin_cache(cos_sin, theta, {factor, low_freq_factor, high_freq_factor, original_max_position});
}

}  // namespace

void bind_ops(py::module_& m) {
  const auto stream = py::arg("stream") = 0;
  constexpr Gil kRelease = Gil::kRelease;
  def_op<kRelease>(m, "rms_norm", &rms_norm,
                   "out = x / sqrt(mean(x^2) + eps) * weight, row-wise. x, out: [T, H]; weight: [H].",
                   py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("eps"),
                   py::arg("fixed_order") = false, stream);
  def_op<kRelease>(m, "fused_add_rms_norm", &fused_add_rms_norm,
                   "In place: residual += x; x = rms_norm(residual) * weight.",
                   py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
                   py::arg("fixed_order") = false, stream);
  def_op<kRelease>(m, "rotary_embedding", &OnHost<&ops::rotary_embedding>::call,
                   "In place NeoX-style rotary embedding of query [T, Hq, D] and key [T, Hkv, D].",
                   py::arg("positions"), py::arg("query"), py::arg("key"), py::arg("cos_sin_cache"), stream);
  def_op<kRelease>(m, "silu_and_mul", &OnHost<&ops::silu_and_mul>::call, "out = silu(x[:, :I]) * x[:, I:].",
                   py::arg("out"), py::arg("x"), stream);
  def_op<kRelease>(m, "reshape_and_cache", &OnHost<&ops::reshape_and_cache>::call,
                   "Writes each token's key/value into its cache slot; slot -1 (padding) is skipped.",
                   py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"),
                   py::arg("slot_mapping"), stream);
  def_op<kRelease>(m, "copy_blocks", &OnHost<&ops::copy_blocks>::call,
                   "Copies block src to dst for each (src, dst) row, in every layer's keys and values, in order.",
                   py::arg("kv_cache"), py::arg("block_copies"), stream);
  def_op<kRelease>(m, "paged_attention", &paged_attention,
                   "Causal paged attention over a mixed varlen batch (see cpp/ops/ops.h); window > 0: sliding "
                   "window, softcap > 0: logit soft-capping (cpp/ops/attention_options.h). The CUDA launch bounds, "
                   "workspace and decode_order are accepted and unused.",
                   py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"),
                   py::arg("block_tables"), py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"),
                   py::arg("max_query_len") = 0, py::arg("max_seq_len") = 0, py::arg("num_decodes") = 0,
                   py::arg("workspace") = py::none(), py::arg("window") = 0, py::arg("softcap") = 0.0f,
                   py::arg("fixed_split") = false, py::arg("decode_order").none(true) = py::none(), stream);
  def_op<kRelease>(m, "grouped_linear", &OnHost<&ops::grouped_linear>::call,
                   "Mixture-of-experts products: out[r] = x[r] weight[e]^T for the rows [expert_offsets[e], "
                   "expert_offsets[e + 1]) of each expert e (cpp/ops/grouped_linear.h).",
                   py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("expert_offsets"), stream);
  def_op<kRelease>(m, "qkv_rope_cache", &qkv_rope_cache,
                   "query_out = rotated q columns of qkv; rotated k and v written into their cache slots (one pass); "
                   "q_norm / k_norm (or None): rms_norm of each q / k head first.",
                   py::arg("query_out"), py::arg("qkv"), py::arg("positions"), py::arg("cos_sin_cache"), py::arg("key_cache"),
                   py::arg("value_cache"), py::arg("slot_mapping"), py::arg("q_norm").none(true) = py::none(),
                   py::arg("k_norm").none(true) = py::none(), py::arg("eps") = 0.0f, stream);
  def_op<kRelease>(m, "small_batch_linear", &small_batch_linear,
                   "out = x weight^T (+ bias) for 1..8 rows; gated: weight = [gate; up], out = silu(gate) * up.",
                   py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(),
                   py::arg("gated") = false, stream);
  def_op<kRelease>(m, "qkv_linear_rope_cache", &qkv_linear_rope_cache,
                   "qkv_rope_cache of x weight^T (+ bias) for 1..4 rows of x (the CUDA kernel's reference).",
                   py::arg("query_out"), py::arg("x"), py::arg("weight"), py::arg("bias").none(true),
                   py::arg("positions"), py::arg("cos_sin_cache"), py::arg("key_cache"), py::arg("value_cache"),
                   py::arg("slot_mapping"), stream);
  def_op<kRelease>(m, "sample_tokens", &sample_tokens,
                   "Gumbel-max sampling of one token per row: argmax(logits * inv_temperature + gumbel noise); "
                   "rows with inv_temperature <= 0 are greedy; `allowed` (or None): an int32 [R, ceil(V / 32)] "
                   "bitmask of the eligible tokens.",
                   py::arg("out"), py::arg("logits"), py::arg("inv_temperature"), py::arg("allowed").none(true),
                   py::arg("seed"), stream);
  def_op<kRelease>(m, "wait_for_flag", &OnHost<&ops::wait_for_flag>::call,
                   "Waits until flag[0] >= target (an int64 [2] another thread raises); after timeout_seconds sets "
                   "flag[1] = 1 and returns (see cpp/ops/ops.h).",
                   py::arg("flag"), py::arg("target"), py::arg("timeout_seconds"), stream);

  // CPU only.
  def_op<kRelease>(m, "rope_cos_sin_cache", &rope_cos_sin_cache,
                   "Fills the float32 [max_position, rotary_dim] table [cos | sin]; factor > 0 applies Llama-3 "
                   "scaling.",
                   py::arg("cos_sin"), py::arg("theta"), py::arg("factor") = 0.0, py::arg("low_freq_factor") = 1.0,
                   py::arg("high_freq_factor") = 4.0, py::arg("original_max_position") = 8192);
  def_op<kRelease>(m, "pack_linear_weight", &ops::pack_linear_weight,
                   "Packs weight [N, K] into bf16 [ceil(N / 16), ceil(K / 32) * 16, 32] tiles "
                   "(cpp/ops/packed_weight_layout.h).",
                   py::arg("packed_weight"), py::arg("weight"));
  def_op<kRelease>(m, "packed_linear", &ops::packed_linear,
                   "out = x W^T (+ bias) in float32, W in packed bf16 tiles; x [M, K], out [M, N].",
                   py::arg("out"), py::arg("x"), py::arg("packed_weight"), py::arg("bias") = py::none());
  def_op<kRelease>(m, "packed_linear_float64_sums", &ops::packed_linear_float64_sums,
                   "out = x W^T, W in packed bf16 tiles, every sum in float64; x [M, K] float32, out [M, N] "
                   "float32 (rounded sums + bias) or float64 (the sums alone, no bias).",
                   py::arg("out"), py::arg("x"), py::arg("packed_weight"), py::arg("bias") = py::none());
  def_op<kRelease>(m, "packed_linear_bf16", &ops::packed_linear_bf16,
                   "out = bf16(x) W^T (+ bias), bf16 activations (float32 x rounded to nearest-even), float32 "
                   "sums; x [M, K] float32/bfloat16, out [M, N] float32/bfloat16.",
                   py::arg("out"), py::arg("x"), py::arg("packed_weight"), py::arg("bias") = py::none());
  def_op<kRelease>(m, "int8_linear", &ops::int8_linear,
                   "out = x W^T (+ bias) with int8 channel weights (cpp/ops/int8_weight_layout.h) and x "
                   "quantized to int8 per 64-block of each row; x [M, K] float32/bfloat16, out [M, N] float32.",
                   py::arg("out"), py::arg("x"), py::arg("packed_weight"), py::arg("scales"),
                   py::arg("bias") = py::none());

  def_op<kRelease>(m, "pack_grouped_weight", &ops::pack_grouped_weight,
                   "Packs weight [E, N, K] into bf16 [E, ceil(N / 16), ceil(K / 32) * 16, 32] tiles, one "
                   "pack_linear_weight per expert.",
                   py::arg("packed_weight"), py::arg("weight"));
  def_op<kRelease>(m, "packed_grouped_linear", &ops::packed_grouped_linear,
                   "grouped_linear in float32 with packed bf16 expert weights; x [R, K], out [R, N] float32.",
                   py::arg("out"), py::arg("x"), py::arg("packed_weight"), py::arg("expert_offsets"));

  def_op<kRelease>(m, "gguf_linear", &ops::gguf_linear,
                   "out = x W^T (+ bias) in float32, W as GGUF blocks [N, row_bytes] uint8 of ggml type `type` "
                   "(cpp/ops/gguf_ops.h); x [M, K], out [M, N] with contiguous rows.",
                   py::arg("out"), py::arg("x"), py::arg("blocks"), py::arg("type"), py::arg("bias") = py::none());
  def_op<kRelease>(m, "gguf_dequantize_rows", &ops::gguf_dequantize_rows,
                   "out[r] = row ids[r] of the GGUF blocks [N, row_bytes] of ggml type `type`, as float32 [R, K].",
                   py::arg("out"), py::arg("blocks"), py::arg("type"), py::arg("ids"));
  def_op<kRelease>(m, "gguf_interleave", &ops::gguf_interleave,
                   "out = the GGUF blocks [N, row_bytes] of ggml type `type` (N a multiple of 8) interleaved 8 rows "
                   "at a time (cpp/ops/gguf_interleaved.h), same shape.",
                   py::arg("out"), py::arg("blocks"), py::arg("type"));
  m.def("gguf_interleaved_type", &ops::gguf_interleaved_type, py::arg("type"), py::arg("rows"),
        "The ggml type number of the interleaved layout of `type` where gguf_linear has a kernel for it on this "
        "process's instruction set and `rows` suits it; else -1.");

  m.def("set_num_threads", &ops::set_num_threads, py::arg("num_threads"),
        "Threads the CPU ops may use (the caller's thread included).");
  m.def("num_threads", &ops::num_threads);

  m.def(
      "cpu_isa", [] { return std::string(ops::cpu_isa_name(ops::cpu_isa())); },
      "The instruction set the kernels run with: 'baseline' (SSE2), 'avx2', 'avx512', 'avx512_bf16' or 'amx'.");
  m.def(
      "packed_linear_bf16_kernel", [] { return std::string(ops::packed_linear_bf16_kernel()); },
      "The kernel packed_linear_bf16 runs now: 'amx_bf16', 'avx512_bf16' or '<level>_widened'.");
  m.def(
      "int8_linear_kernel", [] { return std::string(ops::int8_linear_kernel()); },
      "The kernel int8_linear runs now: 'amx_int8', 'avx512_vnni' or '<level>_int32'.");
  m.def(
      "supported_cpu_isas",
      [] {
        std::vector<std::string> names;
        for (ops::CpuIsa isa : ops::supported_cpu_isas()) names.emplace_back(ops::cpu_isa_name(isa));
        return names;
      },
      "The instruction sets this CPU can run, lowest first.");
  m.def(
      "set_cpu_isa",
      [](const std::string& name) {
        for (ops::CpuIsa isa : {ops::CpuIsa::kBaseline, ops::CpuIsa::kAvx2, ops::CpuIsa::kAvx512,
                                ops::CpuIsa::kAvx512Bf16, ops::CpuIsa::kAmx}) {
          if (ops::cpu_isa_name(isa) == name) return ops::set_cpu_isa(isa);
        }
        throw py::value_error("set_cpu_isa: unknown instruction set '" + name +
                              "'; expected baseline, avx2, avx512, avx512_bf16 or amx");
      },
      py::arg("name"), "For tests and benchmarks: run the kernels with a lower instruction set.");
}

}  // namespace pagedserve::bindings
