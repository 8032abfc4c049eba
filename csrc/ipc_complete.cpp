// Completion of CUDA IPC runs on a native thread. kvpool/transfer/cuda_ipc.py queues each run here
// right after recording its event (push, the GIL held, microseconds). This thread waits for the
// runs' events in queue order (the order their streams complete them in for one stream; a later
// run on another device waits behind an earlier one, as the Python completion thread did), then
// for each: unpins the owner's fence slots the run pinned, asks the owner's pidfd whether it
// exited during the copy and — the copy succeeded and the owner lives — completes the run's batch
// slots at once, so a synchronous caller wakes without a Python thread in between. Python's
// completion thread takes the results (wait, the GIL released) for the bookkeeping that follows
// (spare tables and events, mappings, counters) and completes a failed run's slots itself, with
// the reason.
//
// A wait that could not be made (the device's context could not be made current, or an error
// after which the stream may still run: any but a sticky one, cuda::sticky) is not an end: the
// copies may still run, so the run keeps its pins and stays queued while the thread retries (a
// backoff of 1 ms doubling to 100 ms). Past the transport's timeout it is reported timed out once
// (rc kTimedOut: Python finishes its slots TIMEOUT, "may still land"); it completes as usual once
// a wait succeeds. Abandoned meanwhile, the thread ends and leaves the pins held (a leaked pin
// delays the owner's unregister; an early unpin could hand its memory over to our copies).
//
// Lifetimes: fences are shared with Python (shared_ptr holders), the engine is kept alive by the
// Python object (keep_alive). The thread completes slots and wakes waiters outside its lock (push,
// wait and kick never queue behind them); shutdown waits until it is done with the engine. If the
// completer is destroyed while a run is still queued (a hung GPU stream at interpreter exit), the
// thread is detached and, should the stream ever end, touches neither the engine nor a pidfd (which
// may have been closed and reused) again.
#include <poll.h>
#include <sched.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cuda.h"
#include "engine.h"
#include "fence.h"

namespace py = pybind11;

namespace kvpool {
namespace {

struct IpcRun {
  uint64_t seq;
  int dev;
  void* event;
  uint64_t batch;
  uint32_t first;
  std::vector<uint64_t> lens;
  std::shared_ptr<Fence> fence;  // null: the owner has no fence table (nothing pinned)
  std::vector<int> slots;        // fence slots the run pinned
  int pidfd;                     // -1: none (the fence pin alone decides)
};

// IpcDone.rc of a run that could not be waited for within the timeout: it stays queued.
constexpr int kTimedOut = -1;

struct IpcDone {
  uint64_t seq;
  int rc;      // cuEventSynchronize's CUresult, or kTimedOut
  bool alive;  // the owner still ran when the copies had ended
};

struct IpcState {
  std::mutex mu;
  std::condition_variable work, done_cv, finished;  // finished: `finishing` went false
  std::deque<IpcRun> runs;  // the front stays queued while the thread waits for its event
  std::vector<IpcDone> done;
  Engine* engine = nullptr;  // null once abandoned
  std::chrono::milliseconds timeout{30000};  // a run not waited for this long: kTimedOut
  bool stop = false, kicked = false;
  bool finishing = false;  // the thread uses `engine` (and a pidfd) outside the lock
};

// Whether the process behind `pidfd` still runs (a pidfd turns readable when it exits). An error
// counts as exited: the run fails rather than hand over bytes of a process that may be gone.
bool owner_alive(int pidfd) {
  if (pidfd < 0) return true;
  pollfd p{pidfd, POLLIN, 0};
  int r;
  do {
    r = ::poll(&p, 1, 0);
  } while (r < 0 && errno == EINTR);
  return r == 0;
}

void complete_loop(const std::shared_ptr<IpcState>& s) {
  std::unique_lock lk(s->mu);
  for (;;) {
    s->work.wait(lk, [&] { return s->stop || !s->runs.empty(); });
    if (s->runs.empty()) return;
    const int dev = s->runs.front().dev;
    void* const event = s->runs.front().event;
    const uint64_t seq = s->runs.front().seq;
    lk.unlock();
    int rc = cuda::event_sync(dev, event);  // blocks for as long as the stream runs
    const auto start = std::chrono::steady_clock::now();
    auto pause = std::chrono::milliseconds(1);
    bool timed_out = false;
    while (rc != 0 && !cuda::sticky(rc)) {  // not waited: the copies may still run
      lk.lock();
      if (s->engine == nullptr) return;  // abandoned: the pins stay held
      if (!timed_out && std::chrono::steady_clock::now() - start >= s->timeout) {
        timed_out = true;
        s->done.push_back({seq, kTimedOut, true});
        s->done_cv.notify_all();
      }
      s->work.wait_for(lk, pause, [&] { return s->engine == nullptr; });
      lk.unlock();
      pause = std::min(pause * 2, std::chrono::milliseconds(100));
      rc = cuda::event_sync(dev, event);
    }
    lk.lock();
    IpcRun run = std::move(s->runs.front());
    s->runs.pop_front();
    Engine* const engine = s->engine;  // null: abandoned, nobody waits, the pidfd may be reused
    s->finishing = engine != nullptr;
    lk.unlock();
    // Outside the lock (push, wait and kick take it; finish_range completes up to thousands of
    // slots and wakes their waiter): shutdown waits for `finishing` before it returns.
    if (run.fence)
      for (int slot : run.slots) run.fence->unpin(slot);
    if (engine == nullptr) {
      lk.lock();
      continue;
    }
    const bool alive = rc != 0 || owner_alive(run.pidfd);
    if (rc == 0 && alive && !timed_out) {
      try {
        engine->finish_range(run.batch, run.first, run.lens, ST_OK);
      } catch (const std::exception&) {
        // the batch was freed: nobody waits for these slots any more
      }
    }
    lk.lock();
    s->finishing = false;
    s->done.push_back({run.seq, rc, alive});
    lk.unlock();
    s->finished.notify_all();
    s->done_cv.notify_all();
    lk.lock();
  }
}

// A synchronous caller's run finished in its own thread (ipc_finish_here): the caller asks the
// run's event (cuEventQuery, the GIL released) for up to min(spin_max_us, spin_min_us + 1 us per
// 10 KB of the run: about the copy's time at host-to-device speed), yielding the CPU after the first few
// asks; reached, the run ends here exactly as complete_loop ends it (the pins dropped, the owner's
// pidfd asked, a successful run's slots completed). Not reached in time, or not asked (no context;
// an error after which the stream may still run): nothing changed - the caller pushes the run to
// the completer as usual, which waits and retries (and times out) as for any run. The outcome goes
// to `out` (int64[3]: ended, CUresult, owner alive) before the call returns, so the caller acts on
// it even when a signal handler raises as the call returns (the run must then still be pushed, or
// its failure recorded). So a short run never crosses threads: no hand-off to the completion
// thread, no wake-up of the caller, its slots' lines stay in the caller's cache.
void finish_here(Engine& engine, int dev, uintptr_t event, uint64_t batch, uint32_t first,
                 const py::array_t<uint64_t, py::array::c_style | py::array::forcecast>& lens,
                 const std::shared_ptr<Fence>& fence, const std::vector<int>& slots, int pidfd,
                 int64_t spin_min_us, int64_t spin_max_us, py::array_t<int64_t, py::array::c_style>& out) {
  if (out.size() < 3) throw KvError(E_INVALID, "ipc_finish_here: out needs 3 entries");
  int64_t* const o = out.mutable_data();
  o[0] = 0;
  const std::vector<uint64_t> n(lens.data(), lens.data() + lens.size());
  uint64_t total = 0;
  for (uint64_t x : n) total += x;
  const auto budget = std::chrono::microseconds(std::min<int64_t>(
      std::max<int64_t>(spin_max_us, 0), std::max<int64_t>(spin_min_us, 0) + static_cast<int64_t>(total / 10000)));
  void* const ev = reinterpret_cast<void*>(event);
  py::gil_scoped_release rel;
  const auto deadline = std::chrono::steady_clock::now() + budget;
  int rc;
  for (int i = 0;; ++i) {
    rc = cuda::event_query(dev, ev);
    if (rc != cuda::kNotReady || std::chrono::steady_clock::now() >= deadline) break;
    if (i >= 16) sched_yield();  // a longer copy: the CPU for others (on the fake, its stream thread)
  }
  if (rc != 0 && !cuda::sticky(rc)) return;  // not ended: the caller pushes it
  if (fence)
    for (int slot : slots) fence->unpin(slot);
  const bool alive = rc != 0 || owner_alive(pidfd);
  if (rc == 0 && alive) {
    try {
      engine.finish_range(batch, first, n, ST_OK);
    } catch (const std::exception&) {
      // the batch was freed (as in complete_loop): nobody waits for these slots any more
    }
  }
  o[1] = rc;
  o[2] = alive;
  o[0] = 1;
}

class IpcCompleter {
 public:
  IpcCompleter(Engine& engine, int timeout_ms) : s_(std::make_shared<IpcState>()) {
    if (!cuda::available()) throw KvError(E_INVALID, "CUDA IPC completer: the CUDA driver is not loaded");
    s_->engine = &engine;
    s_->timeout = std::chrono::milliseconds(std::max(timeout_ms, 0));
    auto s = s_;
    thread_ = std::thread([s] { complete_loop(s); });
  }

  ~IpcCompleter() { shutdown(); }

  // Stops the thread: joined when no run is queued, else detached (a hung stream) after it was
  // told to touch neither the engine nor a pidfd again. Later pushes raise. Idempotent.
  void shutdown() {
    bool idle;
    {
      std::unique_lock lk(s_->mu);
      idle = s_->runs.empty();
      s_->stop = true;
      if (!idle) s_->engine = nullptr;
      // The thread may be completing a run with the engine (microseconds): once this returns,
      // Python may destroy the engine, so it must be done with it.
      s_->finished.wait(lk, [&] { return !s_->finishing; });
    }
    s_->work.notify_all();
    if (!thread_.joinable()) return;
    if (idle)
      thread_.join();  // at once: the thread takes no GIL and has nothing left to wait for
    else
      thread_.detach();  // waits for a hung stream; holds its own reference to the state
  }

  // A run whose event was recorded: the thread completes it after the runs queued before it.
  void push(uint64_t seq, int dev, uintptr_t event, uint64_t batch, uint32_t first,
            const py::array_t<uint64_t, py::array::c_style | py::array::forcecast>& lens,
            std::shared_ptr<Fence> fence, std::vector<int> slots, int pidfd) {
    IpcRun run{seq, dev, reinterpret_cast<void*>(event), batch, first,
               std::vector<uint64_t>(lens.data(), lens.data() + lens.size()), std::move(fence),
               std::move(slots), pidfd};
    {
      std::lock_guard lk(s_->mu);
      if (s_->stop) throw KvError(E_INVALID, "CUDA IPC completer: closed");
      s_->runs.push_back(std::move(run));
    }
    s_->work.notify_one();
  }

  // The runs completed since the last call, as (seq, CUresult, owner alive), in queue order, and
  // (seq, IPC_TIMED_OUT, True) for a run not waited for within the timeout (it stays queued);
  // waits up to timeout_ms (< 0: until one completes or kick) with the GIL released.
  py::list wait(int timeout_ms) {
    std::vector<IpcDone> out;
    {
      py::gil_scoped_release rel;
      std::unique_lock lk(s_->mu);
      auto ready = [&] { return !s_->done.empty() || s_->kicked; };
      if (timeout_ms < 0)
        s_->done_cv.wait(lk, ready);
      else
        s_->done_cv.wait_for(lk, std::chrono::milliseconds(timeout_ms), ready);
      out.swap(s_->done);
      s_->kicked = false;
    }
    py::list l;
    for (const auto& d : out) l.append(py::make_tuple(d.seq, d.rc, d.alive));
    return l;
  }

  // Wakes a wait() with nothing completed (the Python thread then looks at its own state).
  void kick() {
    {
      std::lock_guard lk(s_->mu);
      s_->kicked = true;
    }
    s_->done_cv.notify_all();
  }

  size_t queued() {
    std::lock_guard lk(s_->mu);
    return s_->runs.size();
  }

 private:
  std::shared_ptr<IpcState> s_;
  std::thread thread_;
};

}  // namespace
}  // namespace kvpool

void bind_ipc_complete(py::module_& m) {
  using kvpool::IpcCompleter;
  py::class_<IpcCompleter>(m, "IpcCompleter")
      .def(py::init<kvpool::Engine&, int>(), py::keep_alive<1, 2>(), py::arg("engine"),
           py::arg("timeout_ms") = 30000,
           "A native completion thread for CUDA IPC runs (the CUDA driver loaded: cuda_init)")
      .def("push", &IpcCompleter::push, py::arg("seq"), py::arg("dev"), py::arg("event"), py::arg("batch"),
           py::arg("first"), py::arg("lens"), py::arg("fence"), py::arg("slots"), py::arg("pidfd"))
      .def("wait", &IpcCompleter::wait, py::arg("timeout_ms"))
      .def("kick", &IpcCompleter::kick)
      .def("shutdown", &IpcCompleter::shutdown, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("queued", &IpcCompleter::queued);
  m.def("ipc_finish_here", &kvpool::finish_here, py::arg("engine"), py::arg("dev"), py::arg("event"),
        py::arg("batch"), py::arg("first"), py::arg("lens"), py::arg("fence"), py::arg("slots"),
        py::arg("pidfd"), py::arg("spin_min_us"), py::arg("spin_max_us"), py::arg("out"),
        "Wait up to min(spin_max_us, spin_min_us + 1 us per 10 KB) for a queued run's event in this "
        "thread and end the run here; out (int64[3]) = (ended, CUresult, owner alive): not ended, "
        "push it to the completer");
  m.attr("IPC_TIMED_OUT") = kvpool::kTimedOut;
}
