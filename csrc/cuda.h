// The CUDA driver, loaded at run time (dlopen): the C++ server stages GPU regions through it.
// No CUDA headers or libraries at build time; without a driver every call fails and GPU regions
// cannot be registered for the server (the Python side checks cuda::available() first).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace kvpool::cuda {

// Loads the driver at `path` (empty: libcuda.so.1) once per process; true when it initialised
// and sees at least one device. Later calls return the first outcome.
bool init(const std::string& path);
bool available();
// Page-locked host memory (cuMemHostAlloc), or nullptr.
void* host_alloc(size_t n);
void host_free(void* p);
// Synchronous copies with `device`'s primary context current on this thread; 0 or a CUresult.
int to_host(int device, void* dst, uint64_t src, size_t n);
int to_device(int device, uint64_t dst, const void* src, size_t n);

}  // namespace kvpool::cuda
