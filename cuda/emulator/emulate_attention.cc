// paged_attention on the emulator against the CPU op: split-K decode, prefill
// / extend, float32, and the options (sliding window, soft-capping).
#include "emu_check.h"
#include "smem_tile.cuh"

namespace emu_check {
namespace {

struct Row {
  int q_len;
  int seq_len;
};

struct AttentionCase {
  DType dtype;
  int head_dim, block_size, num_kv_heads, group;
  std::vector<Row> rows;  // decode rows (q_len 1) first
  int max_seq_len = 0;     // 0: the longest row's
  int workspace_rows = 0;  // 0: size the workspace for the decode rows
  int padding_tokens = 0;  // query tokens past the last row, which must stay untouched
  cpu::AttentionOptions options = {};
  std::vector<int> decode_order = {};  // empty: row order
};

void attention_case(const AttentionCase& c) {
  const int hq = c.num_kv_heads * c.group, D = c.head_dim, B = c.block_size;
  const int S = static_cast<int>(c.rows.size());
  int num_decodes = 0;
  while (num_decodes < S && c.rows[size_t(num_decodes)].q_len == 1) ++num_decodes;
  int num_tokens = 0, max_q = 1, max_s = 0, max_blocks = 1, total_blocks = 0;
  for (const Row& r : c.rows) {
    num_tokens += r.q_len;
    max_q = std::max(max_q, r.q_len);
    max_s = std::max(max_s, r.seq_len);
    max_blocks = std::max(max_blocks, (r.seq_len + B - 1) / B);
    total_blocks += (r.seq_len + B - 1) / B;
  }
  const int num_blocks = total_blocks + 3, pad_block = num_blocks - 1;
  std::vector<int> free_blocks(size_t(num_blocks - 1));
  std::iota(free_blocks.begin(), free_blocks.end(), 0);
  std::shuffle(free_blocks.begin(), free_blocks.end(), rng);

  Tensor tables(DType::kInt32, {S, max_blocks}), starts(DType::kInt32, {S + 1}), lens(DType::kInt32, {S});
  Tensor key_cache = Tensor(c.dtype, {num_blocks, c.num_kv_heads, B, D}).poison();
  Tensor value_cache = Tensor(c.dtype, {num_blocks, c.num_kv_heads, B, D}).poison();
  size_t next_block = 0;
  starts.ints()[0] = 0;
  for (int s = 0; s < S; ++s) {
    const Row r = c.rows[size_t(s)];
    int32_t* table = tables.ints() + s * max_blocks;
    // Blocks wholly before the first query's window point at the NaN pad block,
    // as if given back to the pool: reading one would poison the output.
    const int first_read = r.q_len > 0 ? int(c.options.first_visible(r.seq_len - r.q_len)) / B : 0;
    for (int i = 0; i < max_blocks; ++i) {
      table[i] = i >= first_read && i < (r.seq_len + B - 1) / B ? free_blocks[next_block++] : pad_block;
    }
    starts.ints()[s + 1] = starts.ints()[s] + r.q_len;
    lens.ints()[s] = r.seq_len;
    for (int p = first_read * B; p < r.seq_len; ++p) {  // only readable slots get values; the rest stay NaN
      for (int h = 0; h < c.num_kv_heads; ++h) {
        for (int d = 0; d < D; ++d) {
          const int64_t offset = ((int64_t{table[p / B]} * c.num_kv_heads + h) * B + p % B) * D + d;
          key_cache.set(offset, randn());
          value_cache.set(offset, randn());
        }
      }
    }
  }
  Tensor query = Tensor(c.dtype, {num_tokens + c.padding_tokens, hq, D}).randomize(c.options.softcap > 0 ? 4.f : 1.f);
  Tensor out = Tensor(c.dtype, {num_tokens + c.padding_tokens, hq, D}).poison();
  Tensor query_ref(c.dtype, {num_tokens, hq, D}), out_ref(c.dtype, {num_tokens, hq, D});
  std::memcpy(query_ref.data(), query.data(), query_ref.bytes.size());
  const float scale = 1.f / std::sqrt(float(D));
  const int max_seq_len = c.max_seq_len ? c.max_seq_len : max_s;
  const size_t workspace_bytes =
      gpu::paged_attention_workspace_bytes(c.workspace_rows ? c.workspace_rows : num_decodes, hq, D, max_seq_len);
  Tensor workspace = Tensor(DType::kFloat32, {std::max<int64_t>(1, int64_t(workspace_bytes + 3) / 4)}).poison();

  Tensor order(DType::kInt32, {std::max<int64_t>(1, int64_t(c.decode_order.size()))});
  std::copy(c.decode_order.begin(), c.decode_order.end(), order.ints());

  gpu::paged_attention(out.gpu(), query.gpu(), key_cache.gpu(), value_cache.gpu(), tables.gpu(), starts.gpu(),
                       lens.gpu(), scale, max_q, max_seq_len, num_decodes, workspace.gpu(),
                       c.decode_order.empty() ? TensorView{} : order.gpu(), c.options, nullptr);
  cpu::paged_attention(out_ref.cpu(), query_ref.cpu(), key_cache.cpu(), value_cache.cpu(), tables.cpu(), starts.cpu(),
                       lens.cpu(), scale, c.options);

  std::string what = std::string("paged_attention ") + name(c.dtype) + " D" + std::to_string(D) + " B" +
                     std::to_string(B) + " G" + std::to_string(c.group) + " rows";
  for (const Row& r : c.rows) what += " " + std::to_string(r.q_len) + "/" + std::to_string(r.seq_len);
  if (c.max_seq_len) what += " max_seq_len " + std::to_string(c.max_seq_len);
  if (c.workspace_rows) what += " workspace x" + std::to_string(c.workspace_rows);
  if (!c.decode_order.empty()) what += " longest first";
  if (c.options.window) what += " window " + std::to_string(c.options.window);
  if (c.options.softcap > 0) what += " softcap " + std::to_string(int(c.options.softcap));
  const double error = relative_error(out, out_ref, out_ref.numel());
  report(what, error < tolerance(c.dtype), error);
  if (c.padding_tokens) {
    bool untouched = true;
    for (int64_t i = out_ref.numel(); i < out.numel(); ++i) untouched &= std::isnan(out.get(i));
    report("  padding tokens left unwritten", untouched);
  }
}

// LaneTileOffsets (registers plus constants) against SwizzledTile::offset for
// every lane row, half, row block and head-dim step the kernels use.
template <int kHeadDim>
void lane_tile_offsets_case() {
  using pagedserve::cuda::LaneTileOffsets;
  using pagedserve::cuda::SwizzledTile;
  int mismatches = 0;
  for (int lane_row = 0; lane_row < 16; ++lane_row) {
    for (int half = 0; half < 2; ++half) {
      const LaneTileOffsets<kHeadDim> rows(lane_row, half);
      for (int first_row = 0; first_row < 128; first_row += 8) {
        for (int step = 0; step < kHeadDim / 16; ++step) {
          mismatches += rows(first_row, step) != SwizzledTile<kHeadDim>::offset(first_row + lane_row, 2 * step + half);
        }
      }
    }
  }
  report("LaneTileOffsets = SwizzledTile::offset, D " + std::to_string(kHeadDim), mismatches == 0, mismatches);
}

}  // namespace

void attention_cases() {
  lane_tile_offsets_case<64>();
  lane_tile_offsets_case<128>();
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    // Split-K decode (2 partitions), single-partition decode rows, prefill after a cached prefix.
    attention_case({dt, 128, 16, 2, 4, {{1, 700}, {1, 1}, {1, 70}, {5, 40}, {70, 100}}});
    // A workspace sized for 64 rows lets 2 rows split into 256-token partitions.
    attention_case({dt, 64, 32, 1, 8, {{1, 300}, {1, 17}}, 0, 64});
    // The decode grid sized for max_seq_len 1500 (CUDA graphs): extra partitions exit.
    attention_case({dt, 64, 16, 2, 1, {{1, 33}, {66, 66}, {3, 200}}, 1500});
  }
  attention_case({DType::kBFloat16, 128, 32, 1, 32, {{1, 130}, {20, 50}}});  // 32 heads per kv head: two CTAs
  attention_case({DType::kBFloat16, 128, 32, 2, 2, {{1, 512}, {1, 513}, {1, 1100}, {130, 200}, {64, 64}, {65, 65}}});
  attention_case({DType::kFloat16, 64, 16, 4, 1, {{2, 2}, {129, 129}, {7, 300}}});          // prefill only
  attention_case({DType::kBFloat16, 128, 16, 2, 4, {{1, 1}, {1, 2}, {1, 64}, {1, 65}}, 0, 256});  // decode only
  attention_case({DType::kFloat16, 128, 16, 2, 4, {{1, 40}, {5, 20}}, 0, 0, 3});
  attention_case({DType::kFloat32, 128, 16, 2, 4, {{1, 40}, {5, 20}}, 0, 0, 3});
  // 34 rows x 8 kv heads fill the emulated card's 2 x 132 CTAs: one 2048-token partition a row (contexts past
  // the fixed split's 512), written without partials or the reduce kernel.
  std::vector<Row> many;
  for (int i = 0; i < 34; ++i) many.push_back({1, 520 + 15 * i});
  attention_case({DType::kBFloat16, 64, 16, 8, 1, many});
  // The runner's launch order (longest context first; grids past the card's 264 CTA slots read it): in one
  // partition a row, and 40 rows x 4 kv heads split in two 512-token partitions beside a prefill row.
  std::vector<int> longest_first(34);
  std::iota(longest_first.begin(), longest_first.end(), 0);
  std::reverse(longest_first.begin(), longest_first.end());
  attention_case({DType::kBFloat16, 64, 16, 8, 1, many, 0, 0, 0, {}, longest_first});
  std::vector<Row> mixed;
  for (int i = 0; i < 40; ++i) mixed.push_back({1, 100 + (i * 7919) % 40 * 15});
  std::vector<int> order(40);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return mixed[size_t(a)].seq_len > mixed[size_t(b)].seq_len; });
  mixed.push_back({5, 40});
  attention_case({DType::kFloat16, 64, 16, 4, 2, mixed, 0, 256, 0, {}, order});
}

void attention_option_cases() {
  // Sliding windows (smaller and larger than the contexts, windows that start
  // mid-block and mid-tile, chunked prefill past the window) and soft-capping.
  // With a cap the queries are scaled up (x4) so that the cap bends the scores.
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    attention_case({dt, 128, 16, 2, 4, {{1, 700}, {1, 1}, {1, 70}, {5, 40}, {70, 300}}, 0, 0, 0, {100, 0.f}});
    attention_case({dt, 64, 16, 2, 1, {{1, 33}, {66, 66}, {3, 200}}, 1500, 0, 0, {37, 3.f}});
  }
  // Split-K inside the window (600 tokens: 3 partitions of 256), a chunk whose window starts mid-tile.
  attention_case({DType::kBFloat16, 64, 32, 1, 8, {{1, 1300}, {1, 17}, {70, 900}, {64, 64}}, 0, 0, 0, {600, 0.f}});
  attention_case({DType::kFloat16, 128, 16, 2, 4, {{1, 700}, {1, 70}, {70, 300}}, 0, 0, 0, {0, 5.f}});
  attention_case({DType::kFloat16, 64, 16, 4, 1, {{129, 129}, {20, 300}}, 0, 0, 0, {1, 0.f}});  // only itself
  attention_case({DType::kFloat16, 128, 16, 2, 4, {{1, 40}, {5, 20}}, 0, 0, 3, {8, 2.f}});
  // From prefill::kWideQueryLen query tokens at D 128 the 8-warp CTA runs every prefill row: a chunk after a
  // cached prefix whose window starts mid-tile (soft-capped), a short row beside it, and a whole causal prompt.
  attention_case({DType::kBFloat16, 128, 16, 1, 2, {{1, 300}, {2100, 2150}, {70, 100}}, 0, 0, 0, {96, 5.f}});
  attention_case({DType::kFloat16, 128, 16, 1, 1, {{2048, 2048}}});
}

}  // namespace emu_check
