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
// The path init loaded (libcuda.so.1 for an empty one), or "" when it did not.
std::string loaded_path();
// Page-locked host memory (cuMemHostAlloc), or nullptr.
void* host_alloc(size_t n);
void host_free(void* p);
// Synchronous copies with `device`'s primary context current on this thread; 0 or a CUresult.
int to_host(int device, void* dst, uint64_t src, size_t n);
int to_device(int device, uint64_t dst, const void* src, size_t n);

// Asynchronous copies on a stream of `device` (the server's pipelined staging): the copy of one
// piece runs while the previous piece goes through the socket. 0 or a CUresult.
void* stream_create(int device);          // nullptr on failure
void stream_destroy(int device, void* s);
int to_host_async(int device, void* dst, uint64_t src, size_t n, void* stream);
int to_device_async(int device, uint64_t dst, const void* src, size_t n, void* stream);
int stream_sync(int device, void* stream);  // waits for the stream's copies; their first error
// A CUDA IPC run (csrc/ipc_plan.cpp): a copy between any two addresses (unified addressing), a
// kernel launch on a 1-D grid (params: the kernel's arguments, as cuLaunchKernel takes them) and an
// event record, on `stream`. 0 or a CUresult.
int copy_async(int device, uint64_t dst, uint64_t src, size_t n, void* stream);
int launch(int device, void* func, unsigned grid, unsigned block, void* stream, void** params);
int record(int device, void* event, void* stream);
// Waits for an event recorded by the Python side's driver (the same library: dlopen returns the
// handle it loaded) with `device`'s primary context current; 0, a CUresult (the stream's error),
// or kNotWaited: the context could not be made current, nothing was waited for.
constexpr int kNotWaited = -1;
int event_sync(int device, void* event);
// Whether an event was reached, without waiting: 0, kNotReady (its stream has not got there yet),
// kNotWaited (no context, as for event_sync) or the stream's error.
constexpr int kNotReady = 600;  // CUDA_ERROR_NOT_READY
int event_query(int device, void* event);
// Whether a CUresult is sticky: the context is dead ("the process is left in an inconsistent
// state and any further CUDA work will return the same error", CUDA driver API docs), so none of
// its work runs any more. Only these end a wait for copies that may still run: 700 ILLEGAL_ADDRESS,
// 702 LAUNCH_TIMEOUT, 714 HARDWARE_STACK_ERROR, 715 ILLEGAL_INSTRUCTION, 716 MISALIGNED_ADDRESS,
// 717 INVALID_ADDRESS_SPACE, 718 INVALID_PC, 719 LAUNCH_FAILED.
bool sticky(int rc);

}  // namespace kvpool::cuda
