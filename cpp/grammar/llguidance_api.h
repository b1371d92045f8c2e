// llguidance's C API, loaded at run time from the library its Python wheel ships.
//
// The wheel's extension (llguidance/_lib.abi3.so) exports llguidance's C API beside its Python one. The
// engine's grammar work calls it from C++ threads, which hold no GIL: a JSON step's 64 masks took 0.72 ms on
// one thread of an H200 host (Intel, 11 us a row with the row's accept) and 0.40 ms on four
// (bench/results/h200/session39.md), where llguidance's own Python executor got slower with threads
// (engine/grammar_backends.py). The library is loaded, not linked: the extension builds without llguidance,
// and uses whichever the environment has, from 1.7 (the first with llg_new_tokenizer_v2 and several EOS ids).
//
// The declarations follow llguidance's llguidance.h for the calls used here. Of its structs only the leading
// fields that every version since 1.7 shares are written; a constraint's settings are filled by the library
// itself (llg_constraint_init_set_defaults) into a buffer larger than any version's struct.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace pagedserve::grammar {

struct LlgApi;  // the library's entry points (llguidance_api.cc)

// A tokenizer as llguidance sees it: each token's bytes, read from a Hugging Face tokenizer.json by
// llguidance's own parser (special tokens marked so that text never matches them), the EOS ids, and how
// to tokenize bytes. llguidance tokenizes where a grammar forces bytes (a JSON key the schema fixes): it
// then allows the forced text's own first tokens, not every token that spells a prefix of it. Without
// `tokenize`, it tokenizes greedily, which allows more than the model's tokenizer would (after `{"` under
// a schema whose first key is "name": "n", "na" and "nam" too); with the model's tokenizer the masks equal
// llguidance's Python matcher's (tests_py/test_llguidance_matcher.py). A grammar forces few distinct texts
// (its keys, its separators), asked for again and again: their tokens are kept, so that `tokenize` (Python,
// under the GIL) runs once a text. Asking Python each time took the GIL from the pool's threads every
// compact JSON step: the engine's own step went from 1.13-1.16 to 1.62-1.68 ms on an H200 host
// (bench/results/h200/session39.md).
class Tokenizer {
 public:
  // Bytes to token ids, any bytes (not only UTF-8); called from any thread, also several at once.
  using TokenizeFn = std::function<std::vector<uint32_t>(std::string_view bytes)>;

  // std::invalid_argument when the library or the json is unusable. `library` is the path of the shared
  // object that exports the C API; `vocab_size` may exceed the json's (padded rows).
  Tokenizer(const std::string& library, const std::string& tokenizer_json, uint32_t vocab_size,
            const std::vector<uint32_t>& eos_ids, TokenizeFn tokenize = nullptr);
  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  uint32_t vocab_size() const { return vocab_size_; }
  const std::vector<uint32_t>& eos_ids() const { return eos_ids_; }
  // The bytes the tokens stand for (special tokens included), as llguidance reads them.
  std::string decode(const std::vector<uint32_t>& ids) const;
  const LlgApi& api() const { return *api_; }
  void* handle() const { return handle_; }

 private:
  static size_t tokenize_into(const void* self, const uint8_t* bytes, size_t length, uint32_t* out,
                              size_t capacity);

  const LlgApi* api_;
  void* handle_ = nullptr;
  uint32_t vocab_size_;
  std::vector<uint32_t> eos_ids_;
  TokenizeFn tokenize_;
  static constexpr size_t kMaxKept = 1 << 16;  // texts whose tokens are kept; all dropped once past it
  mutable std::mutex kept_mutex_;
  mutable std::unordered_map<std::string, std::vector<uint32_t>> kept_;  // guarded by kept_mutex_
};

// One sample's matcher: move-only, freed with its owner. Not thread-safe: one thread at a time (the grammar
// pool gives each matcher of a job to one worker).
class Matcher {
 public:
  // A matcher for an llguidance grammar (the "llguidance" constraint type: the text LLMatcher's
  // grammar_from_* helpers write). A grammar that does not compile gives a matcher in error (error()).
  Matcher(std::shared_ptr<const Tokenizer> tokenizer, const std::string& grammar);
  ~Matcher();
  Matcher(Matcher&& other) noexcept;
  Matcher& operator=(Matcher&&) = delete;
  Matcher(const Matcher&) = delete;

  Matcher clone() const;
  // Advances by `token`; false (and the matcher is in error from then on) when the grammar refuses it. A
  // stopped matcher takes an EOS id without advancing, as llguidance's Python matcher does.
  bool consume(uint32_t token);
  bool accepts(uint32_t token);  // whether consume(token) would succeed; the state is unchanged
  bool is_stopped() const;       // stopped (EOS consumed, or nothing may follow) or in error
  bool is_error() const;
  std::optional<std::string> error() const;
  // Writes the allowed next tokens into `words` (ceil(vocab / 32) uint32 words, bit t % 32 of word t / 32);
  // a stopped matcher, or one whose mask fails, allows its EOS ids alone (as llguidance's Python executor).
  void fill(uint32_t* words, size_t num_words);
  size_t mask_words() const { return (tokenizer_->vocab_size() + 31) / 32; }

 private:
  Matcher(std::shared_ptr<const Tokenizer> tokenizer, void* handle);
  void fill_eos(uint32_t* words, size_t num_words) const;

  std::shared_ptr<const Tokenizer> tokenizer_;
  void* handle_;
};

}  // namespace pagedserve::grammar
