// pagedserve._core.cuda_ops: the CUDA kernels (cuda/cuda_ops.h) for Python.
//
// Tensors arrive as DLPack capsules (torch.utils.dlpack.to_dlpack(t)); each
// is borrowed for the call, never consumed, so torch still owns and frees it.
// The trailing `stream` is the integer handle of the torch stream to launch
// on: torch.cuda.current_stream().cuda_stream.
#include <cuda_runtime_api.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string_view>

#include "bindings/bindings.h"
#include "cuda_ops.h"
#include "ops/tensor_view.h"

namespace pagedserve::bindings {
namespace {

namespace py = pybind11;
using ops::TensorView;

TensorView borrow(const py::capsule& capsule) {
  const char* name = capsule.name();
  if (name == nullptr || std::string_view(name) != "dltensor") {
    throw py::value_error("expected an unused DLPack capsule named 'dltensor' (torch.utils.dlpack.to_dlpack(t))");
  }
  return ops::view_from_dlpack(capsule.get_pointer());
}

cudaStream_t as_stream(std::uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

}  // namespace

void bind_cuda_ops(py::module_& m) {
  m.def(
      "rms_norm",
      [](const py::capsule& out, const py::capsule& x, const py::capsule& weight, float eps, std::uintptr_t stream) {
        cuda::rms_norm(borrow(out), borrow(x), borrow(weight), eps, as_stream(stream));
      },
      py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("stream"),
      "out = x / sqrt(mean(x^2) + eps) * weight, per row.");

  m.def(
      "fused_add_rms_norm",
      [](const py::capsule& x, const py::capsule& residual, const py::capsule& weight, float eps,
         std::uintptr_t stream) {
        cuda::fused_add_rms_norm(borrow(x), borrow(residual), borrow(weight), eps, as_stream(stream));
      },
      py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), py::arg("stream"),
      "In place: residual += x; x = rms_norm(residual) * weight.");

  m.def(
      "rotary_embedding",
      [](const py::capsule& positions, const py::capsule& query, const py::capsule& key, const py::capsule& cos_sin,
         std::uintptr_t stream) {
        cuda::rotary_embedding(borrow(positions), borrow(query), borrow(key), borrow(cos_sin), as_stream(stream));
      },
      py::arg("positions"), py::arg("query"), py::arg("key"), py::arg("cos_sin"), py::arg("stream"),
      "In place half rotation of query [T, Hq, D] and key [T, Hkv, D] by cos_sin [max_position, R] float32.");

  m.def(
      "silu_and_mul",
      [](const py::capsule& out, const py::capsule& x, std::uintptr_t stream) {
        cuda::silu_and_mul(borrow(out), borrow(x), as_stream(stream));
      },
      py::arg("out"), py::arg("x"), py::arg("stream"), "out = silu(x[:, :I]) * x[:, I:].");

  m.def(
      "reshape_and_cache",
      [](const py::capsule& key, const py::capsule& value, const py::capsule& key_cache, const py::capsule& value_cache,
         const py::capsule& slot_mapping, std::uintptr_t stream) {
        cuda::reshape_and_cache(borrow(key), borrow(value), borrow(key_cache), borrow(value_cache),
                                borrow(slot_mapping), as_stream(stream));
      },
      py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"),
      py::arg("stream"), "Writes each token's key and value into its cache slot; negative slots are skipped.");

  m.def(
      "copy_blocks",
      [](const py::capsule& kv_cache, const py::capsule& block_copies, std::uintptr_t stream) {
        cuda::copy_blocks(borrow(kv_cache), borrow(block_copies), as_stream(stream));
      },
      py::arg("kv_cache"), py::arg("block_copies"), py::arg("stream"),
      "Copies blocks src -> dst ([C, 2] int32) in every layer's keys and values.");

  m.def(
      "paged_attention",
      [](const py::capsule& out, const py::capsule& query, const py::capsule& key_cache, const py::capsule& value_cache,
         const py::capsule& block_tables, const py::capsule& query_start_loc, const py::capsule& seq_lens, float scale,
         int max_query_len, int max_seq_len, int num_decodes, const py::capsule& workspace, std::uintptr_t stream) {
        cuda::paged_attention(borrow(out), borrow(query), borrow(key_cache), borrow(value_cache),
                              borrow(block_tables), borrow(query_start_loc), borrow(seq_lens), scale, max_query_len,
                              max_seq_len, num_decodes, borrow(workspace), as_stream(stream));
      },
      py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
      py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"), py::arg("max_query_len"),
      py::arg("max_seq_len"), py::arg("num_decodes"), py::arg("workspace"), py::arg("stream"),
      "Paged attention over a mixed batch: decode rows [0, num_decodes) first, then prefill rows.");

  m.def("paged_attention_workspace_bytes", &cuda::paged_attention_workspace_bytes, py::arg("num_seqs"),
        py::arg("num_heads"), py::arg("head_dim"), py::arg("max_seq_len"),
        "Bytes of split-K scratch paged_attention needs for num_seqs decode rows.");
}

}  // namespace pagedserve::bindings
