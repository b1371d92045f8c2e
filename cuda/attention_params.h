// What the paged-attention kernels receive (by value, as kernel parameters).
//
// The host validates shapes and fills these once per call; the per-step
// values a CUDA graph must not freeze (lengths, block tables) stay behind the
// device pointers.
#pragma once

#include <cstdint>

namespace pagedserve::cuda {

struct PagedAttentionParams {
  void* out;                        // [T, Hq, D]
  const void* query;                // [T, Hq, D]
  const void* key_cache;            // [N, Hkv, B, D]
  const void* value_cache;          // [N, Hkv, B, D]
  const int32_t* block_tables;      // [S, max_blocks_per_seq]
  const int32_t* query_start_loc;   // [S + 1]
  const int32_t* seq_lens;          // [S]
  // [num_decodes]: the decode rows in the order their CTAs launch (the runner puts the longest contexts
  // first), or null for row order. Entries outside [0, num_decodes) are skipped.
  const int32_t* decode_order;
  float scale;
  int num_seqs;
  int num_tokens;
  int num_heads;
  int num_kv_heads;
  int max_blocks_per_seq;
  int max_query_len;
  int max_seq_len;
  int num_decodes;
  // Options (cpp/ops/attention_options.h), read by every kernel.
  int window_span;  // the sliding window W, or INT_MAX for none: key k is hidden from query q when q - k >= span
  float softcap;    // 0: none
  bool fixed_split;  // the decode split depends on the row's context only (AttentionOptions::fixed_split)
};

// Split-K plan of the decode kernel: each decode row's context is cut into
// partitions of partition_tokens; partition p of (row, head) leaves its
// normalized output and its softmax max / sum (log2 domain) in the workspace.
struct DecodeSplit {
  int partition_tokens;
  int num_partitions;  // grid size along the context, from the host max_seq_len
  float* partial_out;  // [num_decodes, Hq, num_partitions, D]
  float* partial_max;  // [num_decodes, Hq, num_partitions]
  float* partial_sum;  // [num_decodes, Hq, num_partitions]
};

}  // namespace pagedserve::cuda
