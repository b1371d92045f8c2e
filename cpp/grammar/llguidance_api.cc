#include "grammar/llguidance_api.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>

#include "check.h"

namespace pagedserve::grammar {

// The leading fields of LlgTokenizerInitV2 (llguidance.h); the library reads struct_size bytes of it.
struct TokenizerInitV2 {
  size_t struct_size;
  uint32_t vocab_size;
  uint32_t tok_eos;
  const uint32_t* token_lens;
  const uint8_t* token_bytes;
  const char* tokenizer_json;
  bool tokenize_assumes_string;
  size_t (*tokenize_fn)(const void*, const uint8_t*, size_t, uint32_t*, size_t);
  bool use_approximate_greedy_tokenize_fn;
  const void* tokenize_user_data;
  const char* const* slices;
  const uint32_t* tok_eos_extra;
  uint32_t tok_eos_extra_count;
};

// The first fields of LlgConstraintInit, the same from 1.7 to 1.9: the rest (parser limits) keep the
// library's defaults.
struct ConstraintInitHead {
  const void* tokenizer;
  uint32_t log_buffer_level;
  uint32_t log_stderr_level;
};
constexpr size_t kConstraintInitBytes = 4096;  // LlgConstraintInit is ~100 bytes in 1.9

struct LlgApi {
  void* (*new_tokenizer_v2)(const TokenizerInitV2*, char* error, size_t error_len);
  void (*free_tokenizer)(void*);
  size_t (*decode_tokens)(const void*, const uint32_t*, size_t, char*, size_t, uint32_t flags);
  void (*constraint_init_set_defaults)(void* init, const void* tokenizer);
  void* (*new_matcher)(const void* init, const char* constraint_type, const char* data);
  void* (*clone_matcher)(const void*);
  void (*free_matcher)(void*);
  int32_t (*consume_token)(void*, uint32_t);
  int32_t (*validate_tokens)(void*, const uint32_t*, size_t);
  int32_t (*compute_mask_into)(void*, uint32_t*, size_t);
  size_t (*mask_byte_size)(const void*);
  const char* (*get_error)(void*);
  bool (*is_error)(const void*);
  bool (*is_stopped)(const void*);
};

namespace {

constexpr uint32_t kDecodeIncludeSpecial = 1;  // LLG_DECODE_INCLUDE_SPECIAL

template <typename Fn>
void resolve(void* library, const char* name, Fn& fn, const std::string& path) {
  void* symbol = dlsym(library, name);
  if (symbol == nullptr) {
    throw std::invalid_argument("llguidance's library " + path + " does not export " + name +
                                " (its C API; llguidance >= 1.7 does)");
  }
  fn = reinterpret_cast<Fn>(symbol);
}

// One LlgApi per library path, loaded once and never unloaded (matchers may outlive any one owner).
const LlgApi* load(const std::string& path) {
  static std::mutex mutex;
  static std::map<std::string, std::unique_ptr<LlgApi>> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  auto& api = loaded[path];
  if (api) return api.get();
  void* library = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = dlerror();
    loaded.erase(path);
    throw std::invalid_argument("cannot load llguidance's library " + path + ": " + (why ? why : "?"));
  }
  auto fresh = std::make_unique<LlgApi>();
  try {
    resolve(library, "llg_new_tokenizer_v2", fresh->new_tokenizer_v2, path);
    resolve(library, "llg_free_tokenizer", fresh->free_tokenizer, path);
    resolve(library, "llg_decode_tokens", fresh->decode_tokens, path);
    resolve(library, "llg_constraint_init_set_defaults", fresh->constraint_init_set_defaults, path);
    resolve(library, "llg_new_matcher", fresh->new_matcher, path);
    resolve(library, "llg_clone_matcher", fresh->clone_matcher, path);
    resolve(library, "llg_free_matcher", fresh->free_matcher, path);
    resolve(library, "llg_matcher_consume_token", fresh->consume_token, path);
    resolve(library, "llg_matcher_validate_tokens", fresh->validate_tokens, path);
    resolve(library, "llg_matcher_compute_mask_into", fresh->compute_mask_into, path);
    resolve(library, "llg_matcher_get_mask_byte_size", fresh->mask_byte_size, path);
    resolve(library, "llg_matcher_get_error", fresh->get_error, path);
    resolve(library, "llg_matcher_is_error", fresh->is_error, path);
    resolve(library, "llg_matcher_is_stopped", fresh->is_stopped, path);
  } catch (...) {
    loaded.erase(path);
    throw;
  }
  api = std::move(fresh);
  return api.get();
}

}  // namespace

Tokenizer::Tokenizer(const std::string& library, const std::string& tokenizer_json, uint32_t vocab_size,
                     const std::vector<uint32_t>& eos_ids, TokenizeFn tokenize)
    : api_(load(library)), vocab_size_(vocab_size), eos_ids_(eos_ids), tokenize_(std::move(tokenize)) {
  if (eos_ids.empty()) throw std::invalid_argument("llguidance needs at least one EOS token id");
  TokenizerInitV2 init{};
  init.struct_size = sizeof(init);
  init.vocab_size = vocab_size;
  init.tok_eos = eos_ids[0];
  init.tokenizer_json = tokenizer_json.c_str();
  if (tokenize_) {
    init.tokenize_fn = &Tokenizer::tokenize_into;
    init.tokenize_user_data = this;  // a Tokenizer does not move
  } else {
    init.use_approximate_greedy_tokenize_fn = true;
  }
  init.tok_eos_extra = eos_ids.size() > 1 ? eos_ids.data() + 1 : nullptr;
  init.tok_eos_extra_count = static_cast<uint32_t>(eos_ids.size() - 1);
  char error[1024] = {};
  handle_ = api_->new_tokenizer_v2(&init, error, sizeof(error));
  if (handle_ == nullptr) throw std::invalid_argument(std::string("llguidance's tokenizer: ") + error);
}

Tokenizer::~Tokenizer() { api_->free_tokenizer(handle_); }

// llguidance's LlgTokenizeFn: writes at most `capacity` ids, returns how many there are, from the kept
// tokens of the text where it has them. It cannot throw into the library: a failing tokenize gives no
// tokens (llguidance then allows no forced token).
size_t Tokenizer::tokenize_into(const void* self, const uint8_t* bytes, size_t length, uint32_t* out,
                                size_t capacity) {
  const auto& tokenizer = *static_cast<const Tokenizer*>(self);
  std::string text(reinterpret_cast<const char*>(bytes), length);
  std::vector<uint32_t> ids;
  {
    std::lock_guard<std::mutex> lock(tokenizer.kept_mutex_);
    auto kept = tokenizer.kept_.find(text);
    if (kept != tokenizer.kept_.end()) ids = kept->second;
  }
  if (ids.empty() && length > 0) {
    try {
      ids = tokenizer.tokenize_(text);
    } catch (...) {
      return 0;
    }
    std::lock_guard<std::mutex> lock(tokenizer.kept_mutex_);
    if (tokenizer.kept_.size() >= kMaxKept) tokenizer.kept_.clear();
    tokenizer.kept_.emplace(std::move(text), ids);
  }
  std::memcpy(out, ids.data(), std::min(ids.size(), capacity) * sizeof(uint32_t));
  return ids.size();
}

std::string Tokenizer::decode(const std::vector<uint32_t>& ids) const {
  // The library returns the bytes' length plus one, and writes a NUL after them.
  size_t length = api_->decode_tokens(handle_, ids.data(), ids.size(), nullptr, 0, kDecodeIncludeSpecial) - 1;
  std::string out(length + 1, '\0');
  api_->decode_tokens(handle_, ids.data(), ids.size(), out.data(), out.size(), kDecodeIncludeSpecial);
  out.resize(length);
  return out;
}

Matcher::Matcher(std::shared_ptr<const Tokenizer> tokenizer, const std::string& grammar)
    : tokenizer_(std::move(tokenizer)), handle_(nullptr) {
  const LlgApi& api = tokenizer_->api();
  alignas(16) unsigned char init[kConstraintInitBytes] = {};
  api.constraint_init_set_defaults(init, tokenizer_->handle());
  auto* head = reinterpret_cast<ConstraintInitHead*>(init);
  head->log_buffer_level = 0;  // no logs kept, none on stderr (the Python matcher's log_level=0)
  head->log_stderr_level = 0;
  handle_ = api.new_matcher(init, "llguidance", grammar.c_str());
  if (handle_ == nullptr) throw std::runtime_error("llg_new_matcher returned no matcher");
  if (!api.is_error(handle_)) {
    PS_CHECK(api.mask_byte_size(handle_) == mask_words() * 4, "llguidance's mask is ",
             api.mask_byte_size(handle_), " bytes, expected ", mask_words() * 4);
  }
}

Matcher::Matcher(std::shared_ptr<const Tokenizer> tokenizer, void* handle)
    : tokenizer_(std::move(tokenizer)), handle_(handle) {
  if (handle_ == nullptr) throw std::runtime_error("llg_clone_matcher returned no matcher");
}

Matcher::Matcher(Matcher&& other) noexcept : tokenizer_(other.tokenizer_), handle_(other.handle_) {
  other.handle_ = nullptr;
}

Matcher::~Matcher() {
  if (handle_ != nullptr) tokenizer_->api().free_matcher(handle_);
}

Matcher Matcher::clone() const { return Matcher(tokenizer_, tokenizer_->api().clone_matcher(handle_)); }

bool Matcher::consume(uint32_t token) {
  const LlgApi& api = tokenizer_->api();
  if (api.is_stopped(handle_)) {  // in error too, as the Python matcher's consume_token
    for (uint32_t eos : tokenizer_->eos_ids()) {
      if (token == eos) return true;
    }
  }
  return api.consume_token(handle_, token) == 0;
}

bool Matcher::accepts(uint32_t token) { return tokenizer_->api().validate_tokens(handle_, &token, 1) == 1; }

bool Matcher::is_stopped() const { return tokenizer_->api().is_stopped(handle_); }

bool Matcher::is_error() const { return tokenizer_->api().is_error(handle_); }

std::optional<std::string> Matcher::error() const {
  const LlgApi& api = tokenizer_->api();
  if (!api.is_error(handle_)) return std::nullopt;
  const char* message = api.get_error(handle_);
  return std::string(message ? message : "llguidance matcher in error");
}

void Matcher::fill(uint32_t* words, size_t num_words) {
  PS_CHECK(num_words == mask_words(), "a mask row of ", num_words, " words, the vocabulary needs ", mask_words());
  const LlgApi& api = tokenizer_->api();
  if (api.is_stopped(handle_) || api.compute_mask_into(handle_, words, num_words * 4) != 0) {
    fill_eos(words, num_words);
  }
}

void Matcher::fill_eos(uint32_t* words, size_t num_words) const {
  std::memset(words, 0, num_words * 4);
  for (uint32_t eos : tokenizer_->eos_ids()) words[eos / 32] |= 1u << (eos % 32);
}

}  // namespace pagedserve::grammar
