#include "bindings.h"

PYBIND11_MODULE(_core, m) {
  m.doc() = "pagedserve core: paged KV-cache memory, continuous-batching scheduler, reference ops";
  pagedserve::bindings::bind_memory(m);
  pagedserve::bindings::bind_scheduler(m);
  auto ops = m.def_submodule("ops", "CPU reference ops (torch CPU tensors in, via DLPack)");
  pagedserve::bindings::bind_ops(ops);
  pagedserve::bindings::bind_decoder_stack(ops);
  auto grammar = m.def_submodule("grammar", "llguidance's C API and the grammar pool");
  pagedserve::bindings::bind_grammar(grammar);
#ifdef PAGEDSERVE_WITH_CUDA
  auto cuda_ops = m.def_submodule("cuda_ops", "CUDA kernels, launched on the caller's stream");
  pagedserve::bindings::bind_cuda_ops(cuda_ops);
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
}
