// grouped_linear on the emulator against the CPU op: ragged and empty
// experts, row tiles that straddle experts' boundaries, N and K not multiples
// of the 64 x 64 tile, padding rows outside the offsets left unwritten.
#include "emu_check.h"

namespace emu_check {
namespace {

void grouped_case(DType dt, int k_size, int n_size, std::vector<int> counts, int lead = 0, int tail = 0) {
  const int experts = static_cast<int>(counts.size());
  Tensor offsets(DType::kInt32, {experts + 1});
  offsets.ints()[0] = lead;
  for (int e = 0; e < experts; ++e) offsets.ints()[e + 1] = offsets.ints()[e] + counts[size_t(e)];
  const int rows = offsets.ints()[experts] + tail;
  Tensor x = Tensor(dt, {rows, k_size}).randomize(), weight = Tensor(dt, {experts, n_size, k_size}).randomize(0.1f);
  Tensor out = Tensor(dt, {rows, n_size}).poison(), expected = Tensor(dt, {rows, n_size}).poison();
  gpu::grouped_linear(out.gpu(), x.gpu(), weight.gpu(), offsets.gpu(), nullptr);
  cpu::grouped_linear(expected.cpu(), x.cpu(), weight.cpu(), offsets.cpu());
  std::string what = std::string("grouped_linear ") + name(dt) + " K" + std::to_string(k_size) + " N" +
                     std::to_string(n_size) + " rows";
  for (int c : counts) what += " " + std::to_string(c);
  // Compare the routed rows; the rest must still be NaN in both.
  const int64_t first = int64_t{lead} * n_size, count = int64_t{offsets.ints()[experts] - lead} * n_size;
  double diff = 0, norm = 0;
  bool finite = true, untouched = true;
  for (int64_t i = 0; i < out.numel(); ++i) {
    const bool routed = i >= first && i < first + count;
    if (!routed) {
      untouched &= std::isnan(out.get(i));
      continue;
    }
    const double a = out.get(i), e = expected.get(i);
    finite &= std::isfinite(a);
    diff += (a - e) * (a - e);
    norm += e * e;
  }
  const double error = finite ? std::sqrt(diff / std::max(norm, 1e-300)) : INFINITY;
  report(what, error < tolerance(dt) && untouched, error);
}

// small_batch_linear against its CPU reference: every row count 1..8, K not a
// multiple of one warp's 256 elements, long rows, bias, the gated epilogue. The sums run
// in another order (lanes, then a shuffle tree), so results agree to the
// dtype's tolerance, not bit for bit.
void small_batch_case(DType dt, int rows, int k_size, int n_size, bool bias, bool gated) {
  Tensor x = Tensor(dt, {rows, k_size}).randomize(), weight = Tensor(dt, {n_size, k_size}).randomize(0.1f);
  Tensor b = Tensor(dt, {n_size}).randomize();
  const int cols = gated ? n_size / 2 : n_size;
  Tensor out = Tensor(dt, {rows, cols}).poison(), expected = Tensor(dt, {rows, cols}).poison();
  gpu::small_batch_linear(out.gpu(), x.gpu(), weight.gpu(), bias ? b.gpu() : pagedserve::ops::TensorView{}, gated,
                          nullptr);
  cpu::small_batch_linear(expected.cpu(), x.cpu(), weight.cpu(), bias ? b.cpu() : pagedserve::ops::TensorView{},
                          gated);
  expect_close(std::string("small_batch_linear ") + name(dt) + " M" + std::to_string(rows) + " K" +
                   std::to_string(k_size) + " N" + std::to_string(n_size) + (bias ? " bias" : "") +
                   (gated ? " gated" : ""),
               out, expected);
}

// qkv_linear_rope_cache against the two kernels it fuses, small_batch_linear
// then qkv_rope_cache, run on the emulator: the same bytes (1..4 rows,
// partial rotary, bias, a padded token).
void qkv_linear_rope_case(DType dt, int rows, int hq, int hkv, int head_dim, int rotary_dim, int k_size, bool bias) {
  const int max_position = 64, num_blocks = 4, block_size = 16, width = (hq + 2 * hkv) * head_dim;
  auto [cos_sin, positions, slots] = rope_inputs(rows, max_position, rotary_dim);
  Tensor x = Tensor(dt, {rows, k_size}).randomize(), weight = Tensor(dt, {width, k_size}).randomize(0.1f);
  Tensor b = Tensor(dt, {width}).randomize(), qkv = Tensor(dt, {rows, width}).poison();
  Tensor query = Tensor(dt, {rows, hq, head_dim}).poison(), query_ref = query;
  Tensor key_cache = Tensor(dt, {num_blocks, hkv, block_size, head_dim}).randomize(), value_cache = key_cache;
  Tensor key_cache_ref = key_cache, value_cache_ref = value_cache;
  const pagedserve::ops::TensorView no_bias{};
  gpu::qkv_linear_rope_cache(query.gpu(), x.gpu(), weight.gpu(), bias ? b.gpu() : no_bias, positions.gpu(),
                             cos_sin.gpu(), key_cache.gpu(), value_cache.gpu(), slots.gpu(), nullptr);
  gpu::small_batch_linear(qkv.gpu(), x.gpu(), weight.gpu(), bias ? b.gpu() : no_bias, false, nullptr);
  gpu::qkv_rope_cache(query_ref.gpu(), qkv.gpu(), positions.gpu(), cos_sin.gpu(), key_cache_ref.gpu(),
                      value_cache_ref.gpu(), slots.gpu(), {}, nullptr);
  report(std::string("qkv_linear_rope_cache ") + name(dt) + " M" + std::to_string(rows) + " Hq" + std::to_string(hq) +
             " Hkv" + std::to_string(hkv) + " D" + std::to_string(head_dim) + " R" + std::to_string(rotary_dim) +
             " K" + std::to_string(k_size) + (bias ? " bias" : ""),
         query.same_bytes(query_ref) && key_cache.same_bytes(key_cache_ref) &&
             value_cache.same_bytes(value_cache_ref));
}

}  // namespace

void small_batch_linear_cases() {
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (int rows = 1; rows <= 8; ++rows) small_batch_case(dt, rows, 264, 10, rows % 2 == 0, false);
    small_batch_case(dt, 1, 2048, 36, false, false);
    small_batch_case(dt, 3, 520, 24, true, true);
    small_batch_case(dt, 8, 64, 6, false, true);
    small_batch_case(dt, 2, 2312, 8, true, true);    // long rows: two or more rounds of eight loads per lane
    small_batch_case(dt, 5, 5632, 6, false, false);
    qkv_linear_rope_case(dt, 1, 4, 2, 16, 16, 264, false);
    qkv_linear_rope_case(dt, 4, 3, 1, 20, 8, 64, true);
    qkv_linear_rope_case(dt, 2, 5, 1, 12, 6, 72, true);    // 18 pairs: the last pair block part full
    qkv_linear_rope_case(dt, 3, 2, 2, 64, 64, 2048, false);  // TinyLlama's head dim and K
  }
}

void grouped_linear_cases() {
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    grouped_case(dt, 128, 96, {70, 0, 5, 64, 1});        // empty expert, tiles of 1 to 64 rows
    grouped_case(dt, 200, 64, {3, 130}, 2, 3);             // K past the 64-chunk, padding rows around
    grouped_case(dt, 64, 130, {17, 9, 0, 0, 40});          // N past the tile, trailing empty experts
  }
}

}  // namespace emu_check
