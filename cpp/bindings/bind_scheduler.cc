#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>

#include "array_view.h"
#include "bindings.h"
#include "scheduler.h"

namespace py = pybind11;

namespace pagedserve::bindings {
namespace {

static_assert(sizeof(BlockCopy) == 2 * sizeof(int32_t), "BlockCopy must be two packed int32s");

using StepPtr = std::shared_ptr<StepOutput>;

// A zero-copy, read-only int32 view of one StepOutput array, kept alive by the step.
template <auto Member>
py::array_t<int32_t> step_array(py::object self) {
  const StepOutput& step = self.cast<const StepOutput&>();
  return readonly_view((step.*Member), self);
}

py::dict stats_dict(const SchedulerStats& s) {
  py::dict d;
#define PS_FIELD(name) d[#name] = s.name
  PS_FIELD(num_running);
  PS_FIELD(num_waiting);
  PS_FIELD(num_blocks);
  PS_FIELD(num_free_blocks);
  PS_FIELD(num_evictable_blocks);
  PS_FIELD(num_used_blocks);
  PS_FIELD(pool_utilization);
  PS_FIELD(internal_fragmentation_slots);
  PS_FIELD(blocks_saved_by_sharing);
  PS_FIELD(prefix_queried_blocks);
  PS_FIELD(prefix_hit_blocks);
  PS_FIELD(prefix_evictions);
  PS_FIELD(prefix_hit_rate);
  PS_FIELD(num_preemptions);
  PS_FIELD(num_preempted_tokens);
  PS_FIELD(step_num_seqs);
  PS_FIELD(step_prefill_tokens);
  PS_FIELD(step_decode_tokens);
#undef PS_FIELD
  return d;
}

std::span<const TokenId> as_tokens(const py::array_t<TokenId, py::array::c_style | py::array::forcecast>& a) {
  if (a.ndim() != 1) throw py::value_error("expected a 1-D sequence of token ids");
  return {a.data(), static_cast<size_t>(a.size())};
}

}  // namespace

void bind_scheduler(py::module_& m) {
  py::enum_<FinishReason>(m, "FinishReason")
      .value("NONE", FinishReason::kNone)
      .value("STOP", FinishReason::kStop)
      .value("LENGTH", FinishReason::kLength)
      .value("ABORT", FinishReason::kAbort)
      .value("REJECTED", FinishReason::kRejected);

  py::class_<SchedulerConfig>(m, "SchedulerConfig")
      .def(py::init([](int32_t num_blocks, int32_t block_size, int32_t max_num_seqs, int32_t max_num_batched_tokens,
                       int32_t max_model_len, bool enable_prefix_caching, double watermark,
                       std::vector<TokenId> eos_token_ids, int32_t sliding_window) {
             return SchedulerConfig{num_blocks,    block_size,           max_num_seqs, max_num_batched_tokens,
                                    max_model_len, enable_prefix_caching, watermark,    std::move(eos_token_ids),
                                    sliding_window};
           }),
           py::kw_only(), py::arg("num_blocks"), py::arg("block_size") = 16, py::arg("max_num_seqs") = 256,
           py::arg("max_num_batched_tokens") = 8192, py::arg("max_model_len") = 8192,
           py::arg("enable_prefix_caching") = true, py::arg("watermark") = 0.01,
           py::arg("eos_token_ids") = std::vector<TokenId>{}, py::arg("sliding_window") = 0)
      .def_readonly("num_blocks", &SchedulerConfig::num_blocks)
      .def_readonly("block_size", &SchedulerConfig::block_size)
      .def_readonly("max_num_seqs", &SchedulerConfig::max_num_seqs)
      .def_readonly("max_num_batched_tokens", &SchedulerConfig::max_num_batched_tokens)
      .def_readonly("max_model_len", &SchedulerConfig::max_model_len)
      .def_readonly("enable_prefix_caching", &SchedulerConfig::enable_prefix_caching)
      .def_readonly("watermark", &SchedulerConfig::watermark)
      .def_readonly("eos_token_ids", &SchedulerConfig::eos_token_ids)
      .def_readonly("sliding_window", &SchedulerConfig::sliding_window);

  py::class_<FinishedSeq>(m, "FinishedSeq")
      .def_readonly("seq_id", &FinishedSeq::id)
      .def_readonly("reason", &FinishedSeq::reason)
      .def_property_readonly("stop_token",
                             [](const FinishedSeq& f) -> std::optional<TokenId> {
                               if (f.stop_token < 0) return std::nullopt;
                               return f.stop_token;
                             })
      .def("__repr__", [](const FinishedSeq& f) {
        return "FinishedSeq(seq_id=" + std::to_string(f.id) + ", reason=" +
               py::str(py::cast(f.reason)).cast<std::string>() + ")";
      });

  py::class_<ForkedSeq>(m, "ForkedSeq")
      .def_readonly("parent", &ForkedSeq::parent)
      .def_readonly("child", &ForkedSeq::child)
      .def_readonly("sample_index", &ForkedSeq::sample_index);

  py::class_<UpdateResult>(m, "UpdateResult")
      .def_readonly("finished", &UpdateResult::finished)
      .def_readonly("forks", &UpdateResult::forks);

  py::class_<StepOutput, StepPtr>(m, "StepOutput",
                                  "One step's batch as flat int32 arrays (read-only numpy views, no copies).")
      .def_readonly("num_seqs", &StepOutput::num_seqs)
      .def_readonly("num_tokens", &StepOutput::num_tokens)
      .def_readonly("num_decodes", &StepOutput::num_decodes)
      .def_readonly("max_query_len", &StepOutput::max_query_len)
      .def_readonly("max_seq_len", &StepOutput::max_seq_len)
      .def_readonly("max_blocks_per_seq", &StepOutput::max_blocks_per_seq)
      .def_readonly("total_samples", &StepOutput::total_samples)
      .def_property_readonly("num_prefill_tokens", &StepOutput::num_prefill_tokens)
      .def_property_readonly("seq_ids",
                             [](py::object self) {
                               const auto& s = self.cast<const StepOutput&>();
                               return readonly_view(s.seq_ids, self);
                             })
      .def_property_readonly("input_ids", &step_array<&StepOutput::input_ids>)
      .def_property_readonly("positions", &step_array<&StepOutput::positions>)
      .def_property_readonly("slot_mapping", &step_array<&StepOutput::slot_mapping>)
      .def_property_readonly("query_start_loc", &step_array<&StepOutput::query_start_loc>)
      .def_property_readonly("seq_lens", &step_array<&StepOutput::seq_lens>)
      .def_property_readonly("prompt_lens", &step_array<&StepOutput::prompt_lens>)
      .def_property_readonly("sample_rows", &step_array<&StepOutput::sample_rows>)
      .def_property_readonly("logits_indices", &step_array<&StepOutput::logits_indices>)
      .def_property_readonly("num_samples", &step_array<&StepOutput::num_samples>)
      .def_property_readonly("deferred_tokens", &step_array<&StepOutput::deferred_tokens>)
      .def_property_readonly("deferred_samples", &step_array<&StepOutput::deferred_samples>)
      .def_property_readonly("block_tables",
                             [](py::object self) {
                               const auto& s = self.cast<const StepOutput&>();
                               return readonly_view<int32_t>(s.block_tables.data(), {s.num_seqs, s.max_blocks_per_seq},
                                                             self);
                             })
      .def_property_readonly("block_copies",
                             [](py::object self) {
                               const auto& s = self.cast<const StepOutput&>();
                               return readonly_view<int32_t>(reinterpret_cast<const int32_t*>(s.block_copies.data()),
                                                             {static_cast<py::ssize_t>(s.block_copies.size()), 2}, self);
                             })
      .def_readonly("rejected", &StepOutput::rejected)
      .def_readonly("preempted", &StepOutput::preempted);

  py::class_<Scheduler>(m, "Scheduler", "Continuous batching over a paged KV cache (see cpp/scheduler.h).")
      .def(py::init<SchedulerConfig>(), py::arg("config"))
      .def(
          "add_sequence",
          [](Scheduler& s, const py::array_t<TokenId, py::array::c_style | py::array::forcecast>& prompt,
             int32_t max_tokens, int32_t min_tokens, bool ignore_eos, std::vector<TokenId> stop_token_ids, int32_t n,
             bool use_prefix_cache, uint64_t cache_salt) {
            return s.add_sequence(as_tokens(prompt),
                                  StopParams{max_tokens, min_tokens, ignore_eos, std::move(stop_token_ids), n},
                                  use_prefix_cache, cache_salt);
          },
          py::arg("prompt_token_ids"), py::kw_only(), py::arg("max_tokens") = 16, py::arg("min_tokens") = 0,
          py::arg("ignore_eos") = false, py::arg("stop_token_ids") = std::vector<TokenId>{}, py::arg("n") = 1,
          py::arg("use_prefix_cache") = true, py::arg("cache_salt") = 0,
          "Queues a prompt; returns its sequence id.")
      .def("schedule",
           [](Scheduler& s) { return std::const_pointer_cast<StepOutput>(s.schedule()); })
      .def(
          "update",
          [](Scheduler& s, const py::array_t<TokenId, py::array::c_style | py::array::forcecast>& sampled) {
            return s.update(as_tokens(sampled));
          },
          py::arg("sampled_token_ids"))
      .def("advance", &Scheduler::advance,
           "Takes the scheduled step as computed, its sampled tokens still to come (run-ahead).")
      .def(
          "commit",
          [](Scheduler& s, const py::array_t<TokenId, py::array::c_style | py::array::forcecast>& sampled) {
            return s.commit(as_tokens(sampled));
          },
          py::arg("sampled_token_ids"), "The advanced step's sampled tokens: what update() would have done.")
      .def_property_readonly("has_advanced", &Scheduler::has_advanced)
      .def("abort", &Scheduler::abort, py::arg("seq_id"))
      .def("finish", &Scheduler::finish, py::arg("seq_id"), py::arg("reason") = FinishReason::kStop)
      .def("has_unfinished", &Scheduler::has_unfinished)
      .def_property_readonly("num_waiting", &Scheduler::num_waiting)
      .def_property_readonly("num_running", &Scheduler::num_running)
      .def_property_readonly("running_ids", &Scheduler::running_ids)
      .def_property_readonly("waiting_ids", &Scheduler::waiting_ids)
      .def_property_readonly("config", &Scheduler::config)
      .def_property_readonly("pool", &Scheduler::pool, py::return_value_policy::reference_internal)
      .def("stats", [](const Scheduler& s) { return stats_dict(s.stats()); })
      .def(
          "sequence",
          [](const Scheduler& s, SeqId id) -> std::optional<py::dict> {
            const Sequence* seq = s.find(id);
            if (!seq) return std::nullopt;
            py::dict d;
            d["seq_id"] = seq->id;
            d["token_ids"] = seq->tokens;
            d["num_prompt_tokens"] = seq->num_prompt_tokens;
            d["num_computed_tokens"] = seq->num_computed_tokens;
            d["block_ids"] = std::vector<BlockId>(seq->table.blocks().begin(), seq->table.blocks().end());
            d["status"] = seq->status == SeqStatus::kRunning ? "running" : "waiting";
            d["num_preemptions"] = seq->num_preemptions;
            return d;
          },
          py::arg("seq_id"), "A snapshot of a waiting or running sequence, or None.");
}

}  // namespace pagedserve::bindings
