// The inner kernel of the CPU paged attention: one tile of one sequence's
// queries (all heads of one GQA group) against that sequence's context.
//
// The context is read kKeyTile positions at a time through the block table,
// converted to float32 (keys transposed, so a query's scores over the tile
// accumulate as kKeyTile independent lanes), and folded into each query row
// with an online softmax: a running max m, a running sum l and an
// unnormalized output acc, rescaled by exp(m_old - m_new) whenever m grows.
// Nothing here allocates; scratch comes from the caller, one per worker.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops/float_types.h"
#include "ops/kv_cache_layout.h"
#include "ops/vec_math.h"

namespace pagedserve::ops {

inline constexpr int kKeyTile = 16;

// One unit of parallel work: queries [q_begin, q_end) of a sequence (indices
// within its chunk) against kv head kv_head.
struct AttentionWorkItem {
  int32_t seq;
  int32_t kv_head;
  int32_t q_begin;
  int32_t q_end;
};

// The step's tensors as typed pointers plus the sizes the kernel needs.
template <typename T>
struct AttentionBatch {
  T* out;
  const T* query;
  const T* key_cache;
  const T* value_cache;
  const int32_t* block_tables;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  int64_t q_heads;
  int64_t kv_heads;
  int64_t head_dim;
  int64_t block_size;
  int64_t max_blocks_per_seq;
  float scale;

  int64_t group() const { return q_heads / kv_heads; }
};

// Per-worker buffers, sized for the largest tile of rows (query x head).
struct AttentionScratch {
  AttentionScratch(int64_t max_rows, int64_t head_dim)
      : queries(static_cast<size_t>(max_rows * head_dim)),
        acc(static_cast<size_t>(max_rows * head_dim)),
        row_max(static_cast<size_t>(max_rows)),
        row_sum(static_cast<size_t>(max_rows)),
        row_visible(static_cast<size_t>(max_rows)),
        keys_t(static_cast<size_t>(head_dim * kKeyTile)),
        values(static_cast<size_t>(kKeyTile * head_dim)) {}

  std::vector<float> queries;       // [rows, D], pre-multiplied by scale
  std::vector<float> acc;           // [rows, D]
  std::vector<float> row_max;       // [rows]
  std::vector<float> row_sum;       // [rows]
  std::vector<int64_t> row_visible; // [rows] context positions the row may see
  std::vector<float> keys_t;        // [D, kKeyTile] the key tile, transposed
  std::vector<float> values;        // [kKeyTile, D] the value tile (unused for float32 caches)
  const float* value_rows[kKeyTile] = {};
};

namespace attention_detail {

// Points value_rows at the tile's values and fills keys_t, for positions
// [first, first + count) of the sequence whose block table is `table`.
template <typename T>
void load_kv_tile(const AttentionBatch<T>& b, const int32_t* table, int64_t kv_head, int64_t first, int count,
                  AttentionScratch& s) {
  const int64_t d_size = b.head_dim;
  for (int j = 0; j < count; ++j) {
    const int64_t pos = first + j;
    const int64_t offset = kv_cache_offset(table[pos / b.block_size], kv_head, pos % b.block_size, b.kv_heads,
                                           b.block_size, d_size);
    const T* key = b.key_cache + offset;
    for (int64_t d = 0; d < d_size; ++d) s.keys_t[static_cast<size_t>(d * kKeyTile + j)] = to_float(key[d]);
    const T* value = b.value_cache + offset;
    if constexpr (std::is_same_v<T, float>) {
      s.value_rows[j] = value;
    } else {
      float* row = s.values.data() + j * d_size;
      for (int64_t d = 0; d < d_size; ++d) row[d] = to_float(value[d]);
      s.value_rows[j] = row;
    }
  }
  // Zero keys past the context keep the unused score lanes finite.
  for (int64_t d = 0; d < d_size; ++d) {
    for (int j = count; j < kKeyTile; ++j) s.keys_t[static_cast<size_t>(d * kKeyTile + j)] = 0.0f;
  }
}

// Folds the first `visible` positions of the loaded tile into one query row.
inline void attend_row(const float* query, int64_t d_size, int visible, AttentionScratch& s, float& row_max,
                       float& row_sum, float* acc) {
  float scores[kKeyTile] = {};
  const float* keys_t = s.keys_t.data();
  for (int64_t d = 0; d < d_size; ++d) {
    const float q = query[d];
    const float* column = keys_t + d * kKeyTile;
    for (int j = 0; j < kKeyTile; ++j) scores[j] += q * column[j];
  }
  float tile_max = scores[0];
  for (int j = 1; j < visible; ++j) tile_max = std::max(tile_max, scores[j]);
  const float new_max = std::max(row_max, tile_max);
  const float rescale = exp_approx(row_max - new_max);  // 0 on the first tile (row_max = -inf)

  float probs[kKeyTile];
  for (int j = 0; j < kKeyTile; ++j) probs[j] = exp_approx(scores[j] - new_max);
  float tile_sum = 0.0f;
  for (int j = 0; j < visible; ++j) tile_sum += probs[j];
  row_sum = row_sum * rescale + tile_sum;
  row_max = new_max;

  if (rescale != 1.0f) {
    for (int64_t d = 0; d < d_size; ++d) acc[d] *= rescale;
  }
  for (int j = 0; j < visible; ++j) {
    const float p = probs[j];
    const float* value = s.value_rows[j];
    for (int64_t d = 0; d < d_size; ++d) acc[d] += p * value[d];
  }
}

}  // namespace attention_detail

template <typename T>
void attend_work_item(const AttentionBatch<T>& b, const AttentionWorkItem& item, AttentionScratch& s) {
  const int64_t d_size = b.head_dim;
  const int64_t group = b.group();
  const int64_t token_begin = b.query_start_loc[item.seq];
  const int64_t q_len = b.query_start_loc[item.seq + 1] - token_begin;
  const int64_t first_position = b.seq_lens[item.seq] - q_len;  // position of the chunk's first query
  const int32_t* table = b.block_tables + item.seq * b.max_blocks_per_seq;
  const int64_t rows = (item.q_end - item.q_begin) * group;

  // Row r is query q_begin + r / group, head kv_head * group + r % group.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t qi = item.q_begin + r / group;
    const int64_t head = item.kv_head * group + r % group;
    const T* q = b.query + ((token_begin + qi) * b.q_heads + head) * d_size;
    float* row = s.queries.data() + r * d_size;
    for (int64_t d = 0; d < d_size; ++d) row[d] = to_float(q[d]) * b.scale;
    std::fill_n(s.acc.data() + r * d_size, d_size, 0.0f);
    s.row_max[static_cast<size_t>(r)] = -std::numeric_limits<float>::infinity();
    s.row_sum[static_cast<size_t>(r)] = 0.0f;
    s.row_visible[static_cast<size_t>(r)] = first_position + qi + 1;  // causal: itself and everything before
  }

  const int64_t context_end = first_position + item.q_end;
  for (int64_t first = 0; first < context_end; first += kKeyTile) {
    const int count = static_cast<int>(std::min<int64_t>(kKeyTile, context_end - first));
    attention_detail::load_kv_tile(b, table, item.kv_head, first, count, s);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::min<int64_t>(count, s.row_visible[static_cast<size_t>(r)] - first);
      if (visible <= 0) continue;
      attention_detail::attend_row(s.queries.data() + r * d_size, d_size, static_cast<int>(visible), s,
                                   s.row_max[static_cast<size_t>(r)], s.row_sum[static_cast<size_t>(r)],
                                   s.acc.data() + r * d_size);
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t qi = item.q_begin + r / group;
    const int64_t head = item.kv_head * group + r % group;
    T* out = b.out + ((token_begin + qi) * b.q_heads + head) * d_size;
    const float inv_sum = 1.0f / s.row_sum[static_cast<size_t>(r)];
    const float* acc = s.acc.data() + r * d_size;
    for (int64_t d = 0; d < d_size; ++d) out[d] = from_float<T>(acc[d] * inv_sum);
  }
}

}  // namespace pagedserve::ops
