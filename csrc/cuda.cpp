#include "cuda.h"

#include <dlfcn.h>

#include <mutex>
#include <vector>

namespace kvpool::cuda {
namespace {

using CUresult = int;
using CUdeviceptr = unsigned long long;
using CUcontext = void*;

struct Api {
  CUresult (*cuInit)(unsigned) = nullptr;
  CUresult (*cuDeviceGetCount)(int*) = nullptr;
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, int) = nullptr;
  CUresult (*cuCtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned) = nullptr;
  CUresult (*cuMemFreeHost)(void*) = nullptr;
  CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void*, size_t) = nullptr;
  CUresult (*cuMemcpyDtoH)(void*, CUdeviceptr, size_t) = nullptr;
  CUresult (*cuStreamCreate)(void**, unsigned) = nullptr;
  CUresult (*cuStreamDestroy)(void*) = nullptr;
  CUresult (*cuStreamSynchronize)(void*) = nullptr;
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, void*) = nullptr;
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, void*) = nullptr;
  CUresult (*cuEventSynchronize)(void*) = nullptr;
  CUresult (*cuEventQuery)(void*) = nullptr;
  CUresult (*cuEventRecord)(void*, void*) = nullptr;
  CUresult (*cuMemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, void*) = nullptr;
  CUresult (*cuLaunchKernel)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                             void**, void**) = nullptr;
  bool ok = false;
  int count = 0;
  std::string path;  // what init loaded
  std::mutex mu;
  std::vector<CUcontext> ctx;
};

Api g;
std::once_flag g_once;

template <class F>
bool sym(void* lib, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(lib, name));
  return *out != nullptr;
}

thread_local int t_device = -1;

bool use(int device) {
  if (!g.ok || device < 0 || device >= g.count) return false;
  if (t_device == device) return true;
  CUcontext c;
  {
    std::lock_guard lk(g.mu);
    if (g.ctx[device] == nullptr && g.cuDevicePrimaryCtxRetain(&g.ctx[device], device) != 0) return false;
    c = g.ctx[device];
  }
  if (g.cuCtxSetCurrent(c) != 0) return false;
  t_device = device;
  return true;
}

}  // namespace

bool init(const std::string& path) {
  std::call_once(g_once, [&] {
    void* lib = dlopen(path.empty() ? "libcuda.so.1" : path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) return;
    bool ok = sym(lib, "cuInit", &g.cuInit) && sym(lib, "cuDeviceGetCount", &g.cuDeviceGetCount) &&
              sym(lib, "cuDevicePrimaryCtxRetain", &g.cuDevicePrimaryCtxRetain) &&
              sym(lib, "cuCtxSetCurrent", &g.cuCtxSetCurrent) && sym(lib, "cuMemHostAlloc", &g.cuMemHostAlloc) &&
              sym(lib, "cuMemFreeHost", &g.cuMemFreeHost) && sym(lib, "cuMemcpyHtoD_v2", &g.cuMemcpyHtoD) &&
              sym(lib, "cuMemcpyDtoH_v2", &g.cuMemcpyDtoH) && sym(lib, "cuStreamCreate", &g.cuStreamCreate) &&
              sym(lib, "cuStreamDestroy_v2", &g.cuStreamDestroy) &&
              sym(lib, "cuStreamSynchronize", &g.cuStreamSynchronize) &&
              sym(lib, "cuMemcpyHtoDAsync_v2", &g.cuMemcpyHtoDAsync) &&
              sym(lib, "cuMemcpyDtoHAsync_v2", &g.cuMemcpyDtoHAsync) &&
              sym(lib, "cuEventSynchronize", &g.cuEventSynchronize) &&
              sym(lib, "cuEventQuery", &g.cuEventQuery) &&
              sym(lib, "cuEventRecord", &g.cuEventRecord) && sym(lib, "cuMemcpyAsync", &g.cuMemcpyAsync) &&
              sym(lib, "cuLaunchKernel", &g.cuLaunchKernel);
    if (ok) g.path = path.empty() ? "libcuda.so.1" : path;
    if (!ok || g.cuInit(0) != 0 || g.cuDeviceGetCount(&g.count) != 0 || g.count <= 0) return;
    g.ctx.assign(static_cast<size_t>(g.count), nullptr);
    g.ok = true;
  });
  return g.ok;
}

bool available() { return g.ok; }

std::string loaded_path() { return g.ok ? g.path : std::string(); }

void* host_alloc(size_t n) {
  if (!use(t_device >= 0 ? t_device : 0)) return nullptr;
  void* p = nullptr;
  return g.cuMemHostAlloc(&p, n, 1 /* portable */) == 0 ? p : nullptr;
}

void host_free(void* p) {
  if (g.ok && p != nullptr) g.cuMemFreeHost(p);
}

int to_host(int device, void* dst, uint64_t src, size_t n) {
  if (!use(device)) return 201;  // CUDA_ERROR_INVALID_CONTEXT
  return g.cuMemcpyDtoH(dst, src, n);
}

int to_device(int device, uint64_t dst, const void* src, size_t n) {
  if (!use(device)) return 201;
  return g.cuMemcpyHtoD(dst, src, n);
}

void* stream_create(int device) {
  if (!use(device)) return nullptr;
  void* s = nullptr;
  return g.cuStreamCreate(&s, 1 /* CU_STREAM_NON_BLOCKING */) == 0 ? s : nullptr;
}

void stream_destroy(int device, void* s) {
  if (s != nullptr && use(device)) g.cuStreamDestroy(s);
}

int to_host_async(int device, void* dst, uint64_t src, size_t n, void* stream) {
  if (!use(device)) return 201;
  return g.cuMemcpyDtoHAsync(dst, src, n, stream);
}

int to_device_async(int device, uint64_t dst, const void* src, size_t n, void* stream) {
  if (!use(device)) return 201;
  return g.cuMemcpyHtoDAsync(dst, src, n, stream);
}

int stream_sync(int device, void* stream) {
  if (!use(device)) return 201;
  return g.cuStreamSynchronize(stream);
}

int copy_async(int device, uint64_t dst, uint64_t src, size_t n, void* stream) {
  if (!use(device)) return 201;
  return g.cuMemcpyAsync(dst, src, n, stream);
}

int launch(int device, void* func, unsigned grid, unsigned block, void* stream, void** params) {
  if (!use(device)) return 201;
  return g.cuLaunchKernel(func, grid, 1, 1, block, 1, 1, 0, stream, params, nullptr);
}

int record(int device, void* event, void* stream) {
  if (!use(device)) return 201;
  return g.cuEventRecord(event, stream);
}

int event_sync(int device, void* event) {
  if (!use(device)) return kNotWaited;
  return g.cuEventSynchronize(event);
}

int event_query(int device, void* event) {
  if (!use(device)) return kNotWaited;
  return g.cuEventQuery(event);
}

bool sticky(int rc) {
  switch (rc) {
    case 700: case 702: case 714: case 715: case 716: case 717: case 718: case 719:
      return true;
    default:
      return false;
  }
}

}  // namespace kvpool::cuda
