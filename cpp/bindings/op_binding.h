// How an op crosses into Python, the same way for the CPU ops (bind_ops.cc)
// and the CUDA ops (cuda/bindings/bind_cuda_ops.cc), so that
// pagedserve._core.ops and pagedserve._core.cuda_ops share one call shape:
//
//     op(<the C++ op's tensors and scalars, in order>, stream)
//
// Tensors cross as DLPack capsules (torch.utils.dlpack.to_dlpack), never as
// torch objects: the extension does not link libtorch. A capsule is borrowed
// for the call, never consumed or renamed; the caller's Python references
// keep its tensor alive while the CPU op runs without the GIL. `stream` is the integer
// handle of the CUDA stream to launch on (the caller's:
// torch.cuda.current_stream().cuda_stream); the CPU ops run on the calling
// thread and take 0.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>  // std::optional arguments

#include <array>
#include <cstddef>
#include <optional>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>

#include "ops/tensor_view.h"

namespace pagedserve::bindings {

// The DLPack reader: tensor argument `arg` of `op` from its capsule. A capsule
// that is not an unused "dltensor", or a tensor a TensorView cannot describe,
// is a ValueError naming the op and the argument.
ops::TensorView read_tensor(const pybind11::capsule& capsule, std::string_view op, std::string_view arg);

// How a parameter of a C++ op arrives from Python (`type`) and becomes its
// argument (`read`): tensors as capsules, optional tensors as a capsule or
// None, anything else as itself. A binding file adds its own, before its
// first def_op (the CUDA one: cudaStream_t from an integer handle).
template <typename T>
struct FromPython {
  using type = T;
  static T read(T value, std::string_view /*op*/, std::string_view /*arg*/) { return value; }
};

template <>
struct FromPython<const ops::TensorView&> {
  using type = const pybind11::capsule&;
  static ops::TensorView read(const pybind11::capsule& capsule, std::string_view op, std::string_view arg) {
    return read_tensor(capsule, op, arg);
  }
};

template <>
struct FromPython<const std::optional<ops::TensorView>&> {
  using type = const std::optional<pybind11::capsule>&;
  static std::optional<ops::TensorView> read(const std::optional<pybind11::capsule>& capsule, std::string_view op,
                                             std::string_view arg) {
    if (!capsule) return std::nullopt;
    return read_tensor(*capsule, op, arg);
  }
};

// Whether other Python threads run during the call: yes for the CPU ops (they
// compute), no for the CUDA ops (they only enqueue kernels; taking back a
// contended GIL could cost more than the launch).
enum class Gil { kRelease, kHold };

namespace detail {

template <Gil kGil, typename... Params, size_t... I>
auto python_caller(void (*fn)(Params...), const char* op, std::array<const char*, sizeof...(Params)> names,
                   std::index_sequence<I...>) {
  return [fn, op, names](typename FromPython<Params>::type... args) {
    std::tuple<std::decay_t<Params>...> values{FromPython<Params>::read(args, op, names[I])...};
    if constexpr (kGil == Gil::kRelease) {
      pybind11::gil_scoped_release release;
      std::apply(fn, values);
    } else {
      std::apply(fn, values);
    }
  };
}

}  // namespace detail

// Binds the C++ op `fn` as m.<op>: one py::arg per parameter, in order, whose
// names also name the tensors in errors. Every argument is read (with the
// GIL) before the op runs.
template <Gil kGil, typename... Params, typename... PyArgs>
void def_op(pybind11::module_& m, const char* op, void (*fn)(Params...), const char* doc, const PyArgs&... args) {
  static_assert(sizeof...(PyArgs) == sizeof...(Params), "def_op: one py::arg per parameter of the op");
  m.def(op, detail::python_caller<kGil>(fn, op, {args.name...}, std::index_sequence_for<Params...>{}), args..., doc);
}

}  // namespace pagedserve::bindings
