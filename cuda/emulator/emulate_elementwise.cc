// The elementwise ops and cache writers on the emulator against the CPU ops:
// most are bit-identical, all within the dtype's tolerance.
#include <atomic>
#include <chrono>
#include <thread>

#include "emu_check.h"

namespace emu_check {
namespace {

void norm_cases(DType dt) {
  // 20 x 2048 and 16 x 576: torch's order at width 32 (the row counts of a batched decode step).
  for (auto [rows, hidden] : std::vector<std::pair<int, int>>{{3, 2048}, {5, 1001}, {2, 16384}, {17, 128}, {2, 8},
                                                              {20, 2048}, {16, 576}}) {
    const std::string shape = std::string(name(dt)) + " " + std::to_string(rows) + "x" + std::to_string(hidden);
    Tensor x = Tensor(dt, {rows, hidden}).randomize(3), weight = Tensor(dt, {hidden}).randomize();
    Tensor out = Tensor(dt, {rows, hidden}).poison(), expected(dt, {rows, hidden});
    gpu::rms_norm(out.gpu(), x.gpu(), weight.gpu(), 1e-6f, false, nullptr);
    cpu::rms_norm(expected.cpu(), x.cpu(), weight.cpu(), 1e-6f);
    expect_close("rms_norm " + shape, out, expected);

    Tensor residual = Tensor(dt, {rows, hidden}).randomize(2);
    Tensor x_ref = x, residual_ref = residual;
    gpu::fused_add_rms_norm(x.gpu(), residual.gpu(), weight.gpu(), 1e-6f, false, nullptr);
    cpu::fused_add_rms_norm(x_ref.cpu(), residual_ref.cpu(), weight.cpu(), 1e-6f);
    expect_close("fused_add_rms_norm x " + shape, x, x_ref);
    expect_close("fused_add_rms_norm residual " + shape, residual, residual_ref);
    Tensor fixed = Tensor(dt, {rows, hidden}).poison();
    gpu::rms_norm(fixed.gpu(), x_ref.gpu(), weight.gpu(), 1e-6f, true, nullptr);
    cpu::rms_norm(expected.cpu(), x_ref.cpu(), weight.cpu(), 1e-6f);
    expect_close("rms_norm fixed order " + shape, fixed, expected);
  }
}

int last_pow2(int n) {
  int p = 1;
  while (2 * p <= n) p *= 2;
  return p;
}

// What transformers' LlamaRMSNorm computes on a CUDA [rows, hidden] tensor, as a plain loop: the mean of
// squares added in the order of torch's block reduction (its ReduceConfig for a contiguous last dim:
// `width` threads a row, four lane sums each, a shared-memory halving to 32, then a shuffle-down tree;
// bench/numerics/norm_numerics.py found this order on an H200), rsqrt, the normalized value rounded to
// the dtype before the weight multiply. The kernels must give these bytes exactly.
Tensor torch_order_norm(Tensor& x, Tensor& weight, int rows, int hidden, float eps) {
  const int dim0 = hidden / 4;
  const int dim0_pow2 = dim0 < 512 ? last_pow2(dim0) : 512;
  const int dim1_pow2 = rows < 512 ? last_pow2(rows) : 512;
  const int height = std::min(dim1_pow2, 512 / std::min(dim0_pow2, 32));
  const int width = std::min(dim0_pow2, 512 / height);
  const float inv_hidden = float(rows) / float(int64_t(rows) * hidden);
  Tensor out(x.dtype, {rows, hidden});
  for (int r = 0; r < rows; ++r) {
    const int64_t base = int64_t(r) * hidden;
    std::vector<float> partial(size_t(width), 0.f);
    for (int t = 0; t < width; ++t) {
      float lanes[4] = {0.f, 0.f, 0.f, 0.f};
      for (int v = t; 4 * v + 3 < hidden; v += width) {
        for (int e = 0; e < 4; ++e) lanes[e] += x.get(base + 4 * v + e) * x.get(base + 4 * v + e);
      }
      partial[size_t(t)] = ((lanes[0] + lanes[1]) + lanes[2]) + lanes[3];
    }
    for (int offset = width / 2; offset >= 32; offset /= 2) {
      for (int t = 0; t < offset; ++t) partial[size_t(t)] += partial[size_t(t + offset)];
    }
    for (int offset = 16; offset > 0; offset /= 2) {  // shuffle-down: lane t reads lane t + offset's old value
      for (int t = 0; t + offset < 32; ++t) partial[size_t(t)] += partial[size_t(t + offset)];
    }
    const float inv_rms = rsqrtf(partial[0] * inv_hidden + eps);
    Tensor normalized(x.dtype, {1});
    for (int i = 0; i < hidden; ++i) {
      normalized.set(0, x.get(base + i) * inv_rms);
      out.set(base + i, normalized.get(0) * weight.get(i));
    }
  }
  return out;
}

// rms_norm and fused_add_rms_norm against the loop above, byte for byte, at every torch width (512 at
// 1 row of 2048 down to 32 from 16 rows), a width-32 row of 34 vectors, past 512 rows and 4096 wide.
void torch_order_norm_cases(DType dt) {
  for (auto [rows, hidden] : std::vector<std::pair<int, int>>{{1, 2048}, {2, 2048}, {4, 2048}, {8, 2048}, {16, 2048},
                                                              {64, 2048}, {1, 576}, {3, 576}, {16, 576}, {64, 576},
                                                              {12, 1024}, {5, 136}, {601, 576}, {3, 4096}}) {
    const std::string shape = std::string(name(dt)) + " " + std::to_string(rows) + "x" + std::to_string(hidden);
    const float eps = 1e-5f;
    Tensor x = Tensor(dt, {rows, hidden}).randomize(3), weight = Tensor(dt, {hidden}).randomize();
    Tensor out = Tensor(dt, {rows, hidden}).poison();
    gpu::rms_norm(out.gpu(), x.gpu(), weight.gpu(), eps, false, nullptr);
    report("rms_norm in torch's order " + shape, out.same_bytes(torch_order_norm(x, weight, rows, hidden, eps)));

    Tensor residual = Tensor(dt, {rows, hidden}).randomize(3), sum(dt, {rows, hidden});
    for (int64_t i = 0; i < sum.numel(); ++i) sum.set(i, x.get(i) + residual.get(i));
    gpu::fused_add_rms_norm(x.gpu(), residual.gpu(), weight.gpu(), eps, false, nullptr);
    report("fused_add_rms_norm in torch's order " + shape,
           residual.same_bytes(sum) && x.same_bytes(torch_order_norm(sum, weight, rows, hidden, eps)));
  }
}

void rotary_cases(DType dt) {
  for (auto [tokens, hq, hkv, head_dim, rotary_dim] :
       std::vector<std::array<int, 5>>{{3, 8, 2, 128, 128}, {5, 4, 4, 128, 64}, {4, 6, 2, 80, 40}, {2, 2, 1, 64, 64}}) {
    const int max_position = 64;
    Tensor cos_sin(DType::kFloat32, {max_position, rotary_dim});
    for (int p = 0; p < max_position; ++p) {
      for (int i = 0; i < rotary_dim / 2; ++i) {
        const double angle = p * std::pow(10000.0, -2.0 * i / rotary_dim);
        cos_sin.set(p * rotary_dim + i, float(std::cos(angle)));
        cos_sin.set(p * rotary_dim + rotary_dim / 2 + i, float(std::sin(angle)));
      }
    }
    Tensor positions(DType::kInt32, {tokens});
    for (int t = 0; t < tokens; ++t) positions.ints()[t] = randint(0, max_position - 1);
    Tensor query = Tensor(dt, {tokens, hq, head_dim}).randomize(), key = Tensor(dt, {tokens, hkv, head_dim}).randomize();
    Tensor query_ref = query, key_ref = key;
    gpu::rotary_embedding(positions.gpu(), query.gpu(), key.gpu(), cos_sin.gpu(), nullptr);
    cpu::rotary_embedding(positions.cpu(), query_ref.cpu(), key_ref.cpu(), cos_sin.cpu());
    const std::string shape = std::string(name(dt)) + " D" + std::to_string(head_dim) + " R" + std::to_string(rotary_dim);
    expect_close("rotary_embedding query " + shape, query, query_ref);
    expect_close("rotary_embedding key " + shape, key, key_ref);
  }
}

// The fused attention input against the unfused CPU ops it replaces: bit-identical queries and caches,
// with partial rotary, a padded token (no KV write) and an out-of-table position (left unrotated on the GPU;
// the CPU contract refuses it, so that token is compared with the unrotated copy).
void qkv_rope_cache_cases(DType dt) {
  for (auto [tokens, hq, hkv, head_dim, rotary_dim, block_size] :
       std::vector<std::array<int, 6>>{{5, 8, 2, 128, 128, 16}, {3, 4, 4, 64, 32, 16}, {4, 6, 2, 80, 40, 32},
                                       {2, 3, 1, 10, 6, 16}}) {
    const int max_position = 64, num_blocks = 4;
    auto [cos_sin, positions, slots] = rope_inputs(tokens, max_position, rotary_dim);
    const int width = (hq + 2 * hkv) * head_dim;
    Tensor qkv = Tensor(dt, {tokens, width}).randomize();
    Tensor query = Tensor(dt, {tokens, hq, head_dim}).poison(), query_ref = query;
    Tensor key_cache = Tensor(dt, {num_blocks, hkv, block_size, head_dim}).randomize(), value_cache = key_cache;
    Tensor key_cache_ref = key_cache, value_cache_ref = value_cache;
    gpu::qkv_rope_cache(query.gpu(), qkv.gpu(), positions.gpu(), cos_sin.gpu(), key_cache.gpu(), value_cache.gpu(),
                        slots.gpu(), {}, nullptr);
    cpu::qkv_rope_cache(query_ref.cpu(), qkv.cpu(), positions.cpu(), cos_sin.cpu(), key_cache_ref.cpu(),
                        value_cache_ref.cpu(), slots.cpu());
    const std::string shape = std::string(name(dt)) + " Hq" + std::to_string(hq) + " Hkv" + std::to_string(hkv) +
                              " D" + std::to_string(head_dim) + " R" + std::to_string(rotary_dim);
    report("qkv_rope_cache " + shape, query.same_bytes(query_ref) && key_cache.same_bytes(key_cache_ref) &&
                                          value_cache.same_bytes(value_cache_ref));
    positions.ints()[0] = max_position + 3;  // out of the table: q and k copied unrotated
    gpu::qkv_rope_cache(query.gpu(), qkv.gpu(), positions.gpu(), cos_sin.gpu(), key_cache.gpu(), value_cache.gpu(),
                        slots.gpu(), {}, nullptr);
    bool unrotated = true;
    for (int i = 0; i < hq * head_dim; ++i) unrotated &= query.get(i) == qkv.get(i);
    report("qkv_rope_cache out-of-table position " + shape, unrotated);
  }
}

// A column block [t, c0, c0 + width) of a [T, W] tensor, copied out as [T * width / d, d].
Tensor column_rows(Tensor& src, int tokens, int row_width, int c0, int width, int d) {
  Tensor out(src.dtype, {tokens * width / d, d});
  for (int t = 0; t < tokens; ++t) {
    for (int c = 0; c < width; ++c) out.set(int64_t(t) * width + c, src.get(int64_t(t) * row_width + c0 + c));
  }
  return out;
}

// With q/k norms (Qwen3): the fused kernel against the unfused kernels it replaces (rms_norm of the head
// rows, rotary_embedding, reshape_and_cache), byte for byte, with a padded token and an out-of-table position;
// and within tolerance of the CPU op.
void qkv_rope_cache_norm_cases(DType dt) {
  for (auto [tokens, hq, hkv, head_dim] :
       std::vector<std::array<int, 4>>{{5, 8, 2, 128}, {3, 4, 4, 64}, {4, 6, 2, 32}, {2, 2, 1, 16}}) {
    const int max_position = 64, num_blocks = 4, block_size = 16;
    auto [cos_sin, positions, slots] = rope_inputs(tokens, max_position, head_dim);
    positions.ints()[tokens - 1] = max_position + 1;  // out of the table: normalized, not rotated
    const int width = (hq + 2 * hkv) * head_dim;
    const float eps = 1e-6f;
    Tensor qkv = Tensor(dt, {tokens, width}).randomize(2);
    Tensor q_weight = Tensor(dt, {head_dim}).randomize(), k_weight = Tensor(dt, {head_dim}).randomize();
    Tensor query = Tensor(dt, {tokens, hq, head_dim}).poison();
    Tensor key_cache = Tensor(dt, {num_blocks, hkv, block_size, head_dim}).randomize(), value_cache = key_cache;
    Tensor key_cache_ref = key_cache, value_cache_ref = value_cache;
    gpu::qkv_rope_cache(query.gpu(), qkv.gpu(), positions.gpu(), cos_sin.gpu(), key_cache.gpu(), value_cache.gpu(),
                        slots.gpu(), {q_weight.gpu(), k_weight.gpu(), eps}, nullptr);
    Tensor q_rows = column_rows(qkv, tokens, width, 0, hq * head_dim, head_dim);
    Tensor k_rows = column_rows(qkv, tokens, width, hq * head_dim, hkv * head_dim, head_dim);
    Tensor v_rows = column_rows(qkv, tokens, width, (hq + hkv) * head_dim, hkv * head_dim, head_dim);
    Tensor query_ref(dt, {tokens, hq, head_dim}), key(dt, {tokens, hkv, head_dim});
    Tensor value = v_rows;
    value.shape = {tokens, hkv, head_dim};
    Tensor q_norm_rows(dt, {tokens * hq, head_dim}), k_norm_rows(dt, {tokens * hkv, head_dim});
    gpu::rms_norm(q_norm_rows.gpu(), q_rows.gpu(), q_weight.gpu(), eps, false, nullptr);
    gpu::rms_norm(k_norm_rows.gpu(), k_rows.gpu(), k_weight.gpu(), eps, false, nullptr);
    query_ref.bytes = q_norm_rows.bytes;
    key.bytes = k_norm_rows.bytes;
    gpu::rotary_embedding(positions.gpu(), query_ref.gpu(), key.gpu(), cos_sin.gpu(), nullptr);
    gpu::reshape_and_cache(key.gpu(), value.gpu(), key_cache_ref.gpu(), value_cache_ref.gpu(), slots.gpu(), nullptr);
    const std::string shape = std::string(name(dt)) + " Hq" + std::to_string(hq) + " Hkv" + std::to_string(hkv) +
                              " D" + std::to_string(head_dim);
    report("qkv_rope_cache q/k norm = rms_norm, rope, cache " + shape,
           query.same_bytes(query_ref) && key_cache.same_bytes(key_cache_ref) &&
               value_cache.same_bytes(value_cache_ref));
    positions.ints()[tokens - 1] = 0;  // the CPU contract refuses positions outside the table
    Tensor query_cpu(dt, {tokens, hq, head_dim}), key_cache_cpu = key_cache_ref, value_cache_cpu = value_cache_ref;
    gpu::qkv_rope_cache(query.gpu(), qkv.gpu(), positions.gpu(), cos_sin.gpu(), key_cache.gpu(), value_cache.gpu(),
                        slots.gpu(), {q_weight.gpu(), k_weight.gpu(), eps}, nullptr);
    cpu::qkv_rope_cache(query_cpu.cpu(), qkv.cpu(), positions.cpu(), cos_sin.cpu(), key_cache_cpu.cpu(),
                        value_cache_cpu.cpu(), slots.cpu(), {q_weight.cpu(), k_weight.cpu(), eps});
    expect_close("qkv_rope_cache q/k norm query vs CPU " + shape, query, query_cpu);
    expect_close("qkv_rope_cache q/k norm key cache vs CPU " + shape, key_cache, key_cache_cpu);
  }
}

void activation_cases(DType dt) {
  for (auto [tokens, width] : std::vector<std::pair<int, int>>{{3, 5632}, {2, 1001}, {7, 64}}) {
    Tensor x = Tensor(dt, {tokens, 2 * width}).randomize(3);
    Tensor out = Tensor(dt, {tokens, width}).poison(), expected(dt, {tokens, width});
    gpu::silu_and_mul(out.gpu(), x.gpu(), nullptr);
    cpu::silu_and_mul(expected.cpu(), x.cpu());
    expect_close(std::string("silu_and_mul ") + name(dt) + " I" + std::to_string(width), out, expected);
  }
}

void cache_cases(DType dt) {
  for (auto [hkv, head_dim, block_size] : std::vector<std::array<int, 3>>{{2, 128, 16}, {3, 20, 16}, {1, 64, 32}}) {
    const int num_blocks = 6, tokens = 9;
    Tensor key = Tensor(dt, {tokens, hkv, head_dim}).randomize(), value = Tensor(dt, {tokens, hkv, head_dim}).randomize();
    Tensor key_cache = Tensor(dt, {num_blocks, hkv, block_size, head_dim}).randomize();
    Tensor value_cache = Tensor(dt, {num_blocks, hkv, block_size, head_dim}).randomize();
    Tensor key_cache_ref = key_cache, value_cache_ref = value_cache;
    std::vector<int> slots(size_t(num_blocks * block_size));
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    Tensor slot_mapping(DType::kInt32, {tokens});
    for (int t = 0; t < tokens; ++t) slot_mapping.ints()[t] = t % 4 == 1 ? -1 : slots[size_t(t)];
    gpu::reshape_and_cache(key.gpu(), value.gpu(), key_cache.gpu(), value_cache.gpu(), slot_mapping.gpu(), nullptr);
    cpu::reshape_and_cache(key.cpu(), value.cpu(), key_cache_ref.cpu(), value_cache_ref.cpu(), slot_mapping.cpu());
    report(std::string("reshape_and_cache ") + name(dt) + " D" + std::to_string(head_dim),
           key_cache.same_bytes(key_cache_ref) && value_cache.same_bytes(value_cache_ref));
  }
  for (auto [hkv, block_size, head_dim] : std::vector<std::array<int, 3>>{{2, 16, 64}, {1, 1, 3}}) {
    Tensor kv_cache = Tensor(dt, {2, 2, 8, hkv, block_size, head_dim}).randomize();
    Tensor kv_cache_ref = kv_cache;
    Tensor copies(DType::kInt32, {3, 2});
    const int pairs[6] = {5, 0, 2, 7, 3, 1};
    std::memcpy(copies.ints(), pairs, sizeof(pairs));
    gpu::copy_blocks(kv_cache.gpu(), copies.gpu(), nullptr);
    cpu::copy_blocks(kv_cache_ref.cpu(), copies.cpu());
    report(std::string("copy_blocks ") + name(dt) + " D" + std::to_string(head_dim), kv_cache.same_bytes(kv_cache_ref));
  }
}

}  // namespace

// wait_for_flag: the kernel returns once the flag reaches its target (raised by another thread meanwhile,
// as the grammar thread does), and gives up after its timeout with flag[1] set, as the CPU op does.
void wait_for_flag_cases() {
  for (const bool raise : {true, false}) {
    Tensor gpu_flag(DType::kInt64, {2}), cpu_flag(DType::kInt64, {2});
    for (Tensor* flag : {&gpu_flag, &cpu_flag}) {
      auto* words = static_cast<int64_t*>(flag->data());
      words[0] = 0;
      words[1] = 0;
      std::thread raiser([words, raise] {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        if (raise) std::atomic_ref<int64_t>(words[0]).store(5);
      });
      if (flag == &gpu_flag) {
        gpu::wait_for_flag(flag->cpu(), 5, raise ? 10.0 : 0.005, nullptr);
      } else {
        cpu::wait_for_flag(flag->cpu(), 5, raise ? 10.0 : 0.005);
      }
      raiser.join();
    }
    const auto* g = static_cast<int64_t*>(gpu_flag.data());
    const auto* c = static_cast<int64_t*>(cpu_flag.data());
    const bool expected = raise ? g[1] == 0 && c[1] == 0 : g[1] == 1 && c[1] == 1 && g[0] == 0;
    report(std::string("wait_for_flag ") + (raise ? "raised" : "timed out"), expected && g[1] == c[1]);
  }
}

void elementwise_cases() {
  wait_for_flag_cases();
  for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    norm_cases(dt);
    torch_order_norm_cases(dt);
    rotary_cases(dt);
    qkv_rope_cache_cases(dt);
    qkv_rope_cache_norm_cases(dt);
    activation_cases(dt);
    cache_cases(dt);
  }
}

}  // namespace emu_check
