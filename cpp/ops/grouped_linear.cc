// grouped_linear on the CPU (layout: grouped_linear.h).
//
// Work items are (expert, 16 output columns, up to 64 of the expert's rows),
// run in parallel. An item transposes its 16 weight rows into a float32 tile
// [K][16] once, converts its rows of x to float32 once (16-bit dtypes), then
// runs blocks of 4 rows against the tile: per k, one 16-wide weight vector
// and 4 broadcasts of x feed 4 accumulators that stay in registers (one zmm
// each on AVX-512, two ymm on AVX2), as with_cpu_isa compiles it. Float32
// throughout, summed in k order; one rounding of each output to the dtype.
#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops/cpu_isa.h"
#include "ops/dispatch.h"
#include "ops/float_types.h"
#include "ops/grouped_linear.h"
#include "ops/op_contracts.h"
#include "ops/ops.h"
#include "ops/parallel.h"

namespace pagedserve::ops {
namespace {

constexpr int kBlockRows = 4;

// Sixteen floats as one value (see attention_tile.h's Float16Lanes): GCC keeps
// it in whatever registers the ISA has.
using Lanes = float __attribute__((vector_size(64)));
static_assert(sizeof(Lanes) == kGroupedCols * sizeof(float));

struct Item {
  int32_t expert;
  int32_t col_begin;
  int32_t row_begin;  // rows [row_begin, row_end) of x
  int32_t row_end;
};

// out rows [0, kRows) of the block = x rows x tile, 16 columns each.
template <int kRows>
PS_ALWAYS_INLINE void block_times_tile(const float* x, int64_t k_size, const float* tile, float (*out)[kGroupedCols]) {
  Lanes acc[kRows] = {};
  for (int64_t k = 0; k < k_size; ++k) {
    Lanes w;
    std::memcpy(&w, tile + k * kGroupedCols, sizeof w);
    for (int r = 0; r < kRows; ++r) acc[r] += x[r * k_size + k] * w;
  }
  for (int r = 0; r < kRows; ++r) std::memcpy(out[r], &acc[r], sizeof acc[r]);
}

// Rows of a 16-bit tensor as float32 in scratch; float32 rows in place.
template <typename T>
const float* as_float_rows(const T* rows, int64_t count, int64_t width, std::vector<float>& scratch) {
  if constexpr (std::is_same_v<T, float>) {
    return rows;
  } else {
    for (int64_t i = 0; i < count * width; ++i) scratch[static_cast<size_t>(i)] = to_float(rows[i]);
    return scratch.data();
  }
}

struct Scratch {
  explicit Scratch(int64_t k)
      : tile(static_cast<size_t>(kGroupedCols * k)), rows(static_cast<size_t>(kGroupedRows * k)) {}
  std::vector<float> tile;  // [K][16]: the item's weight rows, transposed, zero past N
  std::vector<float> rows;  // [64][K]: the item's rows of x in float32 (16-bit dtypes)
};

// tile[k][c] = weight row c at k, for the item's `cols` rows (the rest zero).
template <typename T>
void transpose_into_tile(const T* weight_rows, int64_t cols, int64_t k_size, float* tile) {
  std::fill_n(tile, kGroupedCols * k_size, 0.0f);
  for (int64_t c = 0; c < cols; ++c) {
    for (int64_t k = 0; k < k_size; ++k) tile[k * kGroupedCols + c] = to_float(weight_rows[c * k_size + k]);
  }
}

}  // namespace

void grouped_linear(const TensorView& out, const TensorView& x, const TensorView& weight,
                    const TensorView& expert_offsets) {
  check_grouped_linear(Device::kCPU, out, x, weight, expert_offsets);
  const int64_t k_size = x.size(1);
  const int64_t n_size = weight.size(1);
  const int64_t experts = weight.size(0);
  const int32_t* offsets = expert_offsets.ptr<int32_t>();
  std::vector<Item> items;
  for (int64_t e = 0; e < experts; ++e) {
    for (int64_t r = offsets[e]; r < offsets[e + 1]; r += kGroupedRows) {
      for (int64_t n = 0; n < n_size; n += kGroupedCols) {
        items.push_back({static_cast<int32_t>(e), static_cast<int32_t>(n), static_cast<int32_t>(r),
                         static_cast<int32_t>(std::min<int64_t>(offsets[e + 1], r + kGroupedRows))});
      }
    }
  }
  if (items.empty()) return;
  const int64_t total_rows = int64_t{offsets[experts]} - offsets[0];

  dispatch_float(x.dtype, "grouped_linear", [&]<typename T>() {
    const ParallelRun run = parallel_run(2 * total_rows * n_size * k_size);
    std::vector<Scratch> scratch;
    scratch.reserve(static_cast<size_t>(run.num_workers()));
    for (int w = 0; w < run.num_workers(); ++w) scratch.emplace_back(k_size);
    run.for_each(static_cast<int64_t>(items.size()), [&](int64_t task, int worker) {
      const Item& item = items[static_cast<size_t>(task)];
      Scratch& s = scratch[static_cast<size_t>(worker)];
      const int64_t cols = std::min<int64_t>(kGroupedCols, n_size - item.col_begin);
      const int64_t rows = item.row_end - item.row_begin;
      transpose_into_tile(weight.ptr<T>() + (item.expert * n_size + item.col_begin) * k_size, cols, k_size,
                          s.tile.data());
      const float* xs = as_float_rows(x.ptr<T>() + int64_t{item.row_begin} * k_size, rows, k_size, s.rows);
      T* y = out.ptr<T>() + int64_t{item.row_begin} * n_size + item.col_begin;
      float block[kBlockRows][kGroupedCols];
      with_cpu_isa([&]() PS_INLINE_BODY {
        for (int64_t r0 = 0; r0 < rows; r0 += kBlockRows) {
          const float* xr = xs + r0 * k_size;
          switch (std::min<int64_t>(kBlockRows, rows - r0)) {
            case 4: block_times_tile<4>(xr, k_size, s.tile.data(), block); break;
            case 3: block_times_tile<3>(xr, k_size, s.tile.data(), block); break;
            case 2: block_times_tile<2>(xr, k_size, s.tile.data(), block); break;
            default: block_times_tile<1>(xr, k_size, s.tile.data(), block); break;
          }
          for (int64_t r = r0; r < std::min<int64_t>(rows, r0 + kBlockRows); ++r) {
            for (int64_t c = 0; c < cols; ++c) y[r * n_size + c] = from_float<T>(block[r - r0][c]);
          }
        }
      });
    });
  });
}

}  // namespace pagedserve::ops
