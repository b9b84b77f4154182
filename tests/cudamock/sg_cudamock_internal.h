// What the NCCL mock (sg_ncclmock.cpp) needs from the CUDA mock (sg_cudamock.cpp): the global
// lock, and gated stream items: a collective's item on each rank's stream completes when its
// gate says so (when every rank's stream has reached its own item and the data has moved).
#ifndef SG_CUDAMOCK_INTERNAL_H
#define SG_CUDAMOCK_INTERNAL_H

#include <cstdint>
#include <functional>
#include <mutex>

#include "cuda_runtime.h"

std::recursive_mutex &sg_cudamock_lock();
// Queues a gated item on s; returns its position (the number of items before it).
uint64_t sg_cudamock_push_gate(cudaStream_t s, std::function<bool()> gate);
// Advances s until the item at `pos` is next; true when it is (everything before it done).
bool sg_cudamock_at(cudaStream_t s, uint64_t pos);
bool sg_cudamock_valid_stream(cudaStream_t s);
// Counts one collective of the calling thread (sg_cudamock_thread_calls("collective")).
void sg_cudamock_count_collective();

#endif  // SG_CUDAMOCK_INTERNAL_H
