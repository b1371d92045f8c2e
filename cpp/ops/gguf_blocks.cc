// The GGUF block formats by ggml type number (the table is in gguf_blocks.h).
#include "ops/gguf_blocks.h"

#include <string>

#include "ops/tensor_view.h"

namespace pagedserve::ops::gguf {

const BlockFormat& block_format(int64_t type, const char* op) {
  for (const BlockFormat& format : kFormats) {
    if (static_cast<int64_t>(format.type) == type) return format;
  }
  fail_argument(op, "GGUF tensor type " + std::to_string(type) + " is not supported; supported: " +
                        supported_type_names());
}

std::string supported_type_names() {
  std::string names;
  for (const BlockFormat& format : kFormats) {
    if (!names.empty()) names += ", ";
    names += std::string(format.name) + " (" + std::to_string(static_cast<int>(format.type)) + ")";
  }
  return names;
}

}  // namespace pagedserve::ops::gguf
