// pagedserve._core.cuda_ops: the CUDA kernels (cuda/cuda_ops.h) for Python.
//
// Tensors arrive as DLPack capsules (torch.utils.dlpack.to_dlpack(t)); each
// is borrowed for the call, never consumed, so torch still owns and frees it.
// The trailing `stream` is the integer handle of the torch stream to launch
// on: torch.cuda.current_stream().cuda_stream.
#include <cuda_runtime_api.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // std::optional arguments

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

#include "bindings/bindings.h"
#include "cuda_ops.h"
#include "ops/tensor_view.h"

namespace pagedserve::bindings {
namespace {

namespace py = pybind11;
using ops::TensorView;

// Reads argument `arg` of `op` from its capsule without consuming it; any
// problem becomes a ValueError naming both.
TensorView borrow(const py::capsule& capsule, const char* op, const char* arg) {
  const char* name = capsule.name();
  if (name == nullptr || std::string_view(name) != "dltensor") {
    throw py::value_error(std::string(op) + ": " + arg +
                          " must be an unused 'dltensor' capsule from torch.utils.dlpack.to_dlpack");
  }
  try {
    return ops::view_from_dlpack(capsule.get_pointer());
  } catch (const std::invalid_argument& e) {
    constexpr std::string_view kParser = "view_from_dlpack: ";
    std::string_view reason = e.what();
    if (reason.starts_with(kParser)) reason.remove_prefix(kParser.size());
    throw py::value_error(std::string(op) + ": " + arg + ": " + std::string(reason));
  }
}

// Binds the op name once, so each lambda lists only its arguments.
struct Borrower {
  const char* op;
  TensorView operator()(const py::capsule& capsule, const char* arg) const { return borrow(capsule, op, arg); }
};

cudaStream_t as_stream(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

}  // namespace

void bind_cuda_ops(py::module_& m) {
  m.def(
      "rms_norm",
      [](const py::capsule& out, const py::capsule& x, const py::capsule& weight, float eps, std::uintptr_t stream) {
        const Borrower arg{"rms_norm"};
        cuda::rms_norm(arg(out, "out"), arg(x, "x"), arg(weight, "weight"), eps, as_stream(stream));
      },
      py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("stream"),
      "out = x / sqrt(mean(x^2) + eps) * weight, per row. x, out: [T, H]; weight: [H].");

  m.def(
      "fused_add_rms_norm",
      [](const py::capsule& x, const py::capsule& residual, const py::capsule& weight, float eps,
         std::uintptr_t stream) {
        const Borrower arg{"fused_add_rms_norm"};
        cuda::fused_add_rms_norm(arg(x, "x"), arg(residual, "residual"), arg(weight, "weight"), eps,
                                 as_stream(stream));
      },
      py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("stream"),
      "In place: residual += x; x = rms_norm(residual) * weight.");

  m.def(
      "rotary_embedding",
      [](const py::capsule& positions, const py::capsule& query, const py::capsule& key,
         const py::capsule& cos_sin_cache, std::uintptr_t stream) {
        const Borrower arg{"rotary_embedding"};
        cuda::rotary_embedding(arg(positions, "positions"), arg(query, "query"), arg(key, "key"),
                               arg(cos_sin_cache, "cos_sin_cache"), as_stream(stream));
      },
      py::arg("positions"), py::arg("query"), py::arg("key"), py::arg("cos_sin_cache"), py::arg("stream"),
      "In place NeoX-style rotary embedding of query [T, Hq, D] and key [T, Hkv, D] by cos_sin_cache "
      "[max_position, R] float32.");

  m.def(
      "silu_and_mul",
      [](const py::capsule& out, const py::capsule& x, std::uintptr_t stream) {
        const Borrower arg{"silu_and_mul"};
        cuda::silu_and_mul(arg(out, "out"), arg(x, "x"), as_stream(stream));
      },
      py::arg("out"), py::arg("x"), py::arg("stream"), "out = silu(x[:, :I]) * x[:, I:].");

  m.def(
      "sample_tokens",
      [](const py::capsule& out, const py::capsule& logits, const py::capsule& inv_temperature, uint64_t seed,
         std::uintptr_t stream) {
        const Borrower arg{"sample_tokens"};
        cuda::sample_tokens(arg(out, "out"), arg(logits, "logits"), arg(inv_temperature, "inv_temperature"), seed,
                            as_stream(stream));
      },
      py::arg("out"), py::arg("logits"), py::arg("inv_temperature"), py::arg("seed"), py::arg("stream"),
      "Gumbel-max sampling of one token per row (see cpp/ops/ops.h).");

  m.def(
      "reshape_and_cache",
      [](const py::capsule& key, const py::capsule& value, const py::capsule& key_cache, const py::capsule& value_cache,
         const py::capsule& slot_mapping, std::uintptr_t stream) {
        const Borrower arg{"reshape_and_cache"};
        cuda::reshape_and_cache(arg(key, "key"), arg(value, "value"), arg(key_cache, "key_cache"),
                                arg(value_cache, "value_cache"), arg(slot_mapping, "slot_mapping"),
                                as_stream(stream));
      },
      py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"),
      py::arg("stream"), "Writes each token's key/value into its cache slot; negative slots (padding) are skipped.");

  m.def(
      "copy_blocks",
      [](const py::capsule& kv_cache, const py::capsule& block_copies, std::uintptr_t stream) {
        const Borrower arg{"copy_blocks"};
        cuda::copy_blocks(arg(kv_cache, "kv_cache"), arg(block_copies, "block_copies"), as_stream(stream));
      },
      py::arg("kv_cache"), py::arg("block_copies"), py::arg("stream"),
      "Copies block src to dst for each (src, dst) row, in every layer's keys and values; the copies of one "
      "call run in parallel, so no copy may read a block another writes.");

  m.def(
      "paged_attention",
      [](const py::capsule& out, const py::capsule& query, const py::capsule& key_cache, const py::capsule& value_cache,
         const py::capsule& block_tables, const py::capsule& query_start_loc, const py::capsule& seq_lens, float scale,
         int max_query_len, int max_seq_len, int num_decodes, const std::optional<py::capsule>& workspace,
         std::uintptr_t stream) {
        const Borrower arg{"paged_attention"};
        const TensorView scratch = workspace ? arg(*workspace, "workspace") : TensorView{};
        cuda::paged_attention(arg(out, "out"), arg(query, "query"), arg(key_cache, "key_cache"),
                              arg(value_cache, "value_cache"), arg(block_tables, "block_tables"),
                              arg(query_start_loc, "query_start_loc"), arg(seq_lens, "seq_lens"), scale,
                              max_query_len, max_seq_len, num_decodes, scratch, as_stream(stream));
      },
      py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
      py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"), py::arg("max_query_len"),
      py::arg("max_seq_len"), py::arg("num_decodes"), py::arg("workspace").none(true), py::arg("stream"),
      "Causal paged attention over a mixed batch: decode rows [0, num_decodes) run the split-K decode kernel, "
      "the rest the prefill kernel. workspace (or None when no decode row spans two partitions): at least "
      "paged_attention_workspace_bytes(num_decodes, Hq, D, max_seq_len) bytes.");

  m.def("paged_attention_workspace_bytes", &cuda::paged_attention_workspace_bytes, py::arg("num_seqs"),
        py::arg("num_heads"), py::arg("head_dim"), py::arg("max_seq_len"),
        "Bytes of split-K scratch paged_attention needs for num_seqs decode rows (allocate once, any dtype).");
}

}  // namespace pagedserve::bindings
