// Shared helpers for the CPU kernels: input checks, dtype dispatch, task scheduling and
// per-thread scratch memory.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace radixengine::cpu {

// Runs fn(task) for task in [0, num_tasks) on the intra-op thread pool. Threads take tasks from
// a shared counter, so tasks of uneven cost balance out (callers order them longest first).
template <typename Fn>
void run_tasks(int64_t num_tasks, const Fn& fn) {
  if (num_tasks <= 0) return;
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_tasks);
  if (num_threads <= 1 || at::in_parallel_region()) {
    for (int64_t t = 0; t < num_tasks; ++t) fn(t);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, num_threads, 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1, std::memory_order_relaxed); t < num_tasks;
         t = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(t);
    }
  });
}

// fn(std::integral_constant<int, n>) for a runtime n in [1, N]: a register tile's row count
// made a compile-time constant, so that its accumulators stay in registers.
template <int N, typename Fn>
void with_rows(int n, Fn&& fn) {
  if constexpr (N > 1) {
    if (n < N) return with_rows<N - 1>(n, fn);
  }
  fn(std::integral_constant<int, N>{});
}

// Per-thread scratch buffer of fp32 (grows, never shrinks).
inline float* thread_scratch(size_t num_floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < num_floats) buffer.resize(num_floats);
  return buffer.data();
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Integer index tensors may arrive as int32 or int64; the kernels read int64.
inline at::Tensor as_int64(const at::Tensor& t) {
  return t.scalar_type() == at::kLong ? t.contiguous() : t.to(at::kLong).contiguous();
}

// One case of a dtype switch: runs the body with T = TYPE.
#define RADIX_DISPATCH_CASE(ENUM, TYPE, T, ...) \
  case ENUM: {                                  \
    using T = TYPE;                             \
    return __VA_ARGS__();                       \
  }

// Calls the body with T = float or bf16 for the given dtype.
#define RADIX_DISPATCH_FLOAT_BF16(DTYPE, NAME, T, ...)                                      \
  [&] {                                                                                     \
    switch (DTYPE) {                                                                        \
      RADIX_DISPATCH_CASE(at::kFloat, float, T, __VA_ARGS__)                                \
      RADIX_DISPATCH_CASE(at::kBFloat16, ::radixengine::cpu::bf16, T, __VA_ARGS__)          \
      default:                                                                              \
        TORCH_CHECK(false, NAME, ": unsupported dtype ", DTYPE, " (float32 or bfloat16)");  \
    }                                                                                       \
  }()

// The same for a KV cache buffer: T = float, bf16 or fp16.
#define RADIX_DISPATCH_KV(DTYPE, NAME, T, ...)                                          \
  [&] {                                                                                 \
    switch (DTYPE) {                                                                    \
      RADIX_DISPATCH_CASE(at::kFloat, float, T, __VA_ARGS__)                            \
      RADIX_DISPATCH_CASE(at::kBFloat16, ::radixengine::cpu::bf16, T, __VA_ARGS__)      \
      RADIX_DISPATCH_CASE(at::kHalf, ::radixengine::cpu::fp16, T, __VA_ARGS__)          \
      default:                                                                          \
        TORCH_CHECK(false, NAME, ": unsupported KV dtype ", DTYPE,                      \
                    " (float32, bfloat16 or float16)");                                 \
    }                                                                                   \
  }()

}  // namespace radixengine::cpu
