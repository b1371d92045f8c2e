#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "bindings.h"
#include "grammar/grammar_pool.h"
#include "grammar/grammar_worker.h"
#include "grammar/llguidance_api.h"

#ifdef PAGEDSERVE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace py = pybind11;

namespace pagedserve::bindings {

using grammar::GrammarPool;
using grammar::GrammarWorker;
using grammar::Matcher;
using grammar::MatcherRows;
using grammar::Tokenizer;

namespace {

// A Python callable as a Tokenizer::TokenizeFn: llguidance calls it from any thread, so each call takes the
// GIL, and the last copy lets go of the callable under it too.
Tokenizer::TokenizeFn python_tokenize(py::object fn) {
  if (fn.is_none()) return nullptr;
  auto held = std::shared_ptr<py::object>(new py::object(std::move(fn)), [](py::object* p) {
    py::gil_scoped_acquire gil;
    delete p;
  });
  return [held](std::string_view bytes) {
    py::gil_scoped_acquire gil;
    return (*held)(py::bytes(bytes.data(), bytes.size())).cast<std::vector<uint32_t>>();
  };
}

// Host memory given as an address (a torch tensor's data_ptr()); the Python side checks dtype and shape.
template <typename T>
T* host_pointer(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

// How the grammar thread waits for a draw's ids: `ready` is the CUDA event recorded after their copy to the
// host (torch.cuda.Event.cuda_event, of the device numbered `device`), 0 where they are there already.
void wait_for_ids(uintptr_t ready, [[maybe_unused]] int device) {
#ifdef PAGEDSERVE_WITH_CUDA
  if (ready == 0) return;
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(ready));
  if (err != cudaSuccess) throw std::runtime_error(std::string("waiting for a draw's ids: ") + cudaGetErrorString(err));
#else
  if (ready != 0) throw std::runtime_error("a CUDA event to wait for, in a build without CUDA");
#endif
}

}  // namespace

void bind_grammar(py::module_& m) {
  py::class_<Tokenizer, std::shared_ptr<Tokenizer>>(
      m, "LlgTokenizer", "llguidance's view of a tokenizer, through its C API (see cpp/grammar/llguidance_api.h).")
      .def(py::init([](const std::string& library, const std::string& json, uint32_t vocab_size,
                       const std::vector<uint32_t>& eos_ids, py::object tokenize) {
             return std::make_shared<Tokenizer>(library, json, vocab_size, eos_ids, python_tokenize(tokenize));
           }), py::arg("library"), py::arg("tokenizer_json"), py::arg("vocab_size"), py::arg("eos_ids"),
           py::arg("tokenize") = py::none(),
           "tokenize: bytes -> token ids (called with the GIL, from any thread); None: llguidance's greedy one.")
      .def("decode", [](const Tokenizer& t, const std::vector<uint32_t>& ids) { return py::bytes(t.decode(ids)); },
           py::arg("ids"), "The tokens' bytes as llguidance reads them, special tokens included.")
      .def_property_readonly("vocab_size", &Tokenizer::vocab_size);

  py::class_<Matcher>(m, "LlgMatcher", "One sample's llguidance matcher (cpp/grammar/llguidance_api.h).")
      .def(py::init([](std::shared_ptr<Tokenizer> tokenizer, const std::string& grammar) {
             return Matcher(std::move(tokenizer), grammar);
           }), py::arg("tokenizer"), py::arg("grammar"))
      .def("clone", &Matcher::clone)
      .def("consume", &Matcher::consume, py::arg("token"))
      .def("accepts", &Matcher::accepts, py::arg("token"))
      .def("is_stopped", &Matcher::is_stopped)
      .def("is_error", &Matcher::is_error)
      .def_property_readonly("error", &Matcher::error)
      .def("fill", [](Matcher& matcher, uintptr_t words, size_t num_words) {
             matcher.fill(host_pointer<uint32_t>(words), num_words);
           }, py::arg("words"), py::arg("num_words"), "Writes the next mask at host address `words`.");

  auto pool_class = py::class_<GrammarPool>(m, "GrammarPool", "A step's accepts and masks over threads (cpp/grammar/grammar_pool.h).")
      .def(py::init<int>(), py::arg("num_threads"))
      .def_property_readonly("num_threads", &GrammarPool::num_threads)
      .def("run", [](GrammarPool& pool, const std::vector<Matcher*>& matchers,
                     const std::optional<std::vector<int64_t>>& tokens, const std::vector<int64_t>& rows,
                     uintptr_t bitmask, int64_t num_rows, int64_t row_words, uintptr_t flag, int64_t number) {
             std::span<const int64_t> token_span;
             if (tokens) token_span = *tokens;
             py::gil_scoped_release release;
             return pool.run(matchers, token_span, rows, host_pointer<uint32_t>(bitmask), num_rows, row_words,
                             host_pointer<int64_t>(flag), number);
           }, py::arg("matchers"), py::arg("tokens"), py::arg("rows"), py::arg("bitmask"), py::arg("num_rows"),
           py::arg("row_words"), py::arg("flag") = 0, py::arg("number") = 0,
           "Each matcher consumes its token (tokens may be None), then fills its row of the int32 bitmask at host "
           "address `bitmask`; the int64 at `flag` (0: none) becomes `number` once the masks are in. Returns each "
           "row's outcome: REFUSED (0), LIVE (1) or STOPPED (2). The GIL is dropped throughout.");
  pool_class.attr("REFUSED") = static_cast<int>(GrammarPool::kRefused);
  pool_class.attr("LIVE") = static_cast<int>(GrammarPool::kLive);
  pool_class.attr("STOPPED") = static_cast<int>(GrammarPool::kStopped);

  py::class_<MatcherRows, std::shared_ptr<MatcherRows>>(
      m, "MatcherRows", "A step's (row, matcher) pairs for GrammarWorker jobs (cpp/grammar/grammar_worker.h).")
      .def(py::init([](const std::vector<Matcher*>& matchers, const std::vector<int64_t>& rows) {
             if (matchers.size() != rows.size()) throw py::value_error("MatcherRows: one row a matcher");
             return std::make_shared<MatcherRows>(MatcherRows{matchers, rows});
           }), py::arg("matchers"), py::arg("rows"), "The caller keeps the matchers alive.")
      .def("__len__", [](const MatcherRows& pairs) { return pairs.rows.size(); });

  // Deleted with the GIL dropped: the destructor joins the thread, whose job may ask Python to tokenize a
  // forced text (python_tokenize above).
  py::class_<GrammarWorker, std::shared_ptr<GrammarWorker>>(
      m, "GrammarWorker", "The grammar thread, in C++ (cpp/grammar/grammar_worker.h).")
      .def(py::init([](GrammarPool& pool) {
             return std::shared_ptr<GrammarWorker>(new GrammarWorker(pool, &wait_for_ids), [](GrammarWorker* worker) {
               if (PyGILState_Check()) {
                 py::gil_scoped_release release;
                 delete worker;
               } else {
                 delete worker;
               }
             });
           }), py::arg("pool"), py::keep_alive<1, 2>())
      .def("submit", [](GrammarWorker& worker, int64_t number, std::shared_ptr<const MatcherRows> pairs,
                        uintptr_t ids, int64_t num_ids, uintptr_t ready, int device, uintptr_t bitmask,
                        int64_t num_rows, int64_t row_words, uintptr_t flag) {
             worker.submit(GrammarWorker::Job{number, std::move(pairs), host_pointer<const int32_t>(ids), num_ids,
                                              ready, device, host_pointer<uint32_t>(bitmask), num_rows, row_words,
                                              host_pointer<int64_t>(flag)});
           }, py::arg("number"), py::arg("pairs"), py::arg("ids"), py::arg("num_ids"), py::arg("ready"),
           py::arg("device"), py::arg("bitmask"), py::arg("num_rows"), py::arg("row_words"), py::arg("flag") = 0,
           "Queues job `number`: once `ready` (a CUDA event of `device`, 0: none) is done, each pair consumes the "
           "int32 id of its row at host address `ids`, then fills its row of the bitmask; the int64 at `flag` then "
           "becomes `number`. The caller keeps every buffer alive and the matchers untouched until wait(number).")
      .def("wait", [](GrammarWorker& worker, int64_t number) {
             GrammarWorker::Result result;
             {
               py::gil_scoped_release release;
               result = worker.wait(number);
             }
             if (!result.error.empty()) throw std::runtime_error(result.error);
             return py::make_tuple(py::cast(result.outcomes), result.seconds);
           }, py::arg("number"),
           "Waits for job `number` (the GIL dropped); returns (each pair's outcome, seconds consuming and filling). "
           "RuntimeError where the job failed.")
      .def("close", &GrammarWorker::close, py::call_guard<py::gil_scoped_release>(),
           "Runs the queued jobs and stops the thread; later submits raise.");
}

}  // namespace pagedserve::bindings
