// What the two linears on a weight in amx_pack_linear_weight's layout share: cpu_amx_linear.cpp
// (AMX tiles) and cpu_dpbf16_linear.cpp (AVX512-BF16 dot products).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>

#include <algorithm>
#include <cstdint>

#include "cpu_common.h"

namespace radixengine::cpu {

constexpr int64_t kTileLayoutCols = 32;   // output columns per packed block
constexpr int64_t kTileLayoutDepth = 32;  // inputs per packed K-block

struct TileLayoutShape {
  int64_t M, N, K;
  at::Tensor bias_f;  // the bias in fp32, or undefined
};

// x [M, K] bf16 against a packed weight [N / 32][K / 32][2][16][16][2] (+ bias [N]); `name`
// heads the errors.
inline TileLayoutShape check_tile_layout_linear(const at::Tensor& x, const at::Tensor& packed,
                                                const c10::optional<at::Tensor>& bias, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), name,
              ": x must be a bfloat16 CPU matrix [M, K]");
  TORCH_CHECK(packed.dim() == 6 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(), name,
              ": packed must come from amx_pack_linear_weight");
  TileLayoutShape s{x.size(0), packed.size(0) * kTileLayoutCols, x.size(1), {}};
  TORCH_CHECK(packed.size(1) * kTileLayoutDepth == s.K, name, ": x has K = ", s.K, ", the weight ",
              packed.size(1) * kTileLayoutDepth);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == s.N, name, ": bias must have N = ", s.N, " values");
    s.bias_f = bias->to(at::kFloat).contiguous();
  }
  return s;
}

// fn(nb0, nb1, m_begin, m_end) over column blocks [0, num_blocks) x rows [0, M): contiguous runs
// of column blocks, about 8 per thread (shared counter: uneven progress balances), for each chunk
// of `row_chunk` rows, chunk major: a chunk of x stays in L2 while the weight streams past it
// (without chunks, a prefill's x is read again from memory for every block).
template <typename Fn>
void run_column_block_tasks(int64_t num_blocks, int64_t M, int64_t row_chunk, const Fn& fn) {
  const int64_t target_tasks = 8 * at::get_num_threads();
  const int64_t per_task = std::max<int64_t>(1, (num_blocks + target_tasks - 1) / target_tasks);
  const int64_t column_tasks = (num_blocks + per_task - 1) / per_task;
  const int64_t row_chunks = (M + row_chunk - 1) / row_chunk;
  run_tasks(column_tasks * row_chunks, [&](int64_t task) {
    const int64_t nb0 = task % column_tasks * per_task;
    const int64_t m_begin = task / column_tasks * row_chunk;
    fn(nb0, std::min(num_blocks, nb0 + per_task), m_begin, std::min(M, m_begin + row_chunk));
  });
}

}  // namespace radixengine::cpu
