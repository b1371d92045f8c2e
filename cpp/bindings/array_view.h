// Read-only numpy views of C++ vectors, without copying.
//
// The array's base is the Python object owning the vector, so the view keeps
// it alive; the data is never written after the owner is built.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <vector>

namespace pagedserve::bindings {

template <typename T>
pybind11::array_t<T> readonly_view(const T* data, std::initializer_list<pybind11::ssize_t> shape, pybind11::handle owner) {
  pybind11::array_t<T> array(std::vector<pybind11::ssize_t>(shape), data, owner);
  pybind11::detail::array_proxy(array.ptr())->flags &= ~pybind11::detail::npy_api::NPY_ARRAY_WRITEABLE_;
  return array;
}

template <typename T>
pybind11::array_t<T> readonly_view(const std::vector<T>& v, pybind11::handle owner) {
  return readonly_view<T>(v.data(), {static_cast<pybind11::ssize_t>(v.size())}, owner);
}

}  // namespace pagedserve::bindings
