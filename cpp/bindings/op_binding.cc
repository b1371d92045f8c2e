#include "bindings/op_binding.h"

#include <cstring>
#include <stdexcept>
#include <string>

#include "ops/dlpack.h"

namespace py = pybind11;

namespace pagedserve::bindings {

ops::TensorView read_tensor(const py::capsule& capsule, std::string_view op, std::string_view arg) {
  const std::string where = std::string(op) + ": " + std::string(arg);
  const char* name = capsule.name();
  if (name == nullptr || std::strcmp(name, "dltensor") != 0) {
    throw py::value_error(where + " must be a 'dltensor' capsule from torch.utils.dlpack.to_dlpack, got one named '" +
                          (name ? name : "") + "' (a consumed capsule is renamed 'used_dltensor')");
  }
  try {
    return ops::view_from_dlpack(capsule.get_pointer<DLManagedTensor>());
  } catch (const std::invalid_argument& e) {
    constexpr std::string_view kParser = "view_from_dlpack: ";
    std::string_view reason = e.what();
    if (reason.starts_with(kParser)) reason.remove_prefix(kParser.size());
    throw py::value_error(where + ": " + std::string(reason));
  }
}

}  // namespace pagedserve::bindings
