// Memory-bandwidth probe for benchmarks: a STREAM-style triad done in place,
// a[i] = a[i] + s * b[i] (DAXPY's pattern), split over a ThreadPool in 64 KiB ranges.
// In place because every byte it counts is a byte the memory system moves: 12 bytes per
// element (two reads, one write to a line just read). STREAM's a = b + s*c counts 12 but
// moves 16 (the write-allocate read of a), and the optimizer kernels it is the floor for
// only write lines they have read. n == 0 is a no-op; arrays must not overlap.
#pragma once

#include <cstdint>

namespace superchip::ops {

class ThreadPool;

void stream_triad_inplace(float* a, const float* b, float s, int64_t n, ThreadPool* pool = nullptr);

// The optimizer's own traffic with next to no arithmetic: reads p, g, m, v and writes p, m, v
// (28 bytes per element, what a fused fp32 AdamW step must move). Its time is the floor an
// AdamW kernel is judged against on this machine.
void adam_traffic_floor(float* p, const float* g, float* m, float* v, int64_t n,
                        ThreadPool* pool = nullptr);

}  // namespace superchip::ops
