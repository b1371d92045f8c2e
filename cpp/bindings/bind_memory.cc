#include <pybind11/stl.h>

#include "bindings.h"
#include "block_pool.h"
#include "block_table.h"

namespace py = pybind11;

namespace pagedserve::bindings {

void bind_memory(py::module_& m) {
  py::enum_<BlockState>(m, "BlockState")
      .value("FREE", BlockState::kFree)
      .value("IN_USE", BlockState::kInUse)
      .value("SHARED", BlockState::kShared)
      .value("EVICTABLE", BlockState::kEvictable);

  py::class_<BlockPool>(m, "BlockPool", "Metadata of the KV blocks: refcounts, free list, prefix-cache index.")
      .def(py::init<int32_t, int32_t, bool>(), py::arg("num_blocks"), py::arg("block_size"),
           py::arg("enable_prefix_caching") = true)
      .def("allocate", &BlockPool::allocate, "A block with refcount 1, or None when the pool is exhausted.")
      .def("incref", &BlockPool::incref, py::arg("block"))
      .def("decref", &BlockPool::decref, py::arg("block"))
      .def("refcount", &BlockPool::refcount, py::arg("block"))
      .def("end_step", &BlockPool::end_step,
           "Lets copy-on-write sources freed this step be handed out again (call once the copies are applied).")
      .def("state", &BlockPool::state, py::arg("block"))
      .def("block_states", [](const BlockPool& p) {
             auto states = p.block_states();
             return py::bytes(reinterpret_cast<const char*>(states.data()), states.size());
           }, "One BlockState value per block, as bytes.")
      .def("is_cached", &BlockPool::is_cached, py::arg("block"))
      .def("check_invariants", &BlockPool::check_invariants)
      .def_property_readonly("num_blocks", &BlockPool::num_blocks)
      .def_property_readonly("block_size", &BlockPool::block_size)
      .def_property_readonly("num_free", &BlockPool::num_free)
      .def_property_readonly("num_evictable", &BlockPool::num_evictable)
      .def_property_readonly("num_used", &BlockPool::num_used)
      .def_property_readonly("total_refs", &BlockPool::total_refs)
      .def_property_readonly("prefix_caching_enabled", &BlockPool::prefix_caching_enabled)
      .def_property_readonly("prefix_counters", [](const BlockPool& p) {
        const auto& c = p.prefix_counters();
        return py::dict(py::arg("queried_blocks") = c.queried_blocks, py::arg("hit_blocks") = c.hit_blocks,
                        py::arg("evictions") = c.evictions);
      });

  py::class_<BlockTable>(m, "BlockTable", "One sequence's blocks; releases them when dropped.")
      .def(py::init<BlockPool&>(), py::arg("pool"), py::keep_alive<1, 2>())
      .def_property_readonly("blocks", [](const BlockTable& t) {
        return std::vector<BlockId>(t.blocks().begin(), t.blocks().end());
      })
      .def_property_readonly("num_blocks", &BlockTable::num_blocks)
      .def_property_readonly("capacity", &BlockTable::capacity)
      .def("slot", &BlockTable::slot, py::arg("position"))
      .def("blocks_needed", &BlockTable::blocks_needed, py::arg("begin"), py::arg("end"))
      .def(
          "prepare_write",
          [](BlockTable& t, int32_t begin, int32_t end) -> std::optional<std::vector<std::pair<BlockId, BlockId>>> {
            std::vector<BlockCopy> copies;
            if (!t.prepare_write(begin, end, copies)) return std::nullopt;
            std::vector<std::pair<BlockId, BlockId>> out;
            for (const auto& c : copies) out.emplace_back(c.src, c.dst);
            return out;
          },
          py::arg("begin"), py::arg("end"),
          "Makes positions [begin, end) writable. Returns the (src, dst) copy-on-write copies, or None if the "
          "pool is exhausted (nothing changed). Each src stays out of circulation until pool.end_step().")
      .def("fork", &BlockTable::fork, py::keep_alive<0, 1>())
      .def(
          "match_prefix",
          [](BlockTable& t, BlockPool& pool, const std::vector<TokenId>& tokens) {
            const PrefixMatch match = BlockTable::find_prefix(pool, tokens);
            t.adopt_prefix(match);
            return match.num_tokens(pool.block_size());
          },
          py::arg("pool"), py::arg("tokens"),
          "Adopts the longest cached prefix of tokens (empty table only); returns the tokens it covers.")
      .def("register_full_blocks", [](BlockTable& t, const std::vector<TokenId>& tokens,
                                      int32_t num_computed) { t.register_full_blocks(tokens, num_computed); },
           py::arg("tokens"), py::arg("num_computed"))
      .def("release", &BlockTable::release);
}

}  // namespace pagedserve::bindings
