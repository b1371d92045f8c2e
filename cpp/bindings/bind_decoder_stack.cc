// pagedserve._core.ops.DecoderStack: every decoder layer of a step in one call
// (cpp/ops/decoder_layer.h). Built once from the model's weights
// (python/pagedserve/models/fused_layers.py), then called once per step.
//
// Weights cross as DLPack capsules like every op's tensors (op_binding.h); the
// stack keeps the capsules it was given, and with them the tensors they borrow,
// for as long as it lives, so its views never outlive the weights.
#include <memory>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <vector>

#include "bindings.h"
#include "bindings/op_binding.h"
#include "ops/decoder_layer.h"

namespace py = pybind11;

namespace pagedserve::bindings {
namespace {

constexpr std::string_view kOp = "DecoderStack";
using OptionalCapsule = std::optional<py::capsule>;

class PyDecoderStack {
 public:
  PyDecoderStack(const py::capsule& embedding, const py::capsule& final_norm, float final_eps,
                 const ops::DecoderShape& shape, int64_t vocab_size, int64_t embedding_ggml_type)
      : shape_(shape),
        stack_(std::make_unique<ops::DecoderStack>(shape, keep(embedding, "embedding"),
                                                   ops::NormWeights{keep(final_norm, "final_norm"), final_eps},
                                                   vocab_size, embedding_ggml_type)) {}

  void add_layer(const py::capsule& input_norm, float input_eps, const py::capsule& qkv, const OptionalCapsule& qkv_bias,
                 const OptionalCapsule& q_norm, const OptionalCapsule& k_norm, float qk_eps,
                 const OptionalCapsule& cos_sin, float scale, int window, float softcap, const py::capsule& o,
                 const OptionalCapsule& o_bias, const py::capsule& post_attention_norm, float post_attention_eps,
                 const py::capsule& gate_up, const OptionalCapsule& gate_up_bias, const py::capsule& down,
                 const OptionalCapsule& down_bias, ops::LinearFormat format, const std::vector<int64_t>& ggml_types,
                 bool output_float64_sums, const std::vector<py::capsule>& int8_scales) {
    const int64_t hidden = shape_.hidden_size;
    const int64_t q_size = shape_.num_heads * shape_.head_dim;
    const int64_t qkv_out = q_size + 2 * shape_.num_kv_heads * shape_.head_dim;
    const int64_t intermediate = shape_.intermediate_size;
    ops::DecoderLayerWeights layer;
    layer.input_norm = {keep(input_norm, "input_norm"), input_eps};
    layer.qkv = linear(qkv, qkv_bias, "qkv", hidden, qkv_out);
    if (q_norm) layer.q_norm = ops::NormWeights{keep(*q_norm, "q_norm"), qk_eps};
    if (k_norm) layer.k_norm = ops::NormWeights{keep(*k_norm, "k_norm"), qk_eps};
    if (cos_sin) layer.cos_sin = keep(*cos_sin, "cos_sin");
    layer.attention_scale = scale;
    layer.attention = {window, softcap};
    layer.o = linear(o, o_bias, "o", q_size, hidden);
    layer.post_attention_norm = {keep(post_attention_norm, "post_attention_norm"), post_attention_eps};
    layer.gate_up = linear(gate_up, gate_up_bias, "gate_up", hidden, 2 * intermediate);
    layer.down = linear(down, down_bias, "down", intermediate, hidden);
    if (format == ops::LinearFormat::kGguf && ggml_types.size() != 4) {
      throw std::invalid_argument("DecoderStack.add_layer: GGUF linears need ggml_types for qkv, o, gate_up, down");
    }
    if (format == ops::LinearFormat::kInt8 && int8_scales.size() != 4) {
      throw std::invalid_argument("DecoderStack.add_layer: int8 linears need int8_scales for qkv, o, gate_up, down");
    }
    if (output_float64_sums && format != ops::LinearFormat::kPackedBf16) {
      throw std::invalid_argument("DecoderStack.add_layer: output_float64_sums needs the packed_bf16 format");
    }
    size_t which = 0;
    for (ops::LinearWeights* w : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) {
      w->format = format;
      if (format == ops::LinearFormat::kGguf) w->ggml_type = ggml_types[which];
      if (format == ops::LinearFormat::kInt8) w->scales = keep(int8_scales[which], "int8_scales");
      ++which;
    }
    if (output_float64_sums) layer.o.format = layer.down.format = ops::LinearFormat::kPackedBf16Float64Sums;
    stack_->add_layer(layer);
  }

  void forward(const py::capsule& out, const py::capsule& input_ids, const py::capsule& rope_positions,
               const py::capsule& slot_mapping, const py::capsule& block_tables, const py::capsule& query_start_loc,
               const py::capsule& seq_lens, const py::capsule& kv_cache) {
    const ops::DecoderStep step{read_tensor(input_ids, kOp, "input_ids"),
                                read_tensor(rope_positions, kOp, "rope_positions"),
                                read_tensor(slot_mapping, kOp, "slot_mapping"),
                                read_tensor(block_tables, kOp, "block_tables"),
                                read_tensor(query_start_loc, kOp, "query_start_loc"),
                                read_tensor(seq_lens, kOp, "seq_lens")};
    const ops::TensorView out_view = read_tensor(out, kOp, "out");
    const ops::TensorView cache = read_tensor(kv_cache, kOp, "kv_cache");
    py::gil_scoped_release release;
    stack_->forward(out_view, step, cache);
  }

  int64_t num_layers() const { return stack_->num_layers(); }

 private:
  ops::TensorView keep(const py::capsule& capsule, std::string_view arg) {
    ops::TensorView view = read_tensor(capsule, kOp, arg);
    kept_.push_back(capsule);
    return view;
  }

  ops::LinearWeights linear(const py::capsule& packed, const OptionalCapsule& bias, std::string_view name,
                            int64_t in_features, int64_t out_features) {
    ops::LinearWeights w;
    w.packed = keep(packed, name);
    w.in_features = in_features;
    w.out_features = out_features;
    if (bias) w.bias = keep(*bias, "bias");
    return w;
  }

  std::vector<py::capsule> kept_;  // declared first: outlives the stack's views of it
  ops::DecoderShape shape_;
  std::unique_ptr<ops::DecoderStack> stack_;
};

}  // namespace

void bind_decoder_stack(py::module_& m) {
  py::enum_<ops::LinearFormat>(m, "LinearFormat", "How a DecoderStack layer's linear weights are multiplied.")
      .value("packed_bf16", ops::LinearFormat::kPackedBf16, "packed_linear: bf16 tiles, float32 activations")
      .value("packed_bf16_activations", ops::LinearFormat::kPackedBf16Activations,
             "packed_linear_bf16: bf16 tiles, bf16-rounded activations")
      .value("gguf", ops::LinearFormat::kGguf, "gguf_linear: GGUF blocks of one ggml type per linear")
      .value("packed_bf16_float64_sums", ops::LinearFormat::kPackedBf16Float64Sums,
             "packed_linear_float64_sums: bf16 tiles, float32 activations, float64 sums")
      .value("int8", ops::LinearFormat::kInt8, "int8_linear: int8 channels (quantize_int8_weight) and their scales");

  py::class_<ops::DecoderShape>(m, "DecoderShape",
                                "The sizes of a DecoderStack's layers: hidden, heads, kv heads, head dim, MLP.")
      .def(py::init([](int64_t hidden_size, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                       int64_t intermediate_size, bool qk_norm_per_head) {
             return ops::DecoderShape{hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size,
                                      qk_norm_per_head};
           }),
           py::arg("hidden_size"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("intermediate_size"), py::arg("qk_norm_per_head") = true);

  py::class_<PyDecoderStack>(m, "DecoderStack",
                             "Every pre-norm gated-MLP decoder layer of a step in one call, bit-identical to the "
                             "per-op path (cpp/ops/decoder_layer.h).")
      .def(py::init<const py::capsule&, const py::capsule&, float, const ops::DecoderShape&, int64_t, int64_t>(),
           py::arg("embedding"), py::arg("final_norm"), py::arg("final_eps"), py::arg("shape"),
           py::arg("vocab_size") = -1, py::arg("embedding_ggml_type") = -1,
           "embedding: the token table [V, H], a tied LM head's bf16 tiles (pack_linear_weight) with "
           "vocab_size V under float32 activations, or GGUF blocks [V, row bytes] of embedding_ggml_type.")
      .def("add_layer", &PyDecoderStack::add_layer, py::arg("input_norm"), py::arg("input_eps"), py::arg("qkv"),
           py::arg("qkv_bias"), py::arg("q_norm"), py::arg("k_norm"), py::arg("qk_eps"), py::arg("cos_sin"),
           py::arg("scale"), py::arg("window"), py::arg("softcap"), py::arg("o"), py::arg("o_bias"),
           py::arg("post_attention_norm"), py::arg("post_attention_eps"), py::arg("gate_up"),
           py::arg("gate_up_bias"), py::arg("down"), py::arg("down_bias"),
           py::arg("linear_format") = ops::LinearFormat::kPackedBf16, py::arg("ggml_types") = std::vector<int64_t>{},
           py::arg("output_float64_sums") = false, py::arg("int8_scales") = std::vector<py::capsule>{},
           "Appends the next layer: norm weights, linear weights in linear_format (packed_bf16: from "
           "pack_linear_weight; gguf: blocks, with ggml_types for qkv, o, gate_up, down; int8: packed channels, "
           "with int8_scales for qkv, o, gate_up, down) and biases, the rope table (None: no rope) and the "
           "attention's scale, window and softcap. "
           "output_float64_sums: o and down sum in float64 (packed_linear_float64_sums; packed_bf16 only).")
      .def("forward", &PyDecoderStack::forward, py::arg("out"), py::arg("input_ids"), py::arg("rope_positions"),
           py::arg("slot_mapping"), py::arg("block_tables"), py::arg("query_start_loc"), py::arg("seq_lens"),
           py::arg("kv_cache"),
           "out [T, H] = the final normalised hidden states of the step's tokens; writes their keys and values "
           "into kv_cache [L, 2, N, Hkv, B, D].")
      .def_property_readonly("num_layers", &PyDecoderStack::num_layers);
}

}  // namespace pagedserve::bindings
