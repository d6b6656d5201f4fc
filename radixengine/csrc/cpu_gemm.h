// Small register-blocked matrix products for the attention kernels.
//
//   C[i][j] (+)= sum_k A(i, k) * B(k, j)      i < M, j < N, k < K
//
// A and B are addressed through row pointers so that K/V rows can be read where they live in
// the paged pool, without gathering them into a contiguous copy first:
//   A(i, k) = a_rows[i][k * a_col_stride]   (fp32; one broadcast per element)
//   B(k, j) = b_rows[k][b_offset + j]        (fp32 or bf16, widened on load)
// C is fp32, row-major with leading dimension ldc. N must be a multiple of the vector width.
#pragma once

#include <cstdint>

#include "cpu_vec.h"

namespace radixengine::cpu {

// Rows per register tile: MR rows x NV vectors of accumulators (6 x 2 = 12 registers on AVX2,
// leaving room for the B vectors and the broadcast).
constexpr int kTileRows = 6;

template <int MR, int NV, typename BT>
inline void gemm_tile(int64_t K, const float* const* a_rows, int64_t a_col_stride,
                      const BT* const* b_rows, int64_t b_offset, float* c, int64_t ldc,
                      bool accumulate) {
  VecF acc[MR][NV];
  const float* a[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    a[i] = a_rows[i];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
      acc[i][j] = accumulate ? VecF::load(c + i * ldc + j * kVecWidth) : VecF::zero();
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    const BT* b = b_rows[k] + b_offset;
    VecF bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) bv[j] = VecF::load(b + j * kVecWidth);
    const int64_t ak = k * a_col_stride;
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const VecF av = VecF::broadcast(a[i][ak]);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[i][j] = fmadd(av, bv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) acc[i][j].store(c + i * ldc + j * kVecWidth);
  }
}

template <int NV, typename BT>
inline void gemm_rows(int64_t M, int64_t K, const float* const* a_rows, int64_t a_col_stride,
                      const BT* const* b_rows, int64_t b_offset, float* c, int64_t ldc,
                      bool accumulate) {
  int64_t i = 0;
  for (; i + kTileRows <= M; i += kTileRows) {
    gemm_tile<kTileRows, NV>(K, a_rows + i, a_col_stride, b_rows, b_offset, c + i * ldc, ldc,
                             accumulate);
  }
  const float* const* a = a_rows + i;
  float* ci = c + i * ldc;
  switch (M - i) {
    case 1: gemm_tile<1, NV>(K, a, a_col_stride, b_rows, b_offset, ci, ldc, accumulate); break;
    case 2: gemm_tile<2, NV>(K, a, a_col_stride, b_rows, b_offset, ci, ldc, accumulate); break;
    case 3: gemm_tile<3, NV>(K, a, a_col_stride, b_rows, b_offset, ci, ldc, accumulate); break;
    case 4: gemm_tile<4, NV>(K, a, a_col_stride, b_rows, b_offset, ci, ldc, accumulate); break;
    case 5: gemm_tile<5, NV>(K, a, a_col_stride, b_rows, b_offset, ci, ldc, accumulate); break;
    default: break;
  }
}

// C[M][N] (+)= A[M][K] * B[K][N]; B(k, j) = b_rows[k][b_col0 + j]. Column blocks of two
// vectors (one for an odd tail). (Four-vector blocks for the 3-row decode tiles were measured:
// 17 live registers spill on AVX2 and run slower.)
template <typename BT>
inline void gemm(int64_t M, int64_t N, int64_t K, const float* const* a_rows,
                 int64_t a_col_stride, const BT* const* b_rows, int64_t b_col0, float* c,
                 int64_t ldc, bool accumulate) {
  int64_t j = 0;
  for (; j + 2 * kVecWidth <= N; j += 2 * kVecWidth) {
    gemm_rows<2>(M, K, a_rows, a_col_stride, b_rows, b_col0 + j, c + j, ldc, accumulate);
  }
  if (j < N) {
    gemm_rows<1>(M, K, a_rows, a_col_stride, b_rows, b_col0 + j, c + j, ldc, accumulate);
  }
}

}  // namespace radixengine::cpu
