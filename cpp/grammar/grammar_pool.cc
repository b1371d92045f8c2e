#include "grammar/grammar_pool.h"

#include <algorithm>

#include "check.h"

namespace pagedserve::grammar {

GrammarPool::GrammarPool(int num_threads) : pool_(std::clamp(num_threads, 1, kMaxThreads)) {}

std::vector<uint8_t> GrammarPool::run(std::span<Matcher* const> matchers, std::span<const int64_t> tokens,
                                      std::span<const int64_t> rows, uint32_t* bitmask, int64_t num_rows,
                                      int64_t row_words, int64_t* flag, int64_t number) {
  const auto n = static_cast<int64_t>(matchers.size());
  std::vector<uint8_t> outcomes(matchers.size(), kRefused);
  try {
    PS_CHECK(rows.size() == matchers.size(), rows.size(), " rows for ", n, " matchers");
    PS_CHECK(tokens.empty() || tokens.size() == matchers.size(), tokens.size(), " tokens for ", n, " matchers");
    PS_CHECK(bitmask != nullptr && row_words > 0, "no bitmask");
    for (int64_t row : rows) PS_CHECK(row >= 0 && row < num_rows, "row ", row, " outside a bitmask of ", num_rows);
    pool_.run(n, [&](int64_t i, int) {
      Matcher& matcher = *matchers[i];
      bool took = true;
      if (!tokens.empty()) {
        PS_CHECK(tokens[i] >= 0 && tokens[i] <= UINT32_MAX, "token ", tokens[i]);
        took = matcher.consume(static_cast<uint32_t>(tokens[i]));
      }
      matcher.fill(bitmask + rows[i] * row_words, static_cast<size_t>(row_words));
      outcomes[i] = !took ? kRefused : matcher.is_stopped() ? kStopped : kLive;
    });
  } catch (...) {
    raise_flag(flag, number);
    throw;
  }
  raise_flag(flag, number);
  return outcomes;
}

}  // namespace pagedserve::grammar
