// Python bindings of the native data path (kvpool._native). Every call that waits or moves
// bytes releases the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>
#include <tuple>

#include "cuda.h"
#include "engine.h"
#include "hmac.h"

void bind_ipc_plan(pybind11::module_& m);  // ipc_plan.cpp
void bind_ipc_complete(pybind11::module_& m);  // ipc_complete.cpp

namespace py = pybind11;
using namespace kvpool;

namespace {

PyObject* g_errors[16] = {nullptr};

PyObject* error_class(int kind) {
  if (kind > 0 && kind < 16 && g_errors[kind]) return g_errors[kind];
  return PyExc_RuntimeError;
}

void load_error_classes() {
  py::module_ errors = py::module_::import("kvpool.errors");
  const std::pair<int, const char*> names[] = {
      {E_INVALID, "InvalidArgument"},         {E_NOT_REGISTERED, "AddressNotRegistered"},
      {E_REGISTRATION, "RegistrationError"},  {E_REMOTE_ACCESS, "RemoteAccessError"},
      {E_SEGMENT_NOT_FOUND, "SegmentNotFound"}, {E_AUTH, "AuthenticationError"},
      {E_TRANSFER, "TransferError"},          {E_TIMEOUT, "TransferTimeout"},
      {E_BATCH_IN_FLIGHT, "BatchInFlight"},   {E_PROTOCOL, "ProtocolError"},
  };
  for (auto& [k, n] : names) g_errors[k] = py::object(errors.attr(n)).release().ptr();  // kept for the process
}

// Address and length of a contiguous Python buffer (writable unless allow_read_only).
py::tuple buffer_address(py::handle obj, bool allow_read_only) {
  Py_buffer view;
  int flags = (allow_read_only ? PyBUF_SIMPLE : PyBUF_WRITABLE) | PyBUF_ANY_CONTIGUOUS;
  if (PyObject_GetBuffer(obj.ptr(), &view, flags) != 0) {
    PyErr_Clear();
    throw KvError(E_INVALID, "expected a writable contiguous buffer (bytearray, memoryview, numpy array, tensor)");
  }
  auto addr = reinterpret_cast<uintptr_t>(view.buf);
  auto len = static_cast<uint64_t>(view.len);
  PyBuffer_Release(&view);
  return py::make_tuple(addr, len);
}

// The contents of a contiguous buffer of uint64 (e.g. a numpy uint64 array) as a vector.
std::vector<uint64_t> u64_vector(py::buffer b) {
  py::buffer_info info = b.request();
  if (info.ndim != 1 || info.itemsize != 8 || (info.format != "Q" && info.format != "L" && info.format != "K") ||
      (info.shape[0] > 1 && info.strides[0] != 8))
    throw KvError(E_INVALID, "expected a contiguous 1-D uint64 array");
  std::vector<uint64_t> v(static_cast<size_t>(info.shape[0]));
  if (!v.empty()) std::memcpy(v.data(), info.ptr, v.size() * 8);
  return v;
}

// Deterministic fast fill (xorshift64*), for demos and tests.
void fill_pattern(uint64_t addr, uint64_t len, uint64_t seed) {
  auto* p = reinterpret_cast<unsigned char*>(addr);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull;
  uint64_t i = 0;
  for (; i + 8 <= len; i += 8) {
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    uint64_t v = x * 0x2545F4914F6CDD1Dull;
    std::memcpy(p + i, &v, 8);
  }
  for (; i < len; ++i) p[i] = static_cast<unsigned char>(x >> (8 * (i & 7)));
}


// int64 values of a list or tuple of ints, or of anything numpy reads as a 1-D integer array.
std::vector<int64_t> i64_values(py::handle h) {
  std::vector<int64_t> v;
  if (PyList_Check(h.ptr()) || PyTuple_Check(h.ptr())) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(h.ptr());
    PyObject** items = PySequence_Fast_ITEMS(h.ptr());
    v.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      long long x = PyLong_AsLongLong(items[i]);
      if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
      v[static_cast<size_t>(i)] = x;
    }
    return v;
  }
  auto a = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(h);
  if (!a || a.ndim() != 1) throw KvError(E_INVALID, "expected a 1-D sequence of integers");
  v.assign(a.data(), a.data() + a.size());
  return v;
}

py::array_t<int64_t> i64_array(const std::vector<int64_t>& v) {
  py::array_t<int64_t> a(static_cast<py::ssize_t>(v.size()));
  if (!v.empty()) std::memcpy(a.mutable_data(), v.data(), v.size() * 8);
  return a;
}

// The byte ranges of a resharded KV load (kvpool.connectors.vllm.reshard.plan_columns): for every
// region pair (rows of (addr, stride, num_blocks) on each side), every block pair and every range
// of the per-block template, local = d.addr + lb * d.stride + t_loc, remote = p.addr + rb *
// p.stride + t_rem, length t_len; in that order, a range merged into the previous one where both
// sides continue it. Block ids outside any region raise before anything is returned. Returns
// (locals, remotes, lengths, total bytes). Called once per load and source rank.
py::tuple reshard_ranges(py::handle d_rows, py::handle p_rows, py::handle lblocks, py::handle rblocks,
                         py::handle t_loc, py::handle t_rem, py::handle t_len) {
  using Rows = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
  Rows d = Rows::ensure(d_rows), p = Rows::ensure(p_rows);
  if (!d || !p || d.ndim() != 2 || p.ndim() != 2 || d.shape(1) != 3 || p.shape(1) != 3 ||
      d.shape(0) != p.shape(0))
    throw KvError(E_INVALID, "region rows must be two (n, 3) integer arrays of the same length");
  const std::vector<int64_t> lb = i64_values(lblocks), rb = i64_values(rblocks);
  const std::vector<int64_t> tl = i64_values(t_loc), tr = i64_values(t_rem), tn = i64_values(t_len);
  if (lb.size() != rb.size()) throw KvError(E_INVALID, "local and remote block lists differ in length");
  if (tl.size() != tr.size() || tl.size() != tn.size()) throw KvError(E_INVALID, "template columns differ in length");
  const size_t nr = static_cast<size_t>(d.shape(0));
  const int64_t* dr = d.data();
  const int64_t* pr = p.data();
  std::vector<int64_t> lo, ro, ln;
  int64_t total = 0;
  bool bad = false;
  {
    // Short plans keep the GIL: giving it up and taking it back costs more than the loop, and
    // in a busy engine process the load thread may wait a switch interval to get it back.
    std::optional<py::gil_scoped_release> rel;
    if (nr * lb.size() * tn.size() >= (1u << 16)) rel.emplace();
    int64_t lmin = 0, lmax = -1, rmin = 0, rmax = -1;
    for (size_t b = 0; b < lb.size(); ++b) {
      if (b == 0 || lb[b] < lmin) lmin = lb[b];
      if (b == 0 || lb[b] > lmax) lmax = lb[b];
      if (b == 0 || rb[b] < rmin) rmin = rb[b];
      if (b == 0 || rb[b] > rmax) rmax = rb[b];
    }
    for (size_t r = 0; r < nr && !lb.empty(); ++r)
      bad = bad || lmin < 0 || rmin < 0 || lmax >= dr[3 * r + 2] || rmax >= pr[3 * r + 2];
    if (!bad) {
      const size_t cap = nr * lb.size() * tn.size();
      lo.reserve(cap);
      ro.reserve(cap);
      ln.reserve(cap);
      for (size_t r = 0; r < nr; ++r)
        for (size_t b = 0; b < lb.size(); ++b) {
          const int64_t lbase = dr[3 * r] + lb[b] * dr[3 * r + 1], rbase = pr[3 * r] + rb[b] * pr[3 * r + 1];
          for (size_t t = 0; t < tn.size(); ++t) {
            if (tn[t] <= 0) continue;
            const int64_t l = lbase + tl[t], m = rbase + tr[t];
            total += tn[t];
            if (!ln.empty() && lo.back() + ln.back() == l && ro.back() + ln.back() == m) {
              ln.back() += tn[t];
            } else {
              lo.push_back(l);
              ro.push_back(m);
              ln.push_back(tn[t]);
            }
          }
        }
    }
  }
  if (bad) throw KvError(E_INVALID, "block ids out of range of the KV cache");
  return py::make_tuple(i64_array(lo), i64_array(ro), i64_array(ln), total);
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  bind_ipc_plan(m);
  bind_ipc_complete(m);
  m.doc() = "kvpool native data path (TCP and same-host transports, batches, registry)";
  load_error_classes();
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const KvError& e) {
      PyErr_SetString(error_class(e.kind), e.what());
    }
  });

  using G = py::call_guard<py::gil_scoped_release>;
  py::class_<Engine>(m, "NativeEngine")
      .def(py::init([](const std::string& host, int port, const std::string& secret, int lanes,
                       uint64_t slice_size, int timeout_ms, int connect_timeout_ms, uint64_t max_frame,
                       int server_threads, int max_connections, int max_connections_per_peer,
                       int idle_timeout_ms) {
             EngineOptions o;
             o.host = host;
             o.port = static_cast<uint16_t>(port);
             o.secret = secret;
             o.lanes = lanes;
             o.slice_size = slice_size;
             o.timeout_ms = timeout_ms;
             o.connect_timeout_ms = connect_timeout_ms;
             o.max_frame = max_frame;
             o.server_threads = server_threads;
             o.max_connections = max_connections;
             o.max_connections_per_peer = max_connections_per_peer;
             o.idle_timeout_ms = idle_timeout_ms;
             return new Engine(o);
           }),
           py::arg("host"), py::arg("port"), py::arg("secret"), py::arg("lanes"), py::arg("slice_size"),
           py::arg("timeout_ms"), py::arg("connect_timeout_ms"), py::arg("max_frame"),
           py::arg("server_threads") = EngineOptions{}.server_threads,
           py::arg("max_connections") = EngineOptions{}.max_connections,
           py::arg("max_connections_per_peer") = EngineOptions{}.max_connections_per_peer,
           py::arg("idle_timeout_ms") = EngineOptions{}.idle_timeout_ms, G())
      .def_property_readonly("port", &Engine::port)
      .def_property_readonly("incarnation", &Engine::incarnation)
      .def("shutdown", &Engine::shutdown, G())
      .def("server_stats", [](Engine& e) {
        py::dict d;
        for (auto& [k, v] : e.server_stats()) d[py::str(k)] = v;
        return d;
      })
      .def("set_descriptor", [](Engine& e, py::bytes b) { e.set_descriptor(std::string(b)); })
      .def("register_memory", [](Engine& e, uint64_t a, uint64_t l, bool r, bool ro, int dev) { return e.registry().add(a, l, r, ro, dev); },
           py::arg("addr"), py::arg("length"), py::arg("remote"), py::arg("read_only") = false, py::arg("device") = -1, G())
      .def("unregister_memory", [](Engine& e, uint64_t a) { e.registry().remove(a); }, G())
      .def("registered", [](Engine& e) {
        py::list out;
        for (auto& r : e.registry().list()) out.append(py::make_tuple(r.addr, r.len, r.remote));
        return out;
      })
      .def("is_registered", [](Engine& e, uint64_t a, uint64_t l) { return e.registry().contains(a, l, false); })
      .def("add_peer", &Engine::add_peer, G())
      .def("update_peer", &Engine::update_peer, G())
      .def("set_peer_address", &Engine::set_peer_address, G())
      .def("set_peer_shm", &Engine::set_peer_shm, G())
      .def("peer_shm_count", [](Engine& e, uint64_t id) { return e.peer_shm_count(id); })
      .def("set_peer_fence", &Engine::set_peer_fence, G())
      .def("peer_fence_refused", &Engine::peer_fence_refused)
      .def_property_readonly("fence_fd", &Engine::fence_fd)
      .def("peer_stale", &Engine::peer_stale)
      .def("peer_same_host", &Engine::peer_same_host)
      .def("remove_peer", &Engine::remove_peer, G())
      .def("alloc_batch", &Engine::alloc_batch)
      .def("free_batch", &Engine::free_batch)
      .def("submit", &Engine::submit, G())
      // One op and one segment, address/length columns as contiguous uint64 arrays (numpy): the
      // columns are copied in one memcpy each instead of converted element by element.
      .def("submit_cols", [](Engine& e, uint64_t batch, uint8_t op, py::buffer locals, uint64_t peer,
                             py::buffer remotes, py::buffer lens) {
        std::vector<uint64_t> l = u64_vector(locals), r = u64_vector(remotes), n = u64_vector(lens);
        py::gil_scoped_release rel;
        return e.submit(batch, std::vector<uint8_t>(n.size(), op), l, std::vector<uint64_t>(n.size(), peer), r, n);
      })
      .def("status", &Engine::status)
      .def("slot_error", &Engine::slot_error)
      .def("batch_status", &Engine::batch_status)
      .def("wait", &Engine::wait, G())
      .def(
          "transfer_sync",
          [](Engine& e, uint8_t op, uint64_t local, uint64_t peer, uint64_t remote, uint64_t len) {
            return e.transfer_sync(op, {local}, peer, {remote}, {len});
          },
          G())
      .def("transfer_sync_ranges", &Engine::transfer_sync, G())
      // Several (peer, locals, remotes, lengths) parts, each as transfer_sync_ranges, one after
      // the other in this thread with the GIL given up once (a resharded KV load reads every
      // source rank): (status, index of the part that failed) with the first failure's status;
      // the parts after it are not started. (0, -1) when every part completed.
      .def("transfer_sync_parts",
           [](Engine& e, uint8_t op,
              const std::vector<std::tuple<uint64_t, std::vector<uint64_t>, std::vector<uint64_t>,
                                           std::vector<uint64_t>>>& parts) {
             py::gil_scoped_release rel;
             for (size_t i = 0; i < parts.size(); ++i) {
               const auto& [peer, l, r, n] = parts[i];
               if (int st = e.transfer_sync(op, l, peer, r, n)) return std::make_pair(st, static_cast<int>(i));
             }
             return std::make_pair(0, -1);
           })
      .def("transfer_sync_scratch", &Engine::transfer_sync_scratch, G())
      .def("reserve_slots", &Engine::reserve_slots)
      .def("finish_slot", &Engine::finish_slot)
      .def("finish_range", &Engine::finish_range)
      // The same two with a uint64 buffer of lengths (a numpy array): no per-element conversion.
      .def("reserve_slots_buf", [](Engine& e, uint64_t batch, py::buffer lens) {
        return e.reserve_slots(batch, u64_vector(lens));
      })
      .def("finish_range_buf", [](Engine& e, uint64_t batch, uint32_t first, py::buffer lens, int32_t st) {
        e.finish_range(batch, first, u64_vector(lens), st);
      })
      .def("fence_claim", &Engine::fence_claim)
      .def("fence_retire_begin", &Engine::fence_retire_begin)
      .def("fence_retire", &Engine::fence_retire, py::arg("slot"), py::arg("timeout_ms") = -1, G());

  // An initiator's view of a same-host target's fence table (csrc/fence.h), for copies made
  // outside the native data path (CUDA IPC): pin every slot a copy touches before it starts,
  // unpin when it finished.
  py::class_<Fence, std::shared_ptr<Fence>>(m, "FenceMap")  // shared with IpcCompleter's runs
      .def_static(
          "map", [](int pid, int fd, uint64_t owner) { return std::shared_ptr<Fence>(Fence::map(pid, fd, owner)); },
          py::arg("pid"), py::arg("fd"), py::arg("owner") = 0,
          "owner: the descriptor's incarnation (0: unchecked); another engine's table maps to None")
      .def("pin", &Fence::pin)
      .def("unpin", &Fence::unpin)
      .def("pinned", &Fence::pinned, "whether a live initiator holds a pin on the slot (tests)")
      .def_property_readonly("lane", &Fence::lane);

  m.def("fetch_descriptor", [](const std::string& host, int port, const std::string& secret, int timeout_ms) {
    std::pair<uint64_t, std::string> r;
    {
      py::gil_scoped_release rel;
      r = Engine::fetch_descriptor(host, static_cast<uint16_t>(port), secret, timeout_ms);
    }
    return py::make_tuple(r.first, py::bytes(r.second));
  });
  m.def("buffer_address", &buffer_address, py::arg("buffer"), py::arg("allow_read_only") = false,
        "(address, length) of a contiguous buffer");
  m.def("new_bytes", [](size_t n) {
    // A fresh bytes object and the address of its storage, to be filled before anyone sees it.
    PyObject* o = PyBytes_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(n));
    if (!o) throw py::error_already_set();
    auto addr = reinterpret_cast<uintptr_t>(PyBytes_AS_STRING(o));
    return py::make_tuple(py::reinterpret_steal<py::object>(o), addr);
  });
  m.def("committed_many", [](py::list shards, uint64_t mask, py::list keys) {
    // The store master's batch_exists (kvpool.store.objects.KeyTable): per key, its shard
    // shards[hash(key) & mask] (a dict), the object there and its `committed` flag; False where
    // the key is absent. Python's own hash and dict lookup, without a bytecode loop per key.
    static PyObject* name = PyUnicode_InternFromString("committed");
    const Py_ssize_t n = PyList_GET_SIZE(keys.ptr());
    const auto nshards = static_cast<uint64_t>(PyList_GET_SIZE(shards.ptr()));
    if (nshards == 0 || mask >= nshards) throw py::value_error("mask outside the shard list");
    py::list out(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* k = PyList_GET_ITEM(keys.ptr(), i);
      Py_hash_t h = PyObject_Hash(k);
      if (h == -1 && PyErr_Occurred()) throw py::error_already_set();
      PyObject* d = PyList_GET_ITEM(shards.ptr(), static_cast<Py_ssize_t>(static_cast<uint64_t>(h) & mask));
      if (!PyDict_Check(d)) throw py::type_error("shards must be dicts");
      PyObject* o = PyDict_GetItemWithError(d, k);  // borrowed
      int c = 0;
      if (o != nullptr) {
        PyObject* a = PyObject_GetAttr(o, name);
        if (a == nullptr) throw py::error_already_set();
        c = PyObject_IsTrue(a);
        Py_DECREF(a);
        if (c < 0) throw py::error_already_set();
      } else if (PyErr_Occurred()) {
        throw py::error_already_set();
      }
      PyObject* b = c ? Py_True : Py_False;
      Py_INCREF(b);
      PyList_SET_ITEM(out.ptr(), i, b);
    }
    return out;
  }, "[shards[hash(k) & mask].get(k).committed (False if absent) for k in keys], in C");
  m.def("reshard_ranges", &reshard_ranges, py::arg("d_rows"), py::arg("p_rows"), py::arg("local_blocks"),
        py::arg("remote_blocks"), py::arg("t_loc"), py::arg("t_rem"), py::arg("t_len"),
        "(locals, remotes, lengths, total bytes) of a resharded KV load from one source rank, merged");
  m.def("cuda_init", &cuda::init, G(), "Load the CUDA driver for the server's GPU staging (path '' = libcuda.so.1)");
  m.def("cuda_loaded_path", &cuda::loaded_path, "The CUDA driver cuda_init loaded ('' when none)");
  m.def("fill_pattern", &fill_pattern, G(), "Fill memory with a deterministic pseudo-random pattern");
  m.def("status_text", [](int st) { return std::string(status_text(st)); });
  m.def("encode_request", [](int op, uint32_t id, uint64_t addr, uint64_t len) {
    return py::bytes(encode_request(static_cast<uint8_t>(op), id, addr, len));
  });
  m.def("encode_hello", [](const std::string& secret, py::bytes challenge, int version) {
    return py::bytes(encode_hello(secret, std::string(challenge), static_cast<uint16_t>(version)));
  }, py::arg("secret"), py::arg("challenge"), py::arg("version") = kProtoVersion,
        "The client's 72-byte hello answering a server's 40-byte challenge (for raw-socket tests)");
  m.def("hmac_sha256", [](py::bytes key, py::bytes msg) {
    auto d = hmac_sha256(std::string(key), std::string(msg));
    return py::bytes(reinterpret_cast<const char*>(d.data()), d.size());
  });
  m.attr("CHALLENGE_SIZE") = sizeof(Challenge);
  m.attr("HELLO_OK_SIZE") = sizeof(HelloOk) + kMac;
  m.def("decode_frames", [](py::bytes data, uint64_t max_frame) {
    py::list out;
    for (auto& f : decode_frames(std::string(data), max_frame))
      out.append(py::make_tuple(f.op, f.id, f.addr, f.len, f.status));
    return out;
  });
  m.attr("PROTO_VERSION") = kProtoVersion;
  m.attr("REQ_HEADER_SIZE") = sizeof(ReqHdr);
  m.attr("RESP_HEADER_SIZE") = sizeof(RespHdr);
  m.attr("OP_WRITE") = static_cast<int>(OP_WRITE);
  m.attr("OP_READ") = static_cast<int>(OP_READ);
  m.attr("OP_GET_DESC") = static_cast<int>(OP_GET_DESC);
  m.attr("OP_PING") = static_cast<int>(OP_PING);
  m.attr("ST_TIMEOUT") = static_cast<int>(ST_TIMEOUT);
  m.attr("ST_CANCELED") = static_cast<int>(ST_CANCELED);
  m.attr("ST_TRANSPORT") = static_cast<int>(ST_TRANSPORT);
  m.attr("ST_STALE") = static_cast<int>(ST_STALE);
  m.attr("ST_REREGISTERED") = static_cast<int>(ST_REREGISTERED);
}
