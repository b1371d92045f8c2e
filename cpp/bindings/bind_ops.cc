// pagedserve._core.ops: the CPU reference ops over DLPack capsules.
//
// Each tensor argument is a "dltensor" capsule from torch.utils.dlpack.to_dlpack.
// We only borrow it for the call (never rename or consume it); the caller's
// Python references keep the tensor alive while the GIL is released.
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <pybind11/stl.h>

#include "bindings.h"
#include "ops/cpu_isa.h"
#include "ops/dlpack.h"
#include "ops/ops.h"
#include "ops/tensor_view.h"

namespace py = pybind11;

namespace pagedserve::bindings {
namespace {

using ops::TensorView;

// Reads argument `arg` of op `op`; any problem becomes a ValueError naming both.
TensorView tensor_arg(const py::capsule& capsule, const char* op, const char* arg) {
  const char* name = capsule.name();
  if (name == nullptr || std::strcmp(name, "dltensor") != 0) {
    throw py::value_error(std::string(op) + ": " + arg +
                          " must be a 'dltensor' capsule from torch.utils.dlpack.to_dlpack, got one named '" +
                          (name ? name : "") + "' (a consumed capsule is renamed 'used_dltensor')");
  }
  try {
    return ops::view_from_dlpack(capsule.get_pointer<DLManagedTensor>());
  } catch (const std::invalid_argument& e) {
    constexpr std::string_view kPrefix = "view_from_dlpack: ";
    std::string_view reason = e.what();
    if (reason.starts_with(kPrefix)) reason.remove_prefix(kPrefix.size());
    throw py::value_error(std::string(op) + ": " + arg + ": " + std::string(reason));
  }
}

// Binds the op name once so each lambda names only its arguments.
struct OpArgs {
  const char* op;
  TensorView operator()(const py::capsule& capsule, const char* arg) const { return tensor_arg(capsule, op, arg); }
};

}  // namespace

void bind_ops(py::module_& m) {
  m.def(
      "rms_norm",
      [](const py::capsule& out, const py::capsule& x, const py::capsule& weight, float eps) {
        const OpArgs arg{"rms_norm"};
        const TensorView o = arg(out, "out"), xv = arg(x, "x"), w = arg(weight, "weight");
        py::gil_scoped_release release;
        ops::rms_norm(o, xv, w, eps);
      },
      py::arg("out"), py::arg("x"), py::arg("weight"), py::arg("eps"),
      "out = x / sqrt(mean(x^2) + eps) * weight, row-wise. x, out: [T, H]; weight: [H].");

  m.def(
      "fused_add_rms_norm",
      [](const py::capsule& x, const py::capsule& residual, const py::capsule& weight, float eps) {
        const OpArgs arg{"fused_add_rms_norm"};
        const TensorView xv = arg(x, "x"), r = arg(residual, "residual"), w = arg(weight, "weight");
        py::gil_scoped_release release;
        ops::fused_add_rms_norm(xv, r, w, eps);
      },
      py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
      "In place: residual += x; x = rms_norm(residual) * weight.");

  m.def(
      "rope_cos_sin_cache",
      [](const py::capsule& cos_sin, double theta, double factor, double low_freq_factor, double high_freq_factor,
         int64_t original_max_position) {
        const OpArgs arg{"rope_cos_sin_cache"};
        const TensorView table = arg(cos_sin, "cos_sin");
        const ops::RopeScaling scaling{factor, low_freq_factor, high_freq_factor, original_max_position};
        py::gil_scoped_release release;
        ops::rope_cos_sin_cache(table, theta, scaling);
      },
      py::arg("cos_sin"), py::arg("theta"), py::arg("factor") = 0.0, py::arg("low_freq_factor") = 1.0,
      py::arg("high_freq_factor") = 4.0, py::arg("original_max_position") = 8192,
      "Fills the float32 [max_position, rotary_dim] table [cos | sin]; factor > 0 applies Llama-3 scaling.");

  m.def(
      "rotary_embedding",
      [](const py::capsule& positions, const py::capsule& query, const py::capsule& key, const py::capsule& cos_sin) {
        const OpArgs arg{"rotary_embedding"};
        const TensorView p = arg(positions, "positions"), q = arg(query, "query"),
                         k = arg(key, "key"), cs = arg(cos_sin, "cos_sin_cache");
        py::gil_scoped_release release;
        ops::rotary_embedding(p, q, k, cs);
      },
      py::arg("positions"), py::arg("query"), py::arg("key"), py::arg("cos_sin_cache"),
      "In place NeoX-style rotary embedding of query [T, Hq, D] and key [T, Hkv, D].");

  m.def(
      "silu_and_mul",
      [](const py::capsule& out, const py::capsule& x) {
        const OpArgs arg{"silu_and_mul"};
        const TensorView o = arg(out, "out"), xv = arg(x, "x");
        py::gil_scoped_release release;
        ops::silu_and_mul(o, xv);
      },
      py::arg("out"), py::arg("x"), "out = silu(x[:, :I]) * x[:, I:].");

  m.def(
      "reshape_and_cache",
      [](const py::capsule& key, const py::capsule& value, const py::capsule& key_cache, const py::capsule& value_cache,
         const py::capsule& slot_mapping) {
        const OpArgs arg{"reshape_and_cache"};
        const TensorView k = arg(key, "key"), v = arg(value, "value"),
                         kc = arg(key_cache, "key_cache"), vc = arg(value_cache, "value_cache"),
                         slots = arg(slot_mapping, "slot_mapping");
        py::gil_scoped_release release;
        ops::reshape_and_cache(k, v, kc, vc, slots);
      },
      py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"),
      "Writes each token's key/value into its cache slot; slot -1 (padding) is skipped.");

  m.def(
      "copy_blocks",
      [](const py::capsule& kv_cache, const py::capsule& block_copies) {
        const OpArgs arg{"copy_blocks"};
        const TensorView cache = arg(kv_cache, "kv_cache"), copies = arg(block_copies, "block_copies");
        py::gil_scoped_release release;
        ops::copy_blocks(cache, copies);
      },
      py::arg("kv_cache"), py::arg("block_copies"),
      "Copies block src to dst for each (src, dst) row, in every layer's keys and values, in order.");

  m.def(
      "paged_attention",
      [](const py::capsule& out, const py::capsule& query, const py::capsule& key_cache, const py::capsule& value_cache,
         const py::capsule& block_tables, const py::capsule& query_start_loc, const py::capsule& seq_lens,
         float scale) {
        const OpArgs arg{"paged_attention"};
        const TensorView o = arg(out, "out"), q = arg(query, "query"),
                         kc = arg(key_cache, "key_cache"), vc = arg(value_cache, "value_cache"),
                         tables = arg(block_tables, "block_tables"),
                         starts = arg(query_start_loc, "query_start_loc"), lens = arg(seq_lens, "seq_lens");
        py::gil_scoped_release release;
        ops::paged_attention(o, q, kc, vc, tables, starts, lens, scale);
      },
      py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_tables"),
      py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"),
      "Causal paged attention over a mixed varlen batch (see cpp/ops/ops.h).");

  m.def(
      "pack_linear_weight",
      [](const py::capsule& packed, const py::capsule& weight) {
        const OpArgs arg{"pack_linear_weight"};
        const TensorView pk = arg(packed, "packed_weight"), w = arg(weight, "weight");
        py::gil_scoped_release release;
        ops::pack_linear_weight(pk, w);
      },
      py::arg("packed"), py::arg("weight"),
      "Packs weight [N, K] into bf16 [ceil(N / 16), ceil(K / 32) * 16, 32] tiles (cpp/ops/packed_weight_layout.h).");

  m.def(
      "packed_linear",
      [](const py::capsule& out, const py::capsule& x, const py::capsule& packed_weight,
         const std::optional<py::capsule>& bias) {
        const OpArgs arg{"packed_linear"};
        const TensorView o = arg(out, "out"), xv = arg(x, "x"), pk = arg(packed_weight, "packed_weight");
        std::optional<TensorView> b;
        if (bias) b = arg(*bias, "bias");
        py::gil_scoped_release release;
        ops::packed_linear(o, xv, pk, b);
      },
      py::arg("out"), py::arg("x"), py::arg("packed_weight"), py::arg("bias") = py::none(),
      "out = x W^T (+ bias) in float32, W in packed bf16 tiles; x [M, K], out [M, N].");

  m.def(
      "sample_tokens",
      [](const py::capsule& out, const py::capsule& logits, const py::capsule& inv_temperature, uint64_t seed) {
        const OpArgs arg{"sample_tokens"};
        const TensorView o = arg(out, "out"), x = arg(logits, "logits"), t = arg(inv_temperature, "inv_temperature");
        py::gil_scoped_release release;
        ops::sample_tokens(o, x, t, seed);
      },
      py::arg("out"), py::arg("logits"), py::arg("inv_temperature"), py::arg("seed"),
      "Gumbel-max sampling of one token per row: argmax(logits * inv_temperature + gumbel noise); "
      "rows with inv_temperature <= 0 are greedy.");

  m.def("set_num_threads", &ops::set_num_threads, py::arg("num_threads"),
        "Threads the CPU ops may use (the caller's thread included).");
  m.def("num_threads", &ops::num_threads);

  m.def(
      "cpu_isa", [] { return std::string(ops::cpu_isa_name(ops::cpu_isa())); },
      "The instruction set the kernels run with: 'baseline' (SSE2), 'avx2', 'avx512' or 'amx'.");
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
        for (ops::CpuIsa isa : {ops::CpuIsa::kBaseline, ops::CpuIsa::kAvx2, ops::CpuIsa::kAvx512, ops::CpuIsa::kAmx}) {
          if (ops::cpu_isa_name(isa) == name) return ops::set_cpu_isa(isa);
        }
        throw py::value_error("set_cpu_isa: unknown instruction set '" + name +
                              "'; expected baseline, avx2, avx512 or amx");
      },
      py::arg("name"), "For tests and benchmarks: run the kernels with a lower instruction set.");
}

}  // namespace pagedserve::bindings
