#include "ops/int8_activations.h"

#include <algorithm>
#include <cmath>

#include "ops/cpu_isa.h"
#include "ops/float_types.h"

namespace pagedserve::ops {
namespace {

// nearbyint (round half to even; roundps from SSE4.1 on): a `(v + 1.5 * 2^23) - 1.5 * 2^23` trick would be
// contracted into an FMA at the AVX2 levels and round x * inv unrounded.
template <typename T>
PS_ALWAYS_INLINE void quantize_block(const T* x, int64_t size, int8_t* dst, float& scale, int32_t& offset) {
  float amax = 0.0f;
  for (int64_t k = 0; k < size; ++k) amax = std::max(amax, std::fabs(to_float(x[k])));
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  int32_t sum = 0;
  for (int64_t k = 0; k < size; ++k) {
    const auto q = static_cast<int32_t>(std::clamp(std::nearbyint(to_float(x[k]) * inv), -127.0f, 127.0f));
    dst[k] = static_cast<int8_t>(q);
    sum += q;
  }
  scale = amax / 127.0f;
  offset = kInt8WeightOffset * sum;
}

}  // namespace

void quantize_int8_rows(const TensorView& x, int64_t k_groups, Int8Rows& out) {
  const int64_t rows = x.size(0), k_size = x.size(1), k_pad = 4 * k_groups, blocks = k_groups / kInt8BlockGroups;
  const int64_t padded_rows = (rows + kInt8RowPad - 1) / kInt8RowPad * kInt8RowPad;
  out.values.assign(static_cast<size_t>(padded_rows * k_pad), int8_t{0});
  out.scale.assign(static_cast<size_t>(rows * blocks), 0.0f);
  out.offset.assign(static_cast<size_t>(rows * blocks), 0);
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t begin = b * kInt8KChunk, size = std::min(kInt8KChunk, k_size - begin);
      int8_t* dst = out.values.data() + row * k_pad + begin;
      float& scale = out.scale[static_cast<size_t>(row * blocks + b)];
      int32_t& offset = out.offset[static_cast<size_t>(row * blocks + b)];
      with_cpu_isa([&]() PS_INLINE_BODY {
        if (x.dtype == DType::kBFloat16) {
          quantize_block(x.ptr<BFloat16>() + row * k_size + begin, size, dst, scale, offset);
        } else {
          quantize_block(x.ptr<float>() + row * k_size + begin, size, dst, scale, offset);
        }
      });
    }
  }
}

}  // namespace pagedserve::ops
