// GrammarPool: a step's grammar work for many matchers at once, on threads of its own.
//
// A step's rows each consume their drawn token, then write their next mask into their row of a bitmask;
// rows are independent, so the pool hands them out one at a time to its threads (the calling thread among
// them, see ops::ThreadPool). It is a pool of its own, not the CPU ops' one: its work runs beside the
// engine's thread, which may be inside an op. Once every mask is in, `run` raises a counter in host memory
// to the job's number (a release store): a device polling that counter (ops.wait_for_flag) then copies
// masks that are in.
//
// On an H200 host (16 Intel cores), 64 rows of SmolLM2's JSON: 0.72-0.75 ms a step on one thread, 0.59-0.62
// on two, 0.40-0.41 on four, 0.51 on eight (bench/results/h200/session39.md); hence at most four threads.
#pragma once

#include <atomic>
#include <cstdint>
#include <span>
#include <vector>

#include "grammar/llguidance_api.h"
#include "ops/thread_pool.h"

namespace pagedserve::grammar {

// Raises a job's counter in host memory to `number` (a release store: the masks written before it are seen by
// whoever reads the counter with acquire, a device polling it included). A null flag is none.
inline void raise_flag(int64_t* flag, int64_t number) {
  if (flag != nullptr) std::atomic_ref<int64_t>(*flag).store(number, std::memory_order_release);
}

class GrammarPool {
 public:
  static constexpr int kMaxThreads = 4;

  // What became of a row's matcher (run's result): it refused its token (and is in error), it goes on,
  // or it stopped (it took its token, and only EOS may follow).
  enum Outcome : uint8_t { kRefused = 0, kLive = 1, kStopped = 2 };

  explicit GrammarPool(int num_threads);
  int num_threads() const { return pool_.num_threads(); }

  // For each i: when `tokens` is not empty, matchers[i] consumes tokens[i]; then matchers[i] writes its
  // next mask into row rows[i] of `bitmask` (row_words uint32 words a row, num_rows rows). Each matcher
  // appears once. Returns each row's Outcome (without tokens: kLive or kStopped), found on the pool's
  // threads so that the caller need not ask each matcher. When `flag` is not null, *flag becomes `number`
  // after the last mask is written, even where a row throws (the first error is rethrown after).
  std::vector<uint8_t> run(std::span<Matcher* const> matchers, std::span<const int64_t> tokens,
                           std::span<const int64_t> rows, uint32_t* bitmask, int64_t num_rows, int64_t row_words,
                           int64_t* flag = nullptr, int64_t number = 0);

 private:
  ops::ThreadPool pool_;
};

}  // namespace pagedserve::grammar
