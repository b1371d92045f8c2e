// Each file in cpp/bindings/ (and cuda/bindings/) binds one area of the core.
#pragma once

#include <pybind11/pybind11.h>

namespace pagedserve::bindings {

void bind_memory(pybind11::module_& m);     // BlockPool, BlockTable
void bind_scheduler(pybind11::module_& m);  // Scheduler, StepOutput, stats
void bind_ops(pybind11::module_& m);        // CPU reference ops
void bind_decoder_stack(pybind11::module_& m);  // DecoderStack: every decoder layer in one call (CPU)
void bind_grammar(pybind11::module_& m);   // llguidance's matchers over its C API, GrammarPool
#ifdef PAGEDSERVE_WITH_CUDA
void bind_cuda_ops(pybind11::module_& m);   // CUDA kernels (cuda/bindings/)
#endif

}  // namespace pagedserve::bindings
