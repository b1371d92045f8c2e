// Cost of one scheduler step (schedule + update) with N running decoding
// sequences, in C++. Prints one JSON object per N on stdout.
//
//   scheduler_step_bench [N ...]     (default: 64 256 1024)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "scheduler.h"

namespace {

using pagedserve::Scheduler;
using pagedserve::SchedulerConfig;
using pagedserve::StopParams;
using pagedserve::TokenId;

constexpr int32_t kPromptLen = 128;
constexpr int32_t kBlockSize = 16;
constexpr int kTimedSteps = 512;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void bench(int32_t num_seqs) {
  SchedulerConfig config;
  config.block_size = kBlockSize;
  config.num_blocks = num_seqs * ((kPromptLen + kTimedSteps + 64) / kBlockSize + 2);
  config.max_num_seqs = num_seqs;
  config.max_num_batched_tokens = std::max(num_seqs, 8192);
  config.max_model_len = 4096;
  config.eos_token_ids = {2};
  Scheduler scheduler(config);
  StopParams params;
  params.max_tokens = 100000;
  for (int32_t i = 0; i < num_seqs; ++i) {
    std::vector<TokenId> prompt(kPromptLen);
    for (int32_t t = 0; t < kPromptLen; ++t) prompt[static_cast<size_t>(t)] = 1000 + i * 7 + t;  // distinct prompts
    scheduler.add_sequence(prompt, params);
  }
  std::vector<TokenId> sampled;
  while (scheduler.num_waiting() > 0 || scheduler.stats().step_decode_tokens < num_seqs) {  // prefill everyone
    auto out = scheduler.schedule();
    sampled.assign(static_cast<size_t>(out->total_samples), 5);
    scheduler.update(sampled);
  }
  std::vector<double> schedule_us, update_us;
  for (int step = 0; step < kTimedSteps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    auto out = scheduler.schedule();
    const auto t1 = std::chrono::steady_clock::now();
    sampled.assign(static_cast<size_t>(out->total_samples), 5);
    scheduler.update(sampled);
    const auto t2 = std::chrono::steady_clock::now();
    if (out->num_decodes != num_seqs) {
      std::fprintf(stderr, "expected %d decodes, got %d\n", num_seqs, out->num_decodes);
      std::exit(1);
    }
    schedule_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    update_us.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
  }
  std::vector<double> total(schedule_us.size());
  for (size_t i = 0; i < total.size(); ++i) total[i] = schedule_us[i] + update_us[i];
  std::printf("{\"num_seqs\": %d, \"steps\": %d, \"schedule_us\": %.3f, \"update_us\": %.3f, \"step_us\": %.3f}\n",
              num_seqs, kTimedSteps, median(schedule_us), median(update_us), median(total));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int32_t> sizes;
  for (int i = 1; i < argc; ++i) sizes.push_back(static_cast<int32_t>(std::atoi(argv[i])));
  if (sizes.empty()) sizes = {64, 256, 1024};
  for (int32_t n : sizes) bench(n);
  return 0;
}
