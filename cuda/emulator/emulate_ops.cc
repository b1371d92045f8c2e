// Runs every CUDA op, compiled for the host by the emulator, against the CPU
// reference ops (cpp/ops) on the same random inputs. Exit status 1 on any
// mismatch. Attention outputs must stay within the GPU tests' tolerances;
// the elementwise ops and cache writers must agree to the same tolerances (most
// are bit-identical). Cache slots no sequence may read hold NaN, outputs start
// as NaN, and shared memory is NaN before each CTA, so reading the wrong
// element shows up as a failure; build with ASan to catch out-of-bounds reads.
#include <algorithm>
#include <array>
#include <cstdio>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_ops.h"
#include "ops/ops.h"

using pagedserve::ops::Device;
using pagedserve::ops::DType;
using pagedserve::ops::TensorView;

// The runtime calls the host code makes around its launches.
extern "C" {
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr, int) {
  *value = 132;  // SMs of an H100 SXM
  return cudaSuccess;
}
cudaError_t cudaGetLastError() { return cudaSuccess; }
const char* cudaGetErrorString(cudaError_t) { return "emulated"; }
}

namespace {

std::mt19937_64 rng(20261122);
float randn() { return std::normal_distribution<float>()(rng); }
int randint(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

const char* name(DType t) { return t == DType::kFloat32 ? "f32" : t == DType::kFloat16 ? "f16" : "bf16"; }
double tolerance(DType t) { return t == DType::kFloat32 ? 1e-5 : t == DType::kFloat16 ? 2e-3 : 1e-2; }

// A contiguous host buffer, viewed as a CPU or an (emulated) CUDA tensor. Sized
// exactly, so AddressSanitizer flags any overrun; malloc aligns it to 16 bytes.
struct Tensor {
  Tensor(DType t, std::vector<int64_t> s) : dtype(t), shape(std::move(s)), bytes(size_t(numel() * pagedserve::ops::element_size(t))) {}
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  void* data() { return bytes.data(); }
  int32_t* ints() { return static_cast<int32_t*>(data()); }
  TensorView view(Device device) {
    TensorView v;
    v.data = data();
    v.dtype = dtype;
    v.device = device;
    v.ndim = static_cast<int>(shape.size());
    int64_t stride = 1;
    for (int d = v.ndim - 1; d >= 0; --d) {
      v.shape[size_t(d)] = shape[size_t(d)];
      v.strides[size_t(d)] = stride;
      stride *= shape[size_t(d)];
    }
    return v;
  }
  TensorView gpu() { return view(Device::kCUDA); }
  TensorView cpu() { return view(Device::kCPU); }
  float get(int64_t i) {
    if (dtype == DType::kFloat32) return static_cast<float*>(data())[i];
    const uint16_t bits = static_cast<uint16_t*>(data())[i];
    if (dtype == DType::kBFloat16) {
      __nv_bfloat16 v;
      std::memcpy(&v, &bits, 2);
      return __bfloat162float(v);
    }
    __half v;
    std::memcpy(&v, &bits, 2);
    return __half2float(v);
  }
  void set(int64_t i, float x) {
    if (dtype == DType::kFloat32) {
      static_cast<float*>(data())[i] = x;
    } else if (dtype == DType::kBFloat16) {
      const __nv_bfloat16 v = __float2bfloat16_rn(x);
      std::memcpy(static_cast<uint16_t*>(data()) + i, &v, 2);
    } else {
      const __half v = __float2half_rn(x);
      std::memcpy(static_cast<uint16_t*>(data()) + i, &v, 2);
    }
  }
  Tensor& randomize(float scale = 1.f) {
    for (int64_t i = 0; i < numel(); ++i) set(i, scale * randn());
    return *this;
  }
  Tensor& poison() {
    for (int64_t i = 0; i < numel(); ++i) set(i, NAN);
    return *this;
  }
  bool same_bytes(const Tensor& other) const { return bytes == other.bytes; }

  DType dtype;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;
};

double relative_error(Tensor& actual, Tensor& expected, int64_t count) {
  double diff = 0, norm = 0;
  for (int64_t i = 0; i < count; ++i) {
    const double a = actual.get(i), e = expected.get(i);
    if (!std::isfinite(a)) return INFINITY;
    diff += (a - e) * (a - e);
    norm += e * e;
  }
  return std::sqrt(diff / std::max(norm, 1e-300));
}

int failures = 0;
void report(const std::string& what, bool ok, double error = 0) {
  failures += !ok;
  std::printf("%s %-78s %.3g\n", ok ? "ok  " : "FAIL", what.c_str(), error);
  std::fflush(stdout);
}
void expect_close(const std::string& what, Tensor& actual, Tensor& expected) {
  const double error = relative_error(actual, expected, expected.numel());
  report(what, error < tolerance(expected.dtype), error);
}

// ---------------------------------------------------------------------------
namespace gpu = pagedserve::cuda;
namespace cpu = pagedserve::ops;

void norm_cases(DType dt) {
  for (auto [rows, hidden] : std::vector<std::pair<int, int>>{{3, 2048}, {5, 1001}, {2, 16384}, {17, 128}, {2, 8}}) {
    const std::string shape = std::string(name(dt)) + " " + std::to_string(rows) + "x" + std::to_string(hidden);
    Tensor x = Tensor(dt, {rows, hidden}).randomize(3), weight = Tensor(dt, {hidden}).randomize();
    Tensor out = Tensor(dt, {rows, hidden}).poison(), expected(dt, {rows, hidden});
    gpu::rms_norm(out.gpu(), x.gpu(), weight.gpu(), 1e-6f, nullptr);
    cpu::rms_norm(expected.cpu(), x.cpu(), weight.cpu(), 1e-6f);
    expect_close("rms_norm " + shape, out, expected);

    Tensor residual = Tensor(dt, {rows, hidden}).randomize(2);
    Tensor x_ref = x, residual_ref = residual;
    gpu::fused_add_rms_norm(x.gpu(), residual.gpu(), weight.gpu(), 1e-6f, nullptr);
    cpu::fused_add_rms_norm(x_ref.cpu(), residual_ref.cpu(), weight.cpu(), 1e-6f);
    expect_close("fused_add_rms_norm x " + shape, x, x_ref);
    expect_close("fused_add_rms_norm residual " + shape, residual, residual_ref);
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

// ---------------------------------------------------------------------------
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
    for (int i = 0; i < max_blocks; ++i) table[i] = i < (r.seq_len + B - 1) / B ? free_blocks[next_block++] : pad_block;
    starts.ints()[s + 1] = starts.ints()[s] + r.q_len;
    lens.ints()[s] = r.seq_len;
    for (int p = 0; p < r.seq_len; ++p) {  // only readable slots get values; the rest stay NaN
      for (int h = 0; h < c.num_kv_heads; ++h) {
        for (int d = 0; d < D; ++d) {
          const int64_t offset = ((int64_t{table[p / B]} * c.num_kv_heads + h) * B + p % B) * D + d;
          key_cache.set(offset, randn());
          value_cache.set(offset, randn());
        }
      }
    }
  }
  Tensor query = Tensor(c.dtype, {num_tokens + c.padding_tokens, hq, D}).randomize();
  Tensor out = Tensor(c.dtype, {num_tokens + c.padding_tokens, hq, D}).poison();
  Tensor query_ref(c.dtype, {num_tokens, hq, D}), out_ref(c.dtype, {num_tokens, hq, D});
  std::memcpy(query_ref.data(), query.data(), query_ref.bytes.size());
  const float scale = 1.f / std::sqrt(float(D));
  const int max_seq_len = c.max_seq_len ? c.max_seq_len : max_s;
  const size_t workspace_bytes =
      gpu::paged_attention_workspace_bytes(c.workspace_rows ? c.workspace_rows : num_decodes, hq, D, max_seq_len);
  Tensor workspace = Tensor(DType::kFloat32, {std::max<int64_t>(1, int64_t(workspace_bytes + 3) / 4)}).poison();

  gpu::paged_attention(out.gpu(), query.gpu(), key_cache.gpu(), value_cache.gpu(), tables.gpu(), starts.gpu(),
                       lens.gpu(), scale, max_q, max_seq_len, num_decodes, workspace.gpu(), nullptr);
  cpu::paged_attention(out_ref.cpu(), query_ref.cpu(), key_cache.cpu(), value_cache.cpu(), tables.cpu(), starts.cpu(),
                       lens.cpu(), scale);

  std::string what = std::string("paged_attention ") + name(c.dtype) + " D" + std::to_string(D) + " B" +
                     std::to_string(B) + " G" + std::to_string(c.group) + " rows";
  for (const Row& r : c.rows) what += " " + std::to_string(r.q_len) + "/" + std::to_string(r.seq_len);
  if (c.max_seq_len) what += " max_seq_len " + std::to_string(c.max_seq_len);
  if (c.workspace_rows) what += " workspace x" + std::to_string(c.workspace_rows);
  const double error = relative_error(out, out_ref, out_ref.numel());
  report(what, error < tolerance(c.dtype), error);
  if (c.padding_tokens) {
    bool untouched = true;
    for (int64_t i = out_ref.numel(); i < out.numel(); ++i) untouched &= std::isnan(out.get(i));
    report("  padding tokens left unwritten", untouched);
  }
}

void attention_cases() {
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
}

}  // namespace

int main(int argc, char** argv) {
  const std::string only = argc > 1 ? argv[1] : "";
  cpu::set_num_threads(1);
  if (only.empty() || only == "elementwise") {
    for (DType dt : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      norm_cases(dt);
      rotary_cases(dt);
      activation_cases(dt);
      cache_cases(dt);
    }
  }
  if (only.empty() || only == "attention") attention_cases();
  std::printf("%d failures (%lld launches, %lld CTAs emulated)\n", failures, emu::num_launches, emu::num_ctas);
  return failures == 0 ? 0 : 1;
}
