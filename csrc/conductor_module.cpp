// kvpool._conductor: the pybind11 bindings of the conductor's prefix index (see conductor.h).

#include "conductor.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string_view>

namespace py = pybind11;
using kvpool_conductor::IngestStats;
using kvpool_conductor::kMaxLocations;
using kvpool_conductor::PrefixIndex;
using kvpool_conductor::Span;
using kvpool_conductor::xxh64;

namespace {

// A read-only view of a C-contiguous buffer of T, or a copy of a Python sequence of ints.
template <typename T>
struct IntView {
  std::vector<T> copy;
  const T* data = nullptr;
  size_t n = 0;
  py::object keep;

  explicit IntView(const py::object& obj) {
    if (PyObject_CheckBuffer(obj.ptr())) {
      py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request();
      if (info.ndim == 1 && info.itemsize == static_cast<py::ssize_t>(sizeof(T)) &&
          (info.strides.empty() || info.strides[0] == static_cast<py::ssize_t>(sizeof(T))) &&
          !info.format.empty() &&
          std::string("bBhHiIlLqQ").find(info.format.back()) != std::string::npos) {
        data = static_cast<const T*>(info.ptr);
        n = static_cast<size_t>(info.size);
        keep = obj;
        return;
      }
    }
    copy.reserve(static_cast<size_t>(py::len(obj)));
    for (py::handle h : obj) copy.push_back(h.cast<T>());
    data = copy.data();
    n = copy.size();
  }
};

py::dict stats_dict(const IngestStats& st) {
  py::dict d;
  d["batches"] = st.batches;
  d["malformed"] = st.malformed;
  d["stored"] = st.stored;
  d["removed"] = st.removed;
  d["cleared"] = st.cleared;
  d["evicted"] = st.evicted;
  d["skipped_block_size"] = st.skipped_block_size;
  d["skipped_orphan"] = st.skipped_orphan;
  d["skipped_group"] = st.skipped_group;
  d["skipped_medium"] = st.skipped_medium;
  d["skipped_shape"] = st.skipped_shape;
  d["last_bad_block_size"] = st.last_bad_block_size;
  d["last_ts"] = st.last_ts;
  return d;
}

}  // namespace

PYBIND11_MODULE(_conductor, m) {
  m.doc() = "kvpool conductor native core: prefix index and vLLM KV-event ingest";
  m.attr("MAX_LOCATIONS") = kMaxLocations;

  m.def(
      "xxh64",
      [](py::bytes data, uint64_t seed) {
        std::string_view s = data;
        return xxh64(reinterpret_cast<const uint8_t*>(s.data()), s.size(), seed);
      },
      py::arg("data"), py::arg("seed") = 0, "XXH64 of bytes (the block hash primitive).");

  py::class_<PrefixIndex>(m, "PrefixIndex")
      .def(py::init<uint32_t, uint64_t, size_t, size_t>(), py::arg("block_size"),
           py::arg("root_seed") = 0, py::arg("expected_blocks") = 0, py::arg("max_blocks") = 0,
           "`max_blocks` (0: none): after an ingest or add that leaves more blocks than this, the "
           "oldest entries of the locations holding the most are evicted to ~1/64 under it.")
      .def_property_readonly("block_size", &PrefixIndex::block_size)
      .def_property_readonly("max_blocks", &PrefixIndex::max_blocks)
      .def_property_readonly("root_seed", &PrefixIndex::root_seed)
      .def(
          "hash_tokens",
          [](const PrefixIndex& self, const py::object& tokens, const py::object& extras,
             const py::object& parent) {
            IntView<uint32_t> tv(tokens);
            std::vector<std::string> keep;
            std::vector<bool> present;
            if (!extras.is_none()) {
              for (py::handle h : extras) {
                present.push_back(!h.is_none());
                keep.push_back(h.is_none() ? std::string() : h.cast<std::string>());
              }
            }
            std::vector<Span> ex(keep.size());
            for (size_t i = 0; i < keep.size(); ++i)
              if (present[i]) ex[i] = Span{reinterpret_cast<const uint8_t*>(keep[i].data()), keep[i].size()};
            uint64_t seed = parent.is_none() ? self.root_seed() : parent.cast<uint64_t>();
            std::vector<uint64_t> out;
            {
              py::gil_scoped_release nogil;
              out = self.chain(tv.data, tv.n, ex, seed);
            }
            return out;
          },
          py::arg("tokens"), py::arg("extras") = py::none(), py::arg("parent") = py::none(),
          "Chained hashes of the full blocks of `tokens` (list or uint32 buffer); `extras`: per "
          "block, msgpack bytes of its extra keys or None.")
      .def(
          "add",
          [](PrefixIndex& self, int loc, const py::object& hashes, bool evict) {
            IntView<uint64_t> hv(hashes);
            std::vector<uint64_t> v(hv.data, hv.data + hv.n);
            py::gil_scoped_release nogil;
            return self.add(loc, v, evict);
          },
          py::arg("location"), py::arg("hashes"), py::arg("evict") = true,
          "The location holds `hashes` (a chain's, head first: its tail is evicted first). With "
          "`evict`, an index left over `max_blocks` evicts as after an ingest; returns the entries "
          "evicted.")
      .def(
          "remove",
          [](PrefixIndex& self, int loc, const py::object& hashes) {
            IntView<uint64_t> hv(hashes);
            std::vector<uint64_t> v(hv.data, hv.data + hv.n);
            py::gil_scoped_release nogil;
            self.remove(loc, v);
          },
          py::arg("location"), py::arg("hashes"))
      .def("clear", &PrefixIndex::clear, py::arg("location"), py::call_guard<py::gil_scoped_release>())
      .def(
          "ingest",
          [](PrefixIndex& self, const py::bytes& payload, int loc_gpu, int loc_cpu, int loc_other) {
            std::string_view s = payload;
            IngestStats st;
            {
              py::gil_scoped_release nogil;
              self.ingest(reinterpret_cast<const uint8_t*>(s.data()), s.size(), loc_gpu, loc_cpu,
                          loc_other, st);
            }
            return stats_dict(st);
          },
          py::arg("payload"), py::arg("location"), py::arg("cpu_location") = -1,
          py::arg("other_location") = -1,
          "Apply one msgpack KVEventBatch payload from the engine at `location`; returns counters.")
      .def(
          "match",
          [](const PrefixIndex& self, const py::object& hashes, int n_locations) {
            if (n_locations < 0 || n_locations > kMaxLocations)
              throw std::out_of_range("n_locations must be in 0..64");
            IntView<uint64_t> hv(hashes);
            std::vector<uint32_t> out;
            {
              py::gil_scoped_release nogil;
              out = self.match(hv.data, hv.n, n_locations);
            }
            return out;
          },
          py::arg("hashes"), py::arg("n_locations"),
          "Per location, the number of leading blocks of `hashes` it holds.")
      .def("mask", &PrefixIndex::mask, py::arg("hash"))
      .def("location_size", &PrefixIndex::location_size, py::arg("location"))
      .def("hashes_at", &PrefixIndex::hashes_at, py::arg("location"))
      .def("__len__", &PrefixIndex::size);
}
