#include "grammar/grammar_worker.h"

#include <algorithm>
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
  ran_.wait(lock, [&] { return finished_ >= number; });  // jobs run in order
  auto it = std::find_if(results_.begin(), results_.end(), [&](const auto& done) { return done.first == number; });
  if (it == results_.end()) {
    throw std::invalid_argument("GrammarWorker.wait: job " + std::to_string(number) + " waited for already");
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
    lock.unlock();
    Result result = run(job);
    lock.lock();
    finished_ = job.number;
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
  // No device waits in vain (the pool raised it already if the job got that far).
  if (!result.error.empty()) raise_flag(job.flag, job.number);
  return result;
}

}  // namespace pagedserve::grammar
