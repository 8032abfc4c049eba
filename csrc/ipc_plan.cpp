// Per-request work of a CUDA IPC run, in one pass each (kvpool/transfer/cuda_ipc.py calls these
// on every submit; with 4,096 scattered KV blocks a dozen numpy passes cost more than the copy).
// Errors are kvpool's (KvError: InvalidArgument for a bad column, RemoteAccessError for a range
// outside the peer's mapped buffers).
//
// ipc_classify: where each request's local range lies in our registrations and its remote range
// in the peer's published buffers (both tables sorted by start, as the Python side keeps them).
// ipc_addresses: the source and destination device addresses of a run, from the peer buffers'
// mapped bases (the gather kernel's table, or the cuMemcpyAsync arguments).
// ipc_enqueue: a whole run queued in one call — addresses, batch slots, the copies or one gather
// launch, the event — through the CUDA driver the native side loaded (csrc/cuda.cpp; the same
// library as the Python side's, so streams, events and kernels are shared). The first two are
// pure functions (the GIL held, microseconds); ipc_enqueue gives the GIL up while it queues.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda.h"
#include "engine.h"
#include "wire.h"

namespace py = pybind11;

namespace {

template <typename T>
const T* column(const py::buffer_info& b, py::ssize_t n, const char* what) {
  if (b.ndim != 1 || b.itemsize != static_cast<py::ssize_t>(sizeof(T)) || b.shape[0] != n ||
      (n > 1 && b.strides[0] != static_cast<py::ssize_t>(sizeof(T))))
    throw kvpool::KvError(kvpool::E_INVALID, std::string("ipc plan: bad column ") + what);
  return static_cast<const T*>(b.ptr);
}

// Index of the last start <= a in sorted `starts` (m entries), or -1.
inline int64_t last_le(const uint64_t* starts, int64_t m, uint64_t a) {
  return static_cast<int64_t>(std::upper_bound(starts, starts + m, a) - starts) - 1;
}

// last_le, first trying `hint` (the previous request's answer: a run's ranges mostly lie in one
// registration and one peer buffer, so the search is skipped for them). Same answer either way.
inline int64_t last_le_from(const uint64_t* starts, int64_t m, uint64_t a, int64_t hint) {
  if (hint >= 0 && starts[hint] <= a && (hint + 1 == m || a < starts[hint + 1])) return hint;
  return last_le(starts, m, a);
}

// Codes of ipc_classify's first result.
constexpr int OK = 0, NOT_REGISTERED = 1, READ_ONLY = 2, GPU_PAST_END = 3;
constexpr uint8_t READ_OP = kvpool::OP_READ;  // kvpool.transfer.transport.READ

// (code, index of the first bad request, local_gpu bool[n], ridx int64[n], ipc bool[n],
// staged: some local GPU range goes to a peer range no GPU copy reaches, all_inside: every remote
// range lies in a peer buffer, n_ipc: how many requests are ipc).
// strict: every local range must lie in a registration (and a READ not into read-only memory);
// else (needs_staging's view) only a range starting in GPU memory and running past it is an error.
py::tuple ipc_classify(py::buffer ops_b, py::buffer locs_b, py::buffer rems_b, py::buffer lens_b,
                       py::buffer rs_b, py::buffer re_b, py::buffer ro_b, py::buffer rg_b, py::buffer ps_b,
                       py::buffer pe_b, py::buffer pg_b, bool strict) {
  auto lb = locs_b.request();
  const py::ssize_t n = lb.ndim == 1 ? lb.shape[0] : -1;
  auto ob = ops_b.request(), rb = rems_b.request(), nb = lens_b.request();
  auto rsb = rs_b.request(), reb = re_b.request(), rob = ro_b.request(), rgb = rg_b.request();
  auto psb = ps_b.request(), peb = pe_b.request(), pgb = pg_b.request();
  const auto m = rsb.shape[0], p = psb.shape[0];
  const uint8_t* ops = ob.size == 0 ? nullptr : column<uint8_t>(ob, n, "ops");  // none: all WRITEs
  const uint64_t* locs = column<uint64_t>(lb, n, "locs");
  const uint64_t* rems = column<uint64_t>(rb, n, "rems");
  const uint64_t* lens = column<uint64_t>(nb, n, "lens");
  const uint64_t* rs = column<uint64_t>(rsb, m, "registration starts");
  const uint64_t* re = column<uint64_t>(reb, m, "registration ends");
  const uint8_t* ro = column<uint8_t>(rob, m, "registration read-only flags");
  const uint8_t* rg = column<uint8_t>(rgb, m, "registration gpu flags");
  const uint64_t* ps = column<uint64_t>(psb, p, "peer starts");
  const uint64_t* pe = column<uint64_t>(peb, p, "peer ends");
  const uint8_t* pg = column<uint8_t>(pgb, p, "peer gpu flags");
  py::array_t<bool> local_gpu(n), ipc(n);
  py::array_t<int64_t> ridx(n);
  bool* lg = local_gpu.mutable_data();
  bool* ip = ipc.mutable_data();
  int64_t* ri = ridx.mutable_data();
  int code = OK;
  int64_t bad = -1;
  bool staged = false, all_inside = true;
  int64_t n_ipc = 0;
  int64_t i = -1, r = -1;  // the previous request's registration and peer buffer (hints)
  for (py::ssize_t k = 0; k < n; ++k) {
    const uint64_t a = locs[k], len = lens[k], end = a + len;
    i = last_le_from(rs, m, a, i);
    const bool in_reg = i >= 0 && a < re[i];
    const bool gpu = in_reg && rg[i];
    if (code == OK) {
      if (strict && !(i >= 0 && end <= re[i] && end >= a)) {
        code = NOT_REGISTERED;
      } else if (gpu && (end > re[i] || end < a)) {
        code = GPU_PAST_END;
      } else if (strict && ro[i] && ops != nullptr && ops[k] == READ_OP) {
        code = READ_ONLY;
      }
      if (code != OK) bad = k;
    }
    r = last_le_from(ps, p, rems[k], r);
    const uint64_t rend = rems[k] + len;
    const bool inside = r >= 0 && rend <= pe[r] && rend >= rems[k];
    lg[k] = gpu;
    ri[k] = r;
    ip[k] = (inside && pg[r]) || (gpu && inside);
    n_ipc += ip[k];
    staged = staged || (gpu && !inside);
    all_inside = all_inside && inside;
  }
  return py::make_tuple(code, bad, local_gpu, ridx, ipc, staged, all_inside, n_ipc);
}

// Source and destination of each request (src[k], dst[k]): the remote side of request k is
// bases[ridx[k]] + (rems[k] - starts[ridx[k]]), the source for a WRITE, the destination for a READ.
// RemoteAccessError for a request outside the peer's mapped buffers (nothing written).
void fill_addresses(py::ssize_t n, const uint8_t* ops, const uint64_t* locs, const uint64_t* rems,
                    const int64_t* ridx, py::ssize_t p, const uint64_t* bases, const uint64_t* starts,
                    uint64_t* src, uint64_t* dst) {
  for (py::ssize_t k = 0; k < n; ++k)
    if (ridx[k] < 0 || ridx[k] >= p || bases[ridx[k]] == 0)
      throw kvpool::KvError(kvpool::E_REMOTE_ACCESS, "ipc plan: request outside the peer's mapped buffers");
  for (py::ssize_t k = 0; k < n; ++k) {
    const uint64_t remote = bases[ridx[k]] + (rems[k] - starts[ridx[k]]);
    const bool reading = ops[k] == READ_OP;
    src[k] = reading ? remote : locs[k];
    dst[k] = reading ? locs[k] : remote;
  }
}

// Writes src[n] then dst[n] (uint64) at `out` (a buffer of >= 2n uint64), as fill_addresses.
void ipc_addresses(py::buffer ops_b, py::buffer locs_b, py::buffer rems_b, py::buffer ridx_b, py::buffer bases_b,
                   py::buffer starts_b, uint64_t out) {
  auto lb = locs_b.request();
  const py::ssize_t n = lb.ndim == 1 ? lb.shape[0] : -1;
  auto ob = ops_b.request(), rb = rems_b.request(), ib = ridx_b.request(), bb = bases_b.request(),
       sb = starts_b.request();
  const auto p = bb.shape[0];
  auto* src = reinterpret_cast<uint64_t*>(static_cast<uintptr_t>(out));
  fill_addresses(n, column<uint8_t>(ob, n, "ops"), column<uint64_t>(lb, n, "locs"),
                 column<uint64_t>(rb, n, "rems"), column<int64_t>(ib, n, "ridx"), p,
                 column<uint64_t>(bb, p, "bases"), column<uint64_t>(sb, p, "starts"), src, src + n);
}

// What a run's queueing needs besides its columns: where (device, stream), how (the gather kernel
// `func` with its device table `dtab` and pinned host table `htab` of `table_bytes`, or func == 0:
// one cuMemcpyAsync per request) and the event recorded after the copies.
struct RunTarget {
  int dev;
  uintptr_t stream, func, dtab, htab;
  uint64_t table_bytes;
  unsigned block, max_grid;
  uintptr_t event;
};

// One CUDA IPC run, queued in one call: the copies' addresses (fill_addresses), the batch slots
// (reserved here, one per request), then, the GIL released, the copies on the stream — the address
// table to the device and one kvpool_gather launch, or one cuMemcpyAsync per request — and the
// event. Its outcome goes to `out` (uint64[5]: reserved, first slot, lo, hi, rc) as it happens, so
// the caller acts on it even when a signal handler raises as this returns: reserved = the slots
// were taken (from then on the run exists); [lo, hi) the local addresses the copies touch; rc != 0
// (a CUresult) when a copy, launch or record failed to queue after the slots were reserved: the
// caller settles the stream and fails the slots. Returns the name of that failed call ("" when
// none). Raises with nothing reserved or queued for bad columns, a request outside the peer's
// mapped buffers, a table too small or a batch without room.
std::string ipc_enqueue(kvpool::Engine& eng, uint64_t batch, const RunTarget& t, py::buffer ops_b, py::buffer locs_b,
                      py::buffer rems_b, py::buffer lens_b, py::buffer ridx_b, py::buffer bases_b,
                      py::buffer starts_b, py::array_t<uint64_t, py::array::c_style>& out) {
  if (out.size() < 5) throw kvpool::KvError(kvpool::E_INVALID, "ipc run: out needs 5 entries");
  uint64_t* const o = out.mutable_data();
  o[0] = 0;
  auto lb = locs_b.request();
  const py::ssize_t n = lb.ndim == 1 ? lb.shape[0] : -1;
  auto ob = ops_b.request(), rb = rems_b.request(), nb = lens_b.request(), ib = ridx_b.request(),
       bb = bases_b.request(), sb = starts_b.request();
  const auto p = bb.shape[0];
  const uint8_t* ops = column<uint8_t>(ob, n, "ops");
  const uint64_t* locs = column<uint64_t>(lb, n, "locs");
  const uint64_t* rems = column<uint64_t>(rb, n, "rems");
  const uint64_t* lens = column<uint64_t>(nb, n, "lens");
  const int64_t* ridx = column<int64_t>(ib, n, "ridx");
  const uint64_t* bases = column<uint64_t>(bb, p, "bases");
  const uint64_t* starts = column<uint64_t>(sb, p, "starts");
  if (n == 0) throw kvpool::KvError(kvpool::E_INVALID, "ipc run: no requests");
  const bool kernel = t.func != 0;
  const uint64_t need = 24ull * static_cast<uint64_t>(n);
  if (kernel && (t.htab == 0 || t.dtab == 0 || t.table_bytes < need))
    throw kvpool::KvError(kvpool::E_INVALID, "ipc run: address table too small");
  std::vector<uint64_t> scratch;
  uint64_t* src;
  if (kernel) {
    src = reinterpret_cast<uint64_t*>(t.htab);  // the kernel's table: src[n], dst[n], lens[n]
  } else {
    scratch.resize(2 * static_cast<size_t>(n));
    src = scratch.data();
  }
  uint64_t* dst = src + n;
  fill_addresses(n, ops, locs, rems, ridx, p, bases, starts, src, dst);
  uint64_t lo = UINT64_MAX, hi = 0;
  for (py::ssize_t k = 0; k < n; ++k) {
    lo = std::min(lo, locs[k]);
    hi = std::max(hi, locs[k] + lens[k]);
  }
  const std::vector<uint64_t> lv(lens, lens + n);
  const uint32_t first = eng.reserve_slots(batch, lv);
  // From here on the run exists (slots reserved, then copies queued).
  o[1] = first;
  o[2] = lo;
  o[3] = hi;
  o[4] = 0;
  o[0] = 1;
  int rc = 0;
  const char* what = "";
  {
    py::gil_scoped_release rel;
    void* stream = reinterpret_cast<void*>(t.stream);
    if (kernel) {
      std::copy(lens, lens + n, dst + n);
      rc = kvpool::cuda::to_device_async(t.dev, t.dtab, src, need, stream);
      what = "cuMemcpyHtoDAsync (address table)";
      if (rc == 0) {
        unsigned long long a0 = t.dtab, a1 = t.dtab + 8ull * n, a2 = t.dtab + 16ull * n;
        unsigned a3 = static_cast<unsigned>(n);
        void* params[] = {&a0, &a1, &a2, &a3};
        const auto grid = static_cast<unsigned>(std::min<py::ssize_t>(n, t.max_grid));
        rc = kvpool::cuda::launch(t.dev, reinterpret_cast<void*>(t.func), grid, t.block, stream, params);
        what = "cuLaunchKernel";
      }
    } else {
      what = "cuMemcpyAsync";
      for (py::ssize_t k = 0; k < n && rc == 0; ++k) rc = kvpool::cuda::copy_async(t.dev, dst[k], src[k], lens[k], stream);
    }
    if (rc == 0) {
      rc = kvpool::cuda::record(t.dev, reinterpret_cast<void*>(t.event), stream);
      what = "cuEventRecord";
    }
  }
  o[4] = static_cast<uint64_t>(rc);
  return rc == 0 ? "" : what;
}

// A list or tuple of Python ints as a new uint64 array, in one pass over the items (numpy's
// generic conversion costs ~15-25 ns an item: 0.2-0.3 ms for the three columns of 4,096 KV
// blocks); None for anything else (another sequence type, an item that is not exactly an int -
// a bool, an int subclass with its own __index__ -, a negative one or one past 2**63): the caller
// then converts it the general way, which names what is wrong.
py::object u64_column(py::handle seq) {
  PyObject* o = seq.ptr();
  if (!PyList_Check(o) && !PyTuple_Check(o)) return py::none();
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
  py::array_t<uint64_t> out(n);
  uint64_t* d = out.mutable_data();
  PyObject** items = PySequence_Fast_ITEMS(o);  // the GIL is held: the sequence cannot change
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyLong_CheckExact(items[i])) return py::none();  // bool, int subclasses: numpy's way
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(items[i], &overflow);
    if (overflow != 0 || v < 0) {
      if (PyErr_Occurred()) PyErr_Clear();
      return py::none();
    }
    d[i] = static_cast<uint64_t>(v);
  }
  return std::move(out);
}

}  // namespace

void bind_ipc_plan(py::module_& m) {
  m.def("u64_column", &u64_column,
        "A list or tuple of non-negative ints (< 2**63) as a new uint64 array; None for anything else");
  m.def("ipc_classify", &ipc_classify,
        "CUDA IPC run planning: (code, bad index, local_gpu, ridx, ipc, staged, all_inside, n_ipc) of "
        "request columns");
  m.def("ipc_addresses", &ipc_addresses, "CUDA IPC run planning: src then dst addresses written at out");
  py::class_<RunTarget>(m, "IpcRunTarget")
      .def(py::init([](int dev, uintptr_t stream, uintptr_t func, uintptr_t dtab, uintptr_t htab, uint64_t table_bytes,
                       unsigned block, unsigned max_grid, uintptr_t event) {
             return RunTarget{dev, stream, func, dtab, htab, table_bytes, block, max_grid, event};
           }),
           py::arg("dev"), py::arg("stream"), py::arg("func"), py::arg("dtab"), py::arg("htab"), py::arg("table_bytes"),
           py::arg("block"), py::arg("max_grid"), py::arg("event"));
  m.def("ipc_enqueue", &ipc_enqueue,
        "Queue one CUDA IPC run (addresses, slots, copies or one gather launch, event): "
        "out (uint64[5]) = (slots reserved, first slot, lo, hi, rc); returns the failed call's name or \"\"");
}
