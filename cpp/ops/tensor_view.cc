#include "ops/tensor_view.h"

#include <stdexcept>

#include "ops/dlpack.h"

namespace pagedserve::ops {
namespace {

[[noreturn]] void fail(std::string_view op, const std::string& message) {
  throw std::invalid_argument(std::string(op) + ": " + message);
}

// No iostreams anywhere in the extension: a host whose compiler links its own
// libstdc++ statically crashed formatting through a second copy's locale.
std::string join_dims(const std::array<int64_t, TensorView::kMaxDims>& dims, int ndim) {
  std::string out = "[";
  for (int d = 0; d < ndim; ++d) {
    if (d) out += ", ";
    out += std::to_string(dims[static_cast<size_t>(d)]);
  }
  return out + "]";
}

std::string device_name(const TensorView& t) {
  return t.device == Device::kCPU ? "cpu" : "cuda:" + std::to_string(t.device_index);
}

std::string describe_with_strides(const TensorView& t) {
  return std::string(dtype_name(t.dtype)) + join_dims(t.shape, t.ndim) + " strides " + join_dims(t.strides, t.ndim) +
         " " + device_name(t);
}

std::string dlpack_dtype_name(const DLDataType& type) {
  switch (type.code) {
    case kDLInt: return "int" + std::to_string(type.bits);
    case kDLUInt: return "uint" + std::to_string(type.bits);
    case kDLFloat: return "float" + std::to_string(type.bits);
    case kDLBfloat: return "bfloat" + std::to_string(type.bits);
    default: return "code " + std::to_string(type.code) + " (" + std::to_string(type.bits) + " bits)";
  }
}

DType dtype_from_dlpack(const DLDataType& type) {
  if (type.lanes != 1) {
    fail("view_from_dlpack", "vector dtypes (lanes = " + std::to_string(type.lanes) + ") are not supported");
  }
  if (type.code == kDLFloat && type.bits == 32) return DType::kFloat32;
  if (type.code == kDLFloat && type.bits == 16) return DType::kFloat16;
  if (type.code == kDLBfloat && type.bits == 16) return DType::kBFloat16;
  if (type.code == kDLInt && type.bits == 32) return DType::kInt32;
  if (type.code == kDLInt && type.bits == 64) return DType::kInt64;
  if (type.code == kDLUInt && type.bits == 8) return DType::kUInt8;
  if (type.code == kDLFloat && type.bits == 64) return DType::kFloat64;
  fail("view_from_dlpack", "unsupported dtype " + dlpack_dtype_name(type) +
                               "; expected float32, float16, bfloat16, int32, int64, uint8 or float64");
}

Device device_from_dlpack(const DLDevice& device) {
  switch (device.device_type) {
    case kDLCPU:
    case kDLCUDAHost:  // pinned host memory: readable by the CPU like any other
      return Device::kCPU;
    case kDLCUDA:
      return Device::kCUDA;
    default:
      fail("view_from_dlpack",
           "unsupported device type " + std::to_string(device.device_type) + "; expected cpu or cuda");
  }
}

}  // namespace

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kFloat64: return "float64";
  }
  return "unknown";
}

int element_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kInt64: return 8;
    case DType::kUInt8: return 1;
    case DType::kFloat64: return 8;
  }
  return 0;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[static_cast<size_t>(d)];
  return n;
}

// Like torch: size-1 dims may have any stride, and an empty tensor is contiguous.
bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    const int64_t extent = size(d);
    if (extent != 1 && stride(d) != expected) return false;
    expected *= extent;
  }
  return true;
}

std::string TensorView::describe() const {
  return std::string(dtype_name(dtype)) + join_dims(shape, ndim) + " " + device_name(*this);
}

TensorView view_from_dlpack(const void* managed_tensor) {
  if (managed_tensor == nullptr) fail("view_from_dlpack", "null DLManagedTensor");
  const DLTensor& dl = static_cast<const DLManagedTensor*>(managed_tensor)->dl_tensor;
  if (dl.ndim < 0 || dl.ndim > TensorView::kMaxDims) {
    fail("view_from_dlpack", "tensors of " + std::to_string(dl.ndim) + " dims are not supported (at most " +
                                 std::to_string(TensorView::kMaxDims) + ")");
  }
  if (dl.ndim > 0 && dl.shape == nullptr) fail("view_from_dlpack", "DLTensor has no shape");
  TensorView view;
  view.dtype = dtype_from_dlpack(dl.dtype);
  view.device = device_from_dlpack(dl.device);
  view.device_index = dl.device.device_id;
  view.ndim = dl.ndim;
  view.data = dl.data == nullptr ? nullptr : static_cast<char*>(dl.data) + dl.byte_offset;
  int64_t compact_stride = 1;
  for (int d = view.ndim - 1; d >= 0; --d) {
    const auto i = static_cast<size_t>(d);
    if (dl.shape[d] < 0) {
      fail("view_from_dlpack", "negative size " + std::to_string(dl.shape[d]) + " in dim " + std::to_string(d));
    }
    view.shape[i] = dl.shape[d];
    view.strides[i] = dl.strides != nullptr ? dl.strides[d] : compact_stride;
    compact_stride *= dl.shape[d];
  }
  return view;
}

void fail_argument(std::string_view op, const std::string& message) { fail(op, message); }

void require_device(std::string_view op, std::string_view arg, const TensorView& t, Device device) {
  if (t.device != device) {
    const std::string wanted = device == Device::kCPU ? "cpu" : "cuda";
    fail(op, std::string(arg) + " must be on the " + wanted + ", got " + t.describe());
  }
}

void require_dtype(std::string_view op, std::string_view arg, const TensorView& t, DType dtype) {
  if (t.dtype != dtype) {
    fail(op, std::string(arg) + " must be " + std::string(dtype_name(dtype)) + ", got " + t.describe());
  }
}

void require_float(std::string_view op, std::string_view arg, const TensorView& t) {
  if (t.dtype != DType::kFloat32 && t.dtype != DType::kFloat16 && t.dtype != DType::kBFloat16) {
    fail(op, std::string(arg) + " must be float32, float16 or bfloat16, got " + t.describe());
  }
}

void require_ndim(std::string_view op, std::string_view arg, const TensorView& t, int ndim) {
  if (t.ndim != ndim) fail(op, std::string(arg) + " must have " + std::to_string(ndim) + " dims, got " + t.describe());
}

void require_contiguous(std::string_view op, std::string_view arg, const TensorView& t) {
  if (!t.is_contiguous()) fail(op, std::string(arg) + " must be contiguous, got " + describe_with_strides(t));
}

void require_same_dtype(std::string_view op, std::string_view arg, const TensorView& t, const TensorView& like) {
  if (t.dtype != like.dtype) {
    fail(op, std::string(arg) + " must have the same dtype as the other inputs (" +
                 std::string(dtype_name(like.dtype)) + "), got " + t.describe());
  }
}

void require_size(std::string_view op, std::string_view arg, const TensorView& t, int dim, int64_t size) {
  if (dim >= t.ndim || dim < -t.ndim) {
    fail(op, std::string(arg) + " has no dim " + std::to_string(dim) + ", got " + t.describe());
  }
  if (t.size(dim) != size) {
    fail(op, std::string(arg) + " must have size " + std::to_string(size) + " in dim " + std::to_string(dim) +
                 ", got " + t.describe());
  }
}

}  // namespace pagedserve::ops
