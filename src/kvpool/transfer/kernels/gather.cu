// kvpool's batched copy kernel (kvpool.transfer.cuda_ipc): one launch moves n scattered ranges.
// Block b copies ranges b, b + gridDim.x, ...; 16-byte (int4) loads and stores when both ends are
// 16-byte aligned, bytes otherwise. srcs/dsts/lens are device tables of n entries each; src and
// dst may be local device memory, another process's memory mapped through CUDA IPC, or page-locked
// host memory mapped into the device's address space.
//
// Rebuild the PTX beside it (committed, loaded at run time with cuModuleLoadData so the wheel
// needs no CUDA toolkit):  nvcc -ptx -arch=compute_75 -o gather.ptx gather.cu
extern "C" __global__ void kvpool_gather(const unsigned long long* __restrict__ srcs,
                                         const unsigned long long* __restrict__ dsts,
                                         const unsigned long long* __restrict__ lens, unsigned int n) {
  for (unsigned int i = blockIdx.x; i < n; i += gridDim.x) {
    const char* s = reinterpret_cast<const char*>(srcs[i]);
    char* d = reinterpret_cast<char*>(dsts[i]);
    const unsigned long long len = lens[i];
    unsigned long long done = 0;
    if (((reinterpret_cast<unsigned long long>(s) | reinterpret_cast<unsigned long long>(d)) & 15ull) == 0) {
      const unsigned long long n16 = len >> 4;
      const int4* s4 = reinterpret_cast<const int4*>(s);
      int4* d4 = reinterpret_cast<int4*>(d);
      for (unsigned long long k = threadIdx.x; k < n16; k += blockDim.x) d4[k] = s4[k];
      done = n16 << 4;
    }
    for (unsigned long long k = done + threadIdx.x; k < len; k += blockDim.x) d[k] = s[k];
  }
}
