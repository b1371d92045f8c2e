// TensorView: a borrowed, checked view of a tensor owned by the caller (torch).
//
// Ops take TensorViews, never raw pointers: a view knows its dtype, device,
// shape and strides, and the `require_*` helpers turn a wrong argument into a
// std::invalid_argument naming the op and the argument (a ValueError in Python).
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace pagedserve::ops {

// kUInt8: raw bytes (GGUF blocks); kFloat64: sums handed between tensor-parallel ranks (packed_linear_float64_sums).
enum class DType : uint8_t { kFloat32, kFloat16, kBFloat16, kInt32, kInt64, kUInt8, kFloat64 };
enum class Device : uint8_t { kCPU, kCUDA };

std::string_view dtype_name(DType dtype);
int element_size(DType dtype);

struct TensorView {
  static constexpr int kMaxDims = 6;

  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device = Device::kCPU;
  int device_index = 0;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};  // in elements

  int64_t size(int dim) const { return shape[static_cast<size_t>(dim < 0 ? dim + ndim : dim)]; }
  int64_t stride(int dim) const { return strides[static_cast<size_t>(dim < 0 ? dim + ndim : dim)]; }
  int64_t numel() const;
  bool is_contiguous() const;
  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
  std::string describe() const;  // "bfloat16[4, 8] cpu"
};

// Parses a DLPack capsule's tensor (the PyCapsule's pointer, a DLManagedTensor*).
TensorView view_from_dlpack(const void* managed_tensor);

// Argument checks; each throws std::invalid_argument("<op>: <arg> ...").
void require_device(std::string_view op, std::string_view arg, const TensorView& t, Device device);
void require_dtype(std::string_view op, std::string_view arg, const TensorView& t, DType dtype);
void require_float(std::string_view op, std::string_view arg, const TensorView& t);  // f32 / f16 / bf16
void require_ndim(std::string_view op, std::string_view arg, const TensorView& t, int ndim);
void require_contiguous(std::string_view op, std::string_view arg, const TensorView& t);
void require_same_dtype(std::string_view op, std::string_view arg, const TensorView& t, const TensorView& like);
void require_size(std::string_view op, std::string_view arg, const TensorView& t, int dim, int64_t size);
// Throws std::invalid_argument("<op>: <message>").
[[noreturn]] void fail_argument(std::string_view op, const std::string& message);

}  // namespace pagedserve::ops

// PS_REQUIRE(ok, op, message): throws std::invalid_argument("<op>: <message>")
// when ok is false. The message expression is evaluated only then, so checks
// inside per-token loops cost one branch, not a string.
#define PS_REQUIRE(ok, op, message)                                                 \
  do {                                                                              \
    if (!(ok)) [[unlikely]]                                                         \
      ::pagedserve::ops::fail_argument((op), (message));                            \
  } while (false)

