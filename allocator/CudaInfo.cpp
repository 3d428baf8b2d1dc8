// Facts about CUDA devices that the allocator's callers need, without CUDA in their headers.
#include "allocator/Topology.h"

#ifdef SUPERCHIP_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace superchip {

std::string cuda_pci_bus_id(int device) {
#ifdef SUPERCHIP_HAVE_CUDA
  if (device < 0) return "";
  char id[32] = {0};
  if (cudaDeviceGetPCIBusId(id, sizeof(id), device) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky error so later calls are unaffected
    return "";
  }
  return std::string(id);
#else
  (void)device;
  return "";
#endif
}

std::pair<size_t, size_t> cuda_memory_info(int device) {
#ifdef SUPERCHIP_HAVE_CUDA
  int previous = 0;
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaGetDevice(&previous) != cudaSuccess || cudaSetDevice(device) != cudaSuccess ||
      cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) {
    (void)cudaGetLastError();
    (void)cudaSetDevice(previous);
    return {0, 0};
  }
  (void)cudaSetDevice(previous);
  return {free_bytes, total_bytes};
#else
  (void)device;
  return {0, 0};
#endif
}

}  // namespace superchip
