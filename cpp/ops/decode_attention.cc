#include "ops/decode_attention.h"

#include <algorithm>
#include <limits>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "ops/cpu_isa.h"
#include "ops/kv_cache_layout.h"
#include "ops/vec_math.h"

namespace pagedserve::ops {

#if PS_X86_MULTIVERSION

bool row_attention_supported(int64_t head_dim) {
  return cpu_isa() >= CpuIsa::kAvx512 && head_dim % 16 == 0 && head_dim > 0 && head_dim <= kMaxRowHeadDim;
}

namespace {

// GCC 12's AVX-512 headers build some vectors from a deliberately undefined
// one (`__m512i __Y = __Y;`), which -Wmaybe-uninitialized flags at every use.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

constexpr int kKeys = 16;  // keys scored together: one zmm of results
constexpr int kMaxRowGroup = 16;  // heads of a group whose scores one pass keeps (more take several passes)

// Returns the 16 horizontal sums of v[0..15] as one vector (lane j = sum of v[j]).
[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE __m512 reduce_16(const __m512 (&v)[kKeys]) {
  __m512 halves[8];  // lanes 0-7: partial sums of v[2i], lanes 8-15: of v[2i + 1]
  for (int i = 0; i < 8; ++i) {
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xee));
  }
  __m512 quarters[4];  // 128-bit lane L: 4 partial sums of v[4i + L]
  for (int i = 0; i < 4; ++i) {
    quarters[i] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(halves[2 * i], halves[2 * i + 1], 0xdd));
  }
  __m512 pairs[2];  // lane L: 2 partials each of v[8i + L], v[8i + L], v[8i + 4 + L], v[8i + 4 + L]
  for (int i = 0; i < 2; ++i) {
    pairs[i] = _mm512_add_ps(_mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(quarters[2 * i], quarters[2 * i + 1], 0xee));
  }
  // Element 4L + e now sums v[4e + L]; the permutation puts v[j]'s sum at j.
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(pairs[0], pairs[1], 0x88),
                                    _mm512_shuffle_ps(pairs[0], pairs[1], 0xdd));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

// cap * tanh(v / cap) lane by lane (tanh_approx, as the tile kernel).
[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE __m512 softcap_16(__m512 v, float cap) {
  alignas(64) float lanes[kKeys];
  _mm512_store_ps(lanes, _mm512_mul_ps(v, _mm512_set1_ps(1.0f / cap)));
  for (float& lane : lanes) lane = cap * tanh_approx(lane);
  return _mm512_load_ps(lanes);
}

template <typename C>
PS_ALWAYS_INLINE void prefetch_row(const C* row, int64_t d_size) {
  const auto* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < d_size * static_cast<int64_t>(sizeof(C)); b += 64) _mm_prefetch(bytes + b, _MM_HINT_T0);
}

// 16 cache elements as float32: a plain load, or bf16 widened by a 16-bit
// shift into the high half of each lane (exact).
[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE __m512 load_16(const float* p) { return _mm512_loadu_ps(p); }
[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE __m512 load_16(const BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// A query token's visible context, [begin, position], which its group's heads share: offsets[i] is where
// position lo + i lies in the cache, computed once per item (RowScratch) rather than per key and row.
struct RowContext {
  const int64_t* offsets;
  int64_t lo;
  int64_t begin;
  int64_t num_visible;
  int64_t offset(int64_t i) const { return offsets[begin - lo + i]; }  // position begin + i
};

// A row's scores become their softmax numerators (exp_approx, as the tile kernel); returns 1 / their sum.
PS_ALWAYS_INLINE float softmax_numerators(float* row, int64_t n, float row_max) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      row[j + l] = exp_approx(row[j + l] - row_max);
      lanes[l] += row[j + l];
    }
  }
  for (; j < n; ++j) {
    row[j] = exp_approx(row[j] - row_max);
    lanes[0] += row[j];
  }
  return 1.0f / sum_lanes(lanes);
}

// The scores of `rows` rows of one query token (heads head0 ..; row r's into scores + r * stride,
// [0, num_visible)), then their softmax numerators; inv_sum[r] = 1 / row r's sum. Each 16-key tile's keys
// are read once for all the rows (a bf16 cache widened once, into scratch.keys); each row's arithmetic is
// what it would be alone. prefetch: the first row streams the context from memory for the rows after it.
template <int kChunks, typename C>
[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE void group_scores(const AttentionBatch<float, C>& b,
                                                                     const RowContext& ctx, int64_t token,
                                                                     int64_t head0, int rows, bool prefetch,
                                                                     float* scores, int64_t stride,
                                                                     RowScratch& scratch, float* inv_sum) {
  constexpr int64_t d_size = 16 * kChunks;
  const int64_t num_visible = ctx.num_visible;
  const float cap = b.options.softcap;
  float* q = scratch.queries(rows * d_size);  // each row's query times the scale
  for (int r = 0; r < rows; ++r) {
    const float* q_in = b.query + (token * b.q_heads + head0 + r) * d_size;
    for (int c = 0; c < kChunks; ++c) {
      const __m512 scaled = _mm512_mul_ps(_mm512_loadu_ps(q_in + 16 * c), _mm512_set1_ps(b.scale));
      _mm512_storeu_ps(q + r * d_size + 16 * c, scaled);
    }
  }
  float* keys = scratch.keys(kKeys * d_size);
  float row_max[kMaxRowGroup];
  for (int r = 0; r < rows; ++r) row_max[r] = -std::numeric_limits<float>::infinity();

  // Scores, 16 keys at a time. A prefetching row streams the context from
  // memory: it asks for the next tile's keys and this tile's values, which
  // the value pass then finds in cache.
  for (int64_t first = 0; first < num_visible; first += kKeys) {
    const int count = static_cast<int>(std::min<int64_t>(kKeys, num_visible - first));
    if (prefetch) {
      const int64_t next_count = std::min<int64_t>(kKeys, num_visible - first - kKeys);
      for (int64_t j = 0; j < next_count; ++j) prefetch_row(b.key_cache + ctx.offset(first + kKeys + j), d_size);
      for (int64_t j = 0; j < count; ++j) prefetch_row(b.value_cache + ctx.offset(first + j), d_size);
    }
    // A tile's keys past the context repeat its last key (finite: lane j of the tree sums key j's products
    // alone, and those lanes are never stored), so every row runs 16 in registers.
    for (int j = 0; j < kKeys; ++j) {
      const C* key = b.key_cache + ctx.offset(first + std::min(j, count - 1));
      for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(keys + j * d_size + 16 * c, load_16(key + 16 * c));
    }
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1u);
    for (int r = 0; r < rows; ++r) {
      const float* qr = q + r * d_size;
      __m512 partial[kKeys];
#pragma GCC unroll 16
      for (int j = 0; j < kKeys; ++j) {
        partial[j] = _mm512_setzero_ps();
        for (int c = 0; c < kChunks; ++c) {
          partial[j] = _mm512_fmadd_ps(_mm512_loadu_ps(keys + j * d_size + 16 * c), _mm512_loadu_ps(qr + 16 * c),
                                       partial[j]);
        }
      }
      __m512 tile = reduce_16(partial);
      if (cap > 0.0f) tile = softcap_16(tile, cap);
      _mm512_mask_storeu_ps(scores + r * stride + first, valid, tile);
      row_max[r] = std::max(row_max[r], _mm512_mask_reduce_max_ps(valid, tile));
    }
  }

  for (int r = 0; r < rows; ++r) inv_sum[r] = softmax_numerators(scores + r * stride, num_visible, row_max[r]);
}

// The value sums of kRows rows of one query token (heads head0 ..; row r's numerators at scores + r * stride),
// each row's as it would run alone (positions in order into one accumulator a chunk, then times 1 / sum):
// together they load and widen each value chunk once, and their kRows x kChunks independent chains keep both
// FMA ports busy where one row's kChunks chains wait on the FMA's latency at every position.
template <int kChunks, int kRows, typename C>
[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE void value_rows(const AttentionBatch<float, C>& b,
                                                                   const RowContext& ctx, int64_t token,
                                                                   int64_t head0, const float* scores,
                                                                   int64_t stride, const float* inv_sum) {
  __m512 acc[kRows][kChunks];
  for (int r = 0; r < kRows; ++r) {
    for (int c = 0; c < kChunks; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (int64_t pos = 0; pos < ctx.num_visible; ++pos) {
    const C* value = b.value_cache + ctx.offset(pos);
    __m512 v[kChunks];
    for (int c = 0; c < kChunks; ++c) v[c] = load_16(value + 16 * c);
    for (int r = 0; r < kRows; ++r) {
      const __m512 p = _mm512_set1_ps(scores[r * stride + pos]);
      for (int c = 0; c < kChunks; ++c) acc[r][c] = _mm512_fmadd_ps(p, v[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    float* out = b.out + (token * b.q_heads + head0 + r) * b.head_dim;
    const __m512 scale = _mm512_set1_ps(inv_sum[r]);
    for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[r][c], scale));
  }
}

// Rows of one value pass: as many as keep the accumulators and a token's value chunks in the 32 zmm registers.
constexpr int kValueRegisters = 24;
template <int kChunks>
constexpr int kValueRows = std::max(1, std::min(4, kValueRegisters / kChunks - 1));

template <int kChunks, int kRows = kValueRows<kChunks>, typename C>
[[gnu::target("arch=x86-64-v4")]] PS_ALWAYS_INLINE void value_rows_upto(int rows, const AttentionBatch<float, C>& b,
                                                                        const RowContext& ctx, int64_t token,
                                                                        int64_t head0, const float* scores,
                                                                        int64_t stride, const float* inv_sum) {
  if constexpr (kRows >= 1) {
    if (rows == kRows) return value_rows<kChunks, kRows>(b, ctx, token, head0, scores, stride, inv_sum);
    return value_rows_upto<kChunks, kRows - 1>(rows, b, ctx, token, head0, scores, stride, inv_sum);
  }
}

// Every query of the item, each for the group's heads: every head's scores, then the value sums a few heads at
// a time. The first row prefetches the context; the rows after it find it in cache (a 512-token context of one
// kv head is 128 KiB of float32 keys and values).
template <int kChunks, typename C>
[[gnu::target("arch=x86-64-v4")]] void attend(const AttentionBatch<float, C>& b, const AttentionWorkItem& item,
                                              RowScratch& scratch) {
  const int64_t group = b.group();
  const int64_t token_begin = b.query_start_loc[item.seq];
  const int64_t q_len = b.query_start_loc[item.seq + 1] - token_begin;
  const int64_t first_position = b.seq_lens[item.seq] - q_len;
  const int32_t* table = b.block_tables + item.seq * b.max_blocks_per_seq;
  // The item's rows see positions [lo, hi]: the first row's window start to the last row's position.
  const int64_t lo = b.options.first_visible(first_position + item.q_begin);
  const int64_t hi = first_position + item.q_end - 1;
  int64_t* offsets = scratch.offsets(hi + 1 - lo);
  for (int64_t pos = lo; pos <= hi; ++pos) {
    offsets[pos - lo] = kv_cache_offset(table[pos / b.block_size], item.kv_head, pos % b.block_size, b.kv_heads,
                                        b.block_size, b.head_dim);
  }
  const int64_t stride = hi + 1 - lo;  // one row's scores
  float* scores = scratch.scores(std::min<int64_t>(group, kMaxRowGroup) * stride);
  float inv_sum[kMaxRowGroup];
  for (int64_t qi = item.q_begin; qi < item.q_end; ++qi) {
    const int64_t position = first_position + qi;
    const int64_t begin = b.options.first_visible(position);
    const RowContext ctx{offsets, lo, begin, position + 1 - begin};
    const int64_t token = token_begin + qi;
    for (int64_t g0 = 0; g0 < group; g0 += kMaxRowGroup) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxRowGroup, group - g0));
      const bool prefetch = qi == item.q_begin && g0 == 0;
      group_scores<kChunks>(b, ctx, token, item.kv_head * group + g0, rows, prefetch, scores, stride, scratch,
                            inv_sum);
      for (int r = 0; r < rows; r += kValueRows<kChunks>) {
        value_rows_upto<kChunks>(std::min(kValueRows<kChunks>, rows - r), b, ctx, token,
                                 item.kv_head * group + g0 + r, scores + r * stride, stride, inv_sum + r);
      }
    }
  }
}

template <int kChunks = kMaxRowHeadDim / 16, typename C>
void attend_dispatch(int chunks, const AttentionBatch<float, C>& b, const AttentionWorkItem& item,
                     RowScratch& scratch) {
  if constexpr (kChunks >= 1) {
    if (chunks == kChunks) return attend<kChunks>(b, item, scratch);
    return attend_dispatch<kChunks - 1>(chunks, b, item, scratch);
  }
}

#pragma GCC diagnostic pop

}  // namespace

void attend_rows_avx512(const AttentionBatch<float, float>& batch, const AttentionWorkItem& item,
                        RowScratch& scratch) {
  attend_dispatch(static_cast<int>(batch.head_dim / 16), batch, item, scratch);
}

void attend_rows_avx512(const AttentionBatch<float, BFloat16>& batch, const AttentionWorkItem& item,
                        RowScratch& scratch) {
  attend_dispatch(static_cast<int>(batch.head_dim / 16), batch, item, scratch);
}

#else

bool row_attention_supported(int64_t) { return false; }
void attend_rows_avx512(const AttentionBatch<float, float>&, const AttentionWorkItem&, RowScratch&) {}
void attend_rows_avx512(const AttentionBatch<float, BFloat16>&, const AttentionWorkItem&, RowScratch&) {}

#endif

}  // namespace pagedserve::ops
