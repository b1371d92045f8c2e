// sample_tokens on the emulator against the CPU op: the same token in every
// row. The kernel skips candidates by bounds on their noise (sampling_kernel.cu),
// so the rows below are the cases a wrong bound would show: flat logits, whose
// winner is the token with the largest noise (a uniform in the top, finely
// split bucket), peaked ones, greedy and near-greedy temperatures, masks,
// ties, infinities and NaN.
#include "emu_check.h"
#include "ops/token_mask.h"

namespace emu_check {
namespace {

// One row's logits: normal with standard deviation `scale`, plus the special rows' values.
enum class RowKind { kNormal, kEqual, kInfinities, kNaNs };

void fill_row(Tensor& logits, int row, int vocab, float scale, RowKind kind) {
  const int64_t base = int64_t(row) * vocab;
  for (int v = 0; v < vocab; ++v) logits.set(base + v, kind == RowKind::kEqual ? 0.5f : scale * randn());
  if (kind == RowKind::kInfinities) {  // two +inf: the lower id wins; a -inf never does
    logits.set(base + vocab / 3, INFINITY);
    logits.set(base + vocab / 2, INFINITY);
    logits.set(base + 1, -INFINITY);
  }
  if (kind == RowKind::kNaNs) {
    for (int v = 0; v < vocab; v += 97) logits.set(base + v, NAN);
  }
}

void sampling_case(DType dt, int rows, int vocab, float scale, bool masked, bool few_allowed = false) {
  Tensor logits(dt, {rows, vocab}), inv_t(DType::kFloat32, {rows});
  const int words = int(pagedserve::ops::token_mask_words(vocab));
  Tensor allowed(DType::kInt32, {rows, words});
  const float temperatures[] = {0.6f, 1.0f, 0.f, 1e-3f, 5.f, 0.6f, 0.6f, 0.6f};
  for (int r = 0; r < rows; ++r) {
    const RowKind kind = r % 8 == 5 ? RowKind::kEqual : r % 8 == 6 ? RowKind::kInfinities
                         : r % 8 == 7 ? RowKind::kNaNs : RowKind::kNormal;
    fill_row(logits, r, vocab, scale, kind);
    const float t = temperatures[r % 8];
    static_cast<float*>(inv_t.data())[r] = t > 0.f ? 1.f / t : 0.f;
    for (int w = 0; w < words; ++w) {  // a random mask, with row 2 of each 8 allowing nothing
      allowed.ints()[int64_t(r) * words + w] = r % 8 == 2 || few_allowed ? 0 : int32_t(rng());
    }
    for (int k = 0; few_allowed && k < 2; ++k) {  // or 2 tokens: the winner's noise is mostly moderate
      const int v = randint(0, vocab - 1);
      allowed.ints()[int64_t(r) * words + v / 32] |= int32_t(1u << (v % 32));
    }
  }
  const TensorView none{};
  for (const uint64_t seed : {uint64_t(7), uint64_t(0x5eed5eed5eedULL)}) {
    Tensor out(DType::kInt32, {rows}), expected(DType::kInt32, {rows});
    gpu::sample_tokens(out.gpu(), logits.gpu(), inv_t.gpu(), masked ? allowed.gpu() : none, seed, nullptr);
    cpu::sample_tokens(expected.cpu(), logits.cpu(), inv_t.cpu(), masked ? allowed.cpu() : none, seed);
    int differ = 0;
    for (int r = 0; r < rows; ++r) differ += out.ints()[r] != expected.ints()[r];
    const std::string mask_kind = !masked ? "" : few_allowed ? " 2 allowed" : " masked";
    report("sample_tokens " + std::string(name(dt)) + " " + std::to_string(rows) + " x " + std::to_string(vocab) +
               " scale " + std::to_string(scale).substr(0, 4) + mask_kind + ", rows differing",
           differ == 0, differ);
  }
}

}  // namespace

void sampling_cases() {
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    sampling_case(dt, 64, 49155, 0.3f, false);  // random-weight logits: the noise decides
    sampling_case(dt, 16, 32000, 3.f, false);
    sampling_case(dt, 16, 32000, 30.f, false);  // a real model's peaked rows
    sampling_case(dt, 16, 1000, 1.f, false);    // fewer tokens than threads
    sampling_case(dt, 16, 49155, 3.f, true);
    sampling_case(dt, 1024, 4096, 0.f, true, true);  // 2 equal tokens a row: the coarse buckets' bounds decide
  }
}

}  // namespace emu_check
