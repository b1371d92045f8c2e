// The inner kernel of the CPU paged attention: one tile of one sequence's
// queries (all heads of one GQA group) against that sequence's context.
//
// The context is read kKeyTile positions at a time through the block table
// and folded into each query row with an online softmax: a running max m, a
// running sum l and an unnormalized output acc, rescaled by exp(m_old - m_new)
// whenever m grows. Scores are dot products against the key rows as stored
// (a transposed tile costs more to build than it saves at these sizes); the
// values are folded into two rows at a time so each value load serves both.
// Every function is inlined into the ISA-specific body (cpu_isa.h), and
// nothing here allocates: scratch comes from the caller, one per worker.
//
// Options (attention_options.h): with a sliding window each row sees
// positions [first visible, itself]; the tiles start at the item's earliest
// visible position, so nothing before any row's window is read. Soft-capping
// maps each tile's scores through c * tanh(s / c) before the softmax.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "ops/attention_options.h"
#include "ops/cpu_isa.h"
#include "ops/float_types.h"
#include "ops/kv_cache_layout.h"
#include "ops/vec_math.h"

namespace pagedserve::ops {

inline constexpr int kKeyTile = 16;  // context positions per tile
// Partial sums per query-key dot product. For head dims of 64-128, 8 measured
// faster than 16 at every ISA level (the final reduction dominates).
inline constexpr int kDotLanes = 8;

// One unit of parallel work: queries [q_begin, q_end) of a sequence (indices
// within its chunk) against kv head kv_head.
struct AttentionWorkItem {
  int32_t seq;
  int32_t kv_head;
  int32_t q_begin;
  int32_t q_end;
};

// The step's tensors as typed pointers plus the sizes the kernel needs. T is
// the query/output type (the model's), C the cache's: T, or bf16 under
// float32 queries (a bf16 KV cache, widened to float32 as it is read).
template <typename T, typename C = T>
struct AttentionBatch {
  T* out;
  const T* query;
  const C* key_cache;
  const C* value_cache;
  const int32_t* block_tables;
  const int32_t* query_start_loc;
  const int32_t* seq_lens;
  int64_t q_heads;
  int64_t kv_heads;
  int64_t head_dim;
  int64_t block_size;
  int64_t max_blocks_per_seq;
  float scale;
  AttentionOptions options;

  int64_t group() const { return q_heads / kv_heads; }
};

// Per-worker buffers, sized for the largest tile of rows (query x head).
struct AttentionScratch {
  AttentionScratch(int64_t max_rows, int64_t head_dim)
      : queries(static_cast<size_t>(max_rows * head_dim)),
        acc(static_cast<size_t>(max_rows * head_dim)),
        row_max(static_cast<size_t>(max_rows)),
        row_sum(static_cast<size_t>(max_rows)),
        row_rescale(static_cast<size_t>(max_rows)),
        row_first(static_cast<size_t>(max_rows)),
        row_visible(static_cast<size_t>(max_rows)),
        probs(static_cast<size_t>(max_rows * kKeyTile)),
        keys(static_cast<size_t>(kKeyTile * head_dim)),
        values(static_cast<size_t>(kKeyTile * head_dim)) {}

  std::vector<float> queries;        // [rows, D], pre-multiplied by scale
  std::vector<float> acc;            // [rows, D]
  std::vector<float> row_max;        // [rows]
  std::vector<float> row_sum;        // [rows]
  std::vector<float> row_rescale;    // [rows] this tile's factor for acc
  std::vector<int64_t> row_first;    // [rows] the first position the row sees (its window's start)
  std::vector<int64_t> row_visible;  // [rows] one past the last position the row sees (itself)
  std::vector<float> probs;          // [rows, kKeyTile] this tile's scores, then probabilities
  std::vector<float> keys;           // [kKeyTile, D] the key tile in float32 (16-bit caches only)
  std::vector<float> values;         // [kKeyTile, D] the value tile in float32 (16-bit caches only)
  const float* key_rows[kKeyTile] = {};
  const float* value_rows[kKeyTile] = {};
};

namespace attention_detail {

// Sixteen floats as one value: one zmm under AVX-512, where the accumulators
// below stay in registers across a whole tile. Only ever a local, never a
// parameter. Narrower ISAs fold with two Float8Lanes instead (kVectorFloats
// 8): GCC keeps a 64-byte vector it has to split on the stack, and Zen 3's
// prefill attention spent half its time storing and reloading them.
using Float16Lanes = float __attribute__((vector_size(64)));
inline constexpr int kLaneCount = 16;
using Float8Lanes = float __attribute__((vector_size(32)));  // one ymm (two xmm below AVX2)

// Points key_rows/value_rows at positions [first, first + count) of the
// sequence with block table `table`: straight into a float32 cache, or into
// scratch after conversion.
template <typename T, typename C>
PS_ALWAYS_INLINE void load_kv_tile(const AttentionBatch<T, C>& b, const int32_t* table, int64_t kv_head, int64_t first,
                                   int count, AttentionScratch& s) {
  const int64_t d_size = b.head_dim;
  for (int j = 0; j < count; ++j) {
    const int64_t pos = first + j;
    const int64_t offset = kv_cache_offset(table[pos / b.block_size], kv_head, pos % b.block_size, b.kv_heads,
                                           b.block_size, d_size);
    if constexpr (std::is_same_v<C, float>) {
      s.key_rows[j] = b.key_cache + offset;
      s.value_rows[j] = b.value_cache + offset;
    } else {
      float* key = s.keys.data() + j * d_size;
      float* value = s.values.data() + j * d_size;
      for (int64_t d = 0; d < d_size; ++d) key[d] = to_float(b.key_cache[offset + d]);
      for (int64_t d = 0; d < d_size; ++d) value[d] = to_float(b.value_cache[offset + d]);
      s.key_rows[j] = key;
      s.value_rows[j] = value;
    }
  }
}

// acc + a * b lane by lane: one rounding (an FMA) where kFma, else two (x86 below AVX2 has no FMA to
// contract into). Spelled out for dot and dot8, not left to the compiler's contraction: a GCC 13 build
// (the Intel host's) rounded dot's chain and dot8's differently at AVX2, and test_ops_attention_bf16_kv.py's
// chunking test failed there. Always inlined, so the warning that a vector returned below AVX changes the
// ABI (the builtin's, seen before inlining) concerns no call that is made.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
template <bool kFma>
PS_ALWAYS_INLINE void multiply_add(Float8Lanes& acc, const Float8Lanes& a, const Float8Lanes& b) {
#if PS_X86_MULTIVERSION
  if constexpr (kFma) {  // instantiated only inside with_tile_isa's FMA bodies
#if defined(__clang__)
    acc = __builtin_elementwise_fma(a, b, acc);
#else
    acc = __builtin_ia32_vfmaddps256(a, b, acc);
#endif
    return;
  }
#endif
  acc = acc + a * b;
}
#pragma GCC diagnostic pop

// a . b with kDotLanes partial sums (d mod kDotLanes), each a chain of multiply_add in d order, summed
// lane by lane from 0, then the tail. dot8 runs the same steps for eight keys at once, so a score has
// the same bits whichever computed it, which batch invariance needs (a tile's keys split between the
// two by its length).
static_assert(kDotLanes == 8, "dot and dot8 keep the kDotLanes partial sums in one Float8Lanes");
template <bool kFma>
PS_ALWAYS_INLINE float dot(const float* a, const float* b, int64_t n) {
  Float8Lanes acc = {};
  int64_t i = 0;
  for (; i + kDotLanes <= n; i += kDotLanes) {
    Float8Lanes av, bv;
    std::memcpy(&av, a + i, sizeof av);
    std::memcpy(&bv, b + i, sizeof bv);
    multiply_add<kFma>(acc, av, bv);
  }
  float tail = 0.0f;
  for (; i < n; ++i) tail += a[i] * b[i];
  float total = 0.0f;
  for (int l = 0; l < kDotLanes; ++l) total += acc[l];
  return total + tail;
}

// out[k] = dot(q, keys[k], n) for k < 8, bit for bit, with n a multiple of kDotLanes: each score's
// partial sums are dot's chain of multiply_add, summed lane by lane from 0, plus dot's (empty) tail.
// But eight scores run side by side: their chains no longer wait on one another, one query load serves
// eight keys, and the lane sums become a transpose and eight vector adds instead of a serial chain of
// scalar adds per score (with dot alone a 512-token prefill layer took 2.2-3.2x as long on a Zen 3:
// bench/results/zen3_session27/, together with the fold below; 1.65x on the Intel host's AVX-512, bf16
// queries: bench/results/intel_amx/session28.md).
template <bool kFma>
PS_ALWAYS_INLINE void dot8(const float* q, const float* const* keys, int64_t n, float* out) {
  Float8Lanes acc[8] = {};
  for (int64_t i = 0; i < n; i += kDotLanes) {
    Float8Lanes qv;
    std::memcpy(&qv, q + i, sizeof qv);
    for (int k = 0; k < 8; ++k) {
      Float8Lanes kv;
      std::memcpy(&kv, keys[k] + i, sizeof kv);
      multiply_add<kFma>(acc[k], qv, kv);
    }
  }
  // Transpose: lane[l] holds partial sum l of all eight scores.
  Float8Lanes pair_low[4], pair_high[4], quad[8], lane[8];
  for (int p = 0; p < 4; ++p) {
    pair_low[p] = __builtin_shufflevector(acc[2 * p], acc[2 * p + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    pair_high[p] = __builtin_shufflevector(acc[2 * p], acc[2 * p + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int h = 0; h < 2; ++h) {  // keys 4h .. 4h + 3: partial sums l and l + 4 (l < 4)
    quad[4 * h + 0] = __builtin_shufflevector(pair_low[2 * h], pair_low[2 * h + 1], 0, 1, 8, 9, 4, 5, 12, 13);
    quad[4 * h + 1] = __builtin_shufflevector(pair_low[2 * h], pair_low[2 * h + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    quad[4 * h + 2] = __builtin_shufflevector(pair_high[2 * h], pair_high[2 * h + 1], 0, 1, 8, 9, 4, 5, 12, 13);
    quad[4 * h + 3] = __builtin_shufflevector(pair_high[2 * h], pair_high[2 * h + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int l = 0; l < 4; ++l) {
    lane[l] = __builtin_shufflevector(quad[l], quad[4 + l], 0, 1, 2, 3, 8, 9, 10, 11);
    lane[l + 4] = __builtin_shufflevector(quad[l], quad[4 + l], 4, 5, 6, 7, 12, 13, 14, 15);
  }
  Float8Lanes total = {};  // sum_lanes: 0 + lane 0 + lane 1 + ... in this order
  for (int l = 0; l < kDotLanes; ++l) total += lane[l];
  total += Float8Lanes{};  // + dot's tail, 0 when n is a multiple of kDotLanes
  std::memcpy(out, &total, sizeof total);
}

// probs[r][j] = q_r . key_j (dot) for the tile's first `count` positions: eight keys at a time
// through dot8 where the head dim allows, the rest one by one.
template <bool kFma>
PS_ALWAYS_INLINE void score_tile(AttentionScratch& s, int64_t rows, int64_t d_size, int count) {
  const int blocked = d_size % kDotLanes == 0 ? count - count % 8 : 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* q = s.queries.data() + r * d_size;
    float* scores = s.probs.data() + r * kKeyTile;
    for (int j = 0; j < blocked; j += 8) dot8<kFma>(q, s.key_rows + j, d_size, scores + j);
    for (int j = blocked; j < count; ++j) scores[j] = dot<kFma>(q, s.key_rows[j], d_size);
  }
}

// Soft-capping of the tile's scores: s = cap * tanh(s / cap).
PS_ALWAYS_INLINE void softcap_tile(AttentionScratch& s, int64_t rows, float cap) {
  const float inv_cap = 1.0f / cap;
  for (int64_t k = 0; k < rows * kKeyTile; ++k) {
    s.probs[static_cast<size_t>(k)] = cap * tanh_approx(s.probs[static_cast<size_t>(k)] * inv_cap);
  }
}

// Turns one row's scores into probabilities in place (0 outside the row's
// visible tile positions [begin, end)), updates its running max and sum, and
// returns the factor acc must be rescaled by (0 on the row's first tile,
// where the old max is -inf).
PS_ALWAYS_INLINE float softmax_tile_row(float* scores, int begin, int end, float& row_max, float& row_sum) {
  if (end <= begin) {  // every position of this tile is in the row's future or before its window
    std::fill_n(scores, kKeyTile, 0.0f);
    return 1.0f;
  }
  float tile_max = scores[begin];
  for (int j = begin + 1; j < end; ++j) tile_max = std::max(tile_max, scores[j]);
  const float new_max = std::max(row_max, tile_max);
  for (int j = 0; j < kKeyTile; ++j) scores[j] = exp_approx(scores[j] - new_max);
  std::fill(scores, scores + begin, 0.0f);
  std::fill(scores + end, scores + kKeyTile, 0.0f);
  float tile_sum = 0.0f;
  for (int j = begin; j < end; ++j) tile_sum += scores[j];
  const float rescale = exp_approx(row_max - new_max);
  row_sum = row_sum * rescale + tile_sum;
  row_max = new_max;
  return rescale;
}

// acc_k = acc_k * rescale_k + sum_j probs_k[j] * value_j for rows k = 0, 1,
// over columns [d0, d0 + 16): accumulators in registers for the whole tile,
// one Float16Lanes a row (kVectorFloats 16) or two Float8Lanes (8), the same
// steps lane by lane either way.
template <int kVectorFloats>
PS_ALWAYS_INLINE void fold_column_pair(float* acc0, float* acc1, float rescale0, float rescale1, const float* probs0,
                                       const float* probs1, const float* const* value_rows, int count, int64_t d0) {
  if constexpr (kVectorFloats == 16) {
    Float16Lanes sum0, sum1, value;
    std::memcpy(&sum0, acc0 + d0, sizeof sum0);
    std::memcpy(&sum1, acc1 + d0, sizeof sum1);
    sum0 *= rescale0;
    sum1 *= rescale1;
    for (int j = 0; j < count; ++j) {
      std::memcpy(&value, value_rows[j] + d0, sizeof value);
      sum0 += probs0[j] * value;
      sum1 += probs1[j] * value;
    }
    std::memcpy(acc0 + d0, &sum0, sizeof sum0);
    std::memcpy(acc1 + d0, &sum1, sizeof sum1);
  } else {
    static_assert(kVectorFloats == 8);
    Float8Lanes sum0_low, sum0_high, sum1_low, sum1_high, value_low, value_high;
    std::memcpy(&sum0_low, acc0 + d0, sizeof sum0_low);
    std::memcpy(&sum0_high, acc0 + d0 + 8, sizeof sum0_high);
    std::memcpy(&sum1_low, acc1 + d0, sizeof sum1_low);
    std::memcpy(&sum1_high, acc1 + d0 + 8, sizeof sum1_high);
    sum0_low *= rescale0;
    sum0_high *= rescale0;
    sum1_low *= rescale1;
    sum1_high *= rescale1;
    for (int j = 0; j < count; ++j) {
      std::memcpy(&value_low, value_rows[j] + d0, sizeof value_low);
      std::memcpy(&value_high, value_rows[j] + d0 + 8, sizeof value_high);
      sum0_low += probs0[j] * value_low;
      sum0_high += probs0[j] * value_high;
      sum1_low += probs1[j] * value_low;
      sum1_high += probs1[j] * value_high;
    }
    std::memcpy(acc0 + d0, &sum0_low, sizeof sum0_low);
    std::memcpy(acc0 + d0 + 8, &sum0_high, sizeof sum0_high);
    std::memcpy(acc1 + d0, &sum1_low, sizeof sum1_low);
    std::memcpy(acc1 + d0 + 8, &sum1_high, sizeof sum1_high);
  }
}

// The same for one column of two rows (head dims that are not a multiple of 16).
PS_ALWAYS_INLINE void fold_column_pair_scalar(float* acc0, float* acc1, float rescale0, float rescale1,
                                              const float* probs0, const float* probs1,
                                              const float* const* value_rows, int count, int64_t d) {
  float sum0 = acc0[d] * rescale0;
  float sum1 = acc1[d] * rescale1;
  for (int j = 0; j < count; ++j) {
    sum0 += probs0[j] * value_rows[j][d];
    sum1 += probs1[j] * value_rows[j][d];
  }
  acc0[d] = sum0;
  acc1[d] = sum1;
}

// Folds the tile's values into every row. An odd last row is paired with
// itself: both halves compute and store the same result.
template <int kVectorFloats>
PS_ALWAYS_INLINE void fold_values(AttentionScratch& s, int64_t rows, int64_t d_size, int count) {
  for (int64_t r0 = 0; r0 < rows; r0 += 2) {
    const int64_t r1 = std::min(r0 + 1, rows - 1);
    float* acc0 = s.acc.data() + r0 * d_size;
    float* acc1 = s.acc.data() + r1 * d_size;
    const float rescale0 = s.row_rescale[static_cast<size_t>(r0)];
    const float rescale1 = s.row_rescale[static_cast<size_t>(r1)];
    const float* probs0 = s.probs.data() + r0 * kKeyTile;
    const float* probs1 = s.probs.data() + r1 * kKeyTile;
    int64_t d = 0;
    for (; d + kLaneCount <= d_size; d += kLaneCount) {
      fold_column_pair<kVectorFloats>(acc0, acc1, rescale0, rescale1, probs0, probs1, s.value_rows, count, d);
    }
    for (; d < d_size; ++d) {
      fold_column_pair_scalar(acc0, acc1, rescale0, rescale1, probs0, probs1, s.value_rows, count, d);
    }
  }
}

}  // namespace attention_detail

// kVectorFloats: the floats one vector register holds where this is compiled
// (16 under AVX-512, else 8; see Float16Lanes); kFma: whether the scores'
// multiply-adds are fused (AVX2 and up). with_tile_isa picks both.
template <int kVectorFloats, bool kFma, typename T, typename C>
PS_ALWAYS_INLINE void attend_work_item(const AttentionBatch<T, C>& b, const AttentionWorkItem& item,
                                       AttentionScratch& s) {
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
    s.row_first[static_cast<size_t>(r)] = b.options.first_visible(first_position + qi);
    s.row_visible[static_cast<size_t>(r)] = first_position + qi + 1;  // causal: itself and everything before
  }

  // From the first row's window start (the earliest any row sees) to the last row.
  // Tiles end at multiples of kKeyTile whatever that start is, so a row meets
  // the same tile boundaries, hence rounds the same, however the queries were
  // grouped into items (chunked prefill, batch composition): batch invariance.
  const int64_t context_begin = b.options.first_visible(first_position + item.q_begin);
  const int64_t context_end = first_position + item.q_end;
  for (int64_t first = context_begin, next = 0; first < context_end; first = next) {
    next = std::min<int64_t>(context_end, (first / kKeyTile + 1) * kKeyTile);
    const int count = static_cast<int>(next - first);
    attention_detail::load_kv_tile(b, table, item.kv_head, first, count, s);
    attention_detail::score_tile<kFma>(s, rows, d_size, count);
    if (b.options.softcap > 0.0f) attention_detail::softcap_tile(s, rows, b.options.softcap);
    for (int64_t r = 0; r < rows; ++r) {
      const auto i = static_cast<size_t>(r);
      const int64_t begin = std::clamp<int64_t>(s.row_first[i] - first, 0, count);
      const int64_t end = std::clamp<int64_t>(s.row_visible[i] - first, 0, count);
      s.row_rescale[i] = attention_detail::softmax_tile_row(s.probs.data() + r * kKeyTile, static_cast<int>(begin),
                                                            static_cast<int>(end), s.row_max[i], s.row_sum[i]);
    }
    if constexpr (!std::is_same_v<T, float>) {
      // Like FlashAttention and torch's SDPA in 16-bit models: the running sum
      // uses float32 probabilities, the value product probabilities rounded to T.
      for (int64_t k = 0; k < rows * kKeyTile; ++k) s.probs[static_cast<size_t>(k)] = round_to<T>(s.probs[static_cast<size_t>(k)]);
    }
    attention_detail::fold_values<kVectorFloats>(s, rows, d_size, count);
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

// Runs fn.template operator()<kVectorFloats, kFma>() (attend_work_item's parameters) at the level
// kernels run with (with_cpu_isa): 16-float folds under AVX-512, else 8; fused score multiply-adds from
// AVX2 on, where every x86-64-v3 CPU has FMA. Unlike with_cpu_isa, each variant is compiled for its own
// level only: the FMA ones would not compile for the baseline.
template <typename Fn>
void with_tile_isa(Fn&& fn) {
#if PS_X86_MULTIVERSION
  const CpuIsa isa = cpu_isa();
  if (isa >= CpuIsa::kAvx512) {
    auto body = [&]() PS_INLINE_BODY { fn.template operator()<16, true>(); };
    isa_detail::run_avx512(body);
    return;
  }
  if (isa == CpuIsa::kAvx2) {
    auto body = [&]() PS_INLINE_BODY { fn.template operator()<8, true>(); };
    isa_detail::run_avx2(body);
    return;
  }
#endif
  fn.template operator()<8, false>();
}

}  // namespace pagedserve::ops
