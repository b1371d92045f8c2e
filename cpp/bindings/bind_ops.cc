#include "bindings.h"

namespace pagedserve::bindings {

void bind_ops(pybind11::module_&) {}

}  // namespace pagedserve::bindings
