// GrammarWorker: the grammar thread (python/pagedserve/engine/grammar_thread.py drives it).
//
// A thread of its own runs jobs in the order they are submitted. A job is one step of grammar rows: it
// waits until the step's drawn ids are in host memory (on CUDA, the event recorded after their copy),
// then has the GrammarPool consume each row's id and fill the next masks, which raises the job's counter
// in host memory (a device polling it then copies the masks). The thread never runs Python, so it never
// waits for the GIL, and the engine's thread, which runs Python all the time a step is host-bound, never
// hands the GIL over to it: a Python grammar thread took it three times a job (the ids in, the pool's
// result, the job's end), and each hand-over cost the engine's thread a wait of up to the switch interval
// and two wake-ups (JSON at 64 rows on an H200 host: 92-97 % of unconstrained, session 39).
//
// The caller keeps each job's matchers, ids and bitmask alive and untouched until wait() returns the job.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "grammar/grammar_pool.h"

namespace pagedserve::grammar {

// A step's (row, matcher) pairs, made once and shared by the jobs of a steady batch.
struct MatcherRows {
  std::vector<Matcher*> matchers;
  std::vector<int64_t> rows;  // matchers[i]'s row: of the drawn ids it consumes and of the bitmask it fills
};

class GrammarWorker {
 public:
  // Blocks until a job's ids are in host memory, given the job's `ready` (0: they are already) and `device`.
  using WaitForIds = std::function<void(uintptr_t ready, int device)>;

  struct Job {
    int64_t number = 0;  // 1, 2, ... in submission order: *flag becomes it once the masks are in
    std::shared_ptr<const MatcherRows> pairs;
    const int32_t* ids = nullptr;  // the step's drawn ids, one a row
    int64_t num_ids = 0;
    uintptr_t ready = 0;  // handed to WaitForIds, with `device`
    int device = 0;
    uint32_t* bitmask = nullptr;
    int64_t num_rows = 0;
    int64_t row_words = 0;
    int64_t* flag = nullptr;  // may be null
  };

  struct Result {
    std::vector<uint8_t> outcomes;  // GrammarPool::Outcome per pair
    double seconds = 0;             // consuming and filling, not waiting for the ids
    std::string error;              // empty unless the job failed (its flag is raised all the same)
  };

  // `pool` must outlive the worker; the thread starts with the first job.
  GrammarWorker(GrammarPool& pool, WaitForIds wait_for_ids);
  ~GrammarWorker() { close(); }
  GrammarWorker(const GrammarWorker&) = delete;
  GrammarWorker& operator=(const GrammarWorker&) = delete;

  // Queues a job; its number must follow the last one's. Throws std::invalid_argument otherwise.
  void submit(Job job);
  // Blocks until job `number` (submitted, not yet waited for) has run, and hands over its result.
  Result wait(int64_t number);
  // Runs the queued jobs and joins the thread; submit() throws after. Results not waited for stay.
  void close();

 private:
  void loop();
  Result run(const Job& job);

  GrammarPool& pool_;
  WaitForIds wait_for_ids_;
  std::mutex mutex_;
  std::condition_variable queued_;  // a job was queued, or the worker stops
  std::condition_variable ran_;     // a job ran
  std::deque<Job> queue_;
  std::deque<std::pair<int64_t, Result>> results_;  // ran, not yet waited for, in order
  int64_t submitted_ = 0;
  int64_t finished_ = 0;  // the last job run (they run in order)
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace pagedserve::grammar
