// The two products of QueryBlock (cpu_query_block.h) on AVX512-BF16 dot products, for a bf16 KV
// cache and bf16 queries on a CPU that has them and no AMX: scores straight from the pool's bf16
// keys (no widening), and P V with P rounded to bf16 (as the AMX kernels round it) against the
// key block's values repacked into pairs of keys. fp32 sums throughout.
#pragma once

#include <cstdint>

#include "cpu_vec.h"

namespace radixengine::cpu {

// Whether QueryBlock takes these products: the AVX-512 build on a CPU with AVX512-BF16, unless
// RADIXENGINE_DPBF16_ATTENTION=0 (the ablation).
bool dpbf16_attention_enabled();

// st [n][ld] = scale * K Q^T: k_rows[i] the n key rows (D bf16 values each), qp [D / 2][ld] the
// queries as bf16 pairs (pair p of query row m at qp[p * ld + m]). ld and D multiples of 16.
void dpbf16_scores(const bf16* const* k_rows, int64_t n, int64_t D, const uint32_t* qp, int64_t ld,
                   float scale, float* st);

// acc [M][D] += P V, P [M][n] held transposed in st [n][ld] and v_rows[i] the n value rows.
// scratch: at least dpbf16_accumulate_scratch(n, ld, D) words.
void dpbf16_accumulate(const float* st, int64_t n, int64_t ld, int64_t M, const bf16* const* v_rows,
                       int64_t D, float* acc, uint32_t* scratch);

inline int64_t dpbf16_accumulate_scratch(int64_t n, int64_t ld, int64_t D) { return (n + 1) / 2 * (ld + D); }

// The pair (lo, hi) of bf16 values as one 32-bit word, lo in the low half.
inline uint32_t bf16_pair(bf16 lo, bf16 hi) {
  return static_cast<uint32_t>(lo.x) | (static_cast<uint32_t>(hi.x) << 16);
}

}  // namespace radixengine::cpu
