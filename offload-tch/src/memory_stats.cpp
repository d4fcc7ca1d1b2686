// libtorch's device allocator statistics for offload-tch (tch has no API for
// them): bytes allocated and reserved on one device, current and peak, as
// `torch.cuda.memory_stats()` reports them. Exceptions stay on this side.
#include <ATen/DeviceAccelerator.h>
#include <cstdint>

extern "C" int offload_tch_memory_stats(int device, int64_t* out) {
  try {
    const auto s = at::accelerator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    out[0] = s.allocated_bytes[all].current;
    out[1] = s.allocated_bytes[all].peak;
    out[2] = s.reserved_bytes[all].current;
    out[3] = s.reserved_bytes[all].peak;
    return 0;
  } catch (...) {
    return 1;
  }
}

extern "C" int offload_tch_reset_peak_stats(int device) {
  try {
    at::accelerator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
    return 0;
  } catch (...) {
    return 1;
  }
}
