// Paged attention over a mixed batch of decodes and prefill chunks.
//
// The batch is cut into work items (sequence, kv head, tile of queries) that
// the pool runs in parallel; the row kernel (decode_attention.h, float32
// queries on AVX-512) or the tile kernel (attention_tile.h, everything else)
// computes one item. The cache has the queries' dtype, or is bf16 under
// float32 queries (a bf16 KV cache: half the bytes, widened as read). Every index
// the kernel will follow (query ranges, lengths, block ids) is checked first,
// by the op's contract (op_contracts.h), so the kernel itself cannot read out
// of bounds or throw.
#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops/attention_tile.h"
#include "ops/cpu_isa.h"
#include "ops/decode_attention.h"
#include "ops/dispatch.h"
#include "ops/op_contracts.h"
#include "ops/ops.h"
#include "ops/parallel.h"

namespace pagedserve::ops {
namespace {

constexpr std::string_view kOp = "paged_attention";

// Rows (query x head) per work item: enough to amortize converting each
// key/value tile, few enough that a long prefill still splits across workers.
constexpr int64_t kRowsPerItem = 32;

struct WorkPlan {
  std::vector<AttentionWorkItem> items;  // most expensive first, so the pool's dynamic scheduling balances well
  int64_t max_rows = 0;
  int64_t total_work = 0;  // in parallel.h's work units
};

WorkPlan plan_work(const TensorView& query_start_loc, const TensorView& seq_lens, int64_t kv_heads, int64_t group,
                   int64_t head_dim, const AttentionOptions& options) {
  const int32_t* starts = query_start_loc.ptr<int32_t>();
  const int32_t* lens = seq_lens.ptr<int32_t>();
  const int64_t queries_per_item = std::max<int64_t>(1, kRowsPerItem / group);
  std::vector<std::pair<int64_t, AttentionWorkItem>> costed;
  WorkPlan plan;
  for (int32_t s = 0; s < static_cast<int32_t>(seq_lens.size(0)); ++s) {
    const int64_t q_len = int64_t{starts[s + 1]} - starts[s];
    const int64_t first_position = lens[s] - q_len;
    for (int64_t q_begin = 0; q_begin < q_len; q_begin += queries_per_item) {
      const int64_t q_end = std::min(q_len, q_begin + queries_per_item);
      const int64_t rows = (q_end - q_begin) * group;
      // Two multiply-adds (score, value) per row, position and dim make one work unit;
      // a window bounds the positions the item reads (attend_work_item).
      const int64_t context = first_position + q_end - options.first_visible(first_position + q_begin);
      const int64_t cost = rows * context * head_dim;
      plan.max_rows = std::max(plan.max_rows, rows);
      plan.total_work += cost * kv_heads;
      for (int32_t h = 0; h < static_cast<int32_t>(kv_heads); ++h) {
        costed.push_back({cost, {s, h, static_cast<int32_t>(q_begin), static_cast<int32_t>(q_end)}});
      }
    }
  }
  std::stable_sort(costed.begin(), costed.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  plan.items.reserve(costed.size());
  for (const auto& entry : costed) plan.items.push_back(entry.second);
  return plan;
}

// The one dispatch point of the kernel's types: fn<T, C>() with T the query
// type and C the cache's, either T or (float32 queries, bf16 cache). The
// contract (check_paged_attention) admits no other pair.
template <typename Fn>
void dispatch_attention(DType query_dtype, DType cache_dtype, Fn&& fn) {
  dispatch_float(query_dtype, kOp, [&]<typename T>() {
    if constexpr (std::is_same_v<T, float>) {
      if (cache_dtype == DType::kBFloat16) return fn.template operator()<float, BFloat16>();
    }
    return fn.template operator()<T, T>();
  });
}

}  // namespace

void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables, const TensorView& query_start_loc,
                     const TensorView& seq_lens, float scale, const AttentionOptions& options) {
  check_paged_attention(Device::kCPU, out, query, key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                        options);
  const int64_t q_heads = query.size(1);
  const int64_t kv_heads = key_cache.size(1);
  const int64_t head_dim = query.size(2);
  const WorkPlan plan = plan_work(query_start_loc, seq_lens, kv_heads, q_heads / kv_heads, head_dim, options);
  if (plan.items.empty()) return;

  dispatch_attention(query.dtype, key_cache.dtype, [&]<typename T, typename C>() {
    const AttentionBatch<T, C> batch{out.ptr<T>(),
                                     query.ptr<T>(),
                                     key_cache.ptr<C>(),
                                     value_cache.ptr<C>(),
                                     block_tables.ptr<int32_t>(),
                                     query_start_loc.ptr<int32_t>(),
                                     seq_lens.ptr<int32_t>(),
                                     q_heads,
                                     kv_heads,
                                     head_dim,
                                     key_cache.size(2),
                                     block_tables.size(1),
                                     scale,
                                     options};
    const ParallelRun run = parallel_run(plan.total_work);
    // float32 queries take the row kernel (decode_attention.h) for every row,
    // prefill rows included, so a row rounds the same whatever its chunk.
    if constexpr (std::is_same_v<T, float>) {
      if (row_attention_supported(head_dim)) {
        std::vector<RowScratch> scratch(static_cast<size_t>(run.num_workers()));
        run.for_each(static_cast<int64_t>(plan.items.size()), [&](int64_t task, int worker) {
          attend_rows_avx512(batch, plan.items[static_cast<size_t>(task)], scratch[static_cast<size_t>(worker)]);
        });
        return;
      }
    }
    std::vector<AttentionScratch> scratch;
    scratch.reserve(static_cast<size_t>(run.num_workers()));
    for (int w = 0; w < run.num_workers(); ++w) scratch.emplace_back(plan.max_rows, head_dim);
    run.for_each(static_cast<int64_t>(plan.items.size()), [&](int64_t task, int worker) {
      const AttentionWorkItem& item = plan.items[static_cast<size_t>(task)];
      AttentionScratch& worker_scratch = scratch[static_cast<size_t>(worker)];
      with_tile_isa([&]<int kVectorFloats, bool kFma>() PS_INLINE_BODY {
        attend_work_item<kVectorFloats, kFma>(batch, item, worker_scratch);
      });
    });
  });
}

}  // namespace pagedserve::ops
