#include "grammar/grammar_worker.h"

#include <atomic>
#include <chrono>
#include <exception>
#include <stdexcept>

#include "check.h"

namespace pagedserve::grammar {

GrammarWorker::GrammarWorker(GrammarPool& pool, WaitForIds wait_for_ids)
    : pool_(pool), wait_for_ids_(std::move(wait_for_ids)) {}

void GrammarWorker::close() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  queued_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void GrammarWorker::submit(Job job) {
  if (job.pairs == nullptr) throw std::invalid_argument("GrammarWorker.submit: no pairs");
  {
    std::lock_guard lock(mutex_);
    if (stopping_) throw std::invalid_argument("GrammarWorker.submit: the worker is closed");
    if (job.number != submitted_ + 1) {
      throw std::invalid_argument("GrammarWorker.submit: job " + std::to_string(job.number) + " after job " +
                                  std::to_string(submitted_));
    }
    submitted_ = job.number;
    queue_.push_back(std::move(job));
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  }
  queued_.notify_one();
}

GrammarWorker::Result GrammarWorker::wait(int64_t number) {
  std::unique_lock lock(mutex_);
  if (number < 1 || number > submitted_) {
    throw std::invalid_argument("GrammarWorker.wait: job " + std::to_string(number) + " was not submitted");
  }
  auto found = [&] {
    for (auto it = results_.begin(); it != results_.end(); ++it) {
      if (it->first == number) return it;
    }
    return results_.end();
  };
  auto it = found();
  while (it == results_.end()) {
    // Not ran yet, or waited for already: the first waits, the second would wait forever.
    const bool pending = (!queue_.empty() && queue_.front().number <= number) || running_ == number;
    if (!pending) {
      throw std::invalid_argument("GrammarWorker.wait: job " + std::to_string(number) + " waited for already");
    }
    ran_.wait(lock);
    it = found();
  }
  Result result = std::move(it->second);
  results_.erase(it);
  return result;
}

void GrammarWorker::loop() {
  std::unique_lock lock(mutex_);
  for (;;) {
    queued_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, nothing left
    Job job = std::move(queue_.front());
    queue_.pop_front();
    running_ = job.number;
    lock.unlock();
    Result result = run(job);
    lock.lock();
    running_ = 0;
    results_.emplace_back(job.number, std::move(result));
    ran_.notify_all();
  }
}

GrammarWorker::Result GrammarWorker::run(const Job& job) {
  Result result;
  try {
    wait_for_ids_(job.ready, job.device);
    const auto start = std::chrono::steady_clock::now();
    const MatcherRows& pairs = *job.pairs;
    std::vector<int64_t> tokens(pairs.rows.size());
    for (size_t i = 0; i < tokens.size(); ++i) {
      const int64_t row = pairs.rows[i];
      PS_CHECK(row >= 0 && row < job.num_ids, "row ", row, " of a draw of ", job.num_ids, " ids");
      tokens[i] = job.ids[row];
    }
    result.outcomes = pool_.run(pairs.matchers, tokens, pairs.rows, job.bitmask, job.num_rows, job.row_words,
                                job.flag, job.number);
    result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  } catch (const std::exception& err) {
    result.error = err.what();
  } catch (...) {
    result.error = "unknown error";
  }
  if (!result.error.empty() && job.flag != nullptr) {  // no device waits in vain (the pool raised it already
    std::atomic_ref<int64_t>(*job.flag).store(job.number, std::memory_order_release);  // if it got that far)
  }
  return result;
}

}  // namespace pagedserve::grammar
