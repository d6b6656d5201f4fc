// Online-softmax attention of a block of query rows over key blocks read in place from the KV
// pool: the part that extend (a request's block of new tokens) and the shared-prefix units (the
// query heads of a unit's members) share. Per key block of n <= kKeyBlock keys:
//   S^T [n][ld] = K [n][D] * Q^T [D][ld]      (scores(): the caller may mask S^T after it)
//   online softmax down the columns of S^T, acc [M][D] += P [M][n] * V [n][D]   (accumulate())
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_attention_common.h"
#include "cpu_common.h"
#include "cpu_gemm.h"
#include "cpu_vec.h"

namespace radixengine::cpu {

template <typename KVT>
class QueryBlock {
 public:
  static constexpr int64_t kKeyBlock = 64;

  // M query rows of head size D; every row starts at zero (set_query fills them).
  QueryBlock(int64_t D, int64_t M) : D_(D), M_(M), ld_(round_up(M, kVecWidth)) {
    // Scratch: Q^T [D][ld], S^T [BK][ld], acc [M][D], max/sum/alpha [ld], fp32 K/V block.
    const int64_t BK = kKeyBlock;
    float* base = thread_scratch(D * ld_ + BK * ld_ + M * D + 3 * ld_ + (kConvertKV ? 2 * BK * D : 0));
    qt_ = base;
    st_ = qt_ + D * ld_;
    acc = st_ + BK * ld_;
    row_max = acc + M * D;
    row_sum = row_max + ld_;
    alpha_ = row_sum + ld_;
    k_block_ = alpha_ + ld_;
    v_block_ = k_block_ + BK * D;
    thread_local std::vector<const float*> ptrs;
    ptrs.resize(D + M + 2 * BK);
    qt_rows_ = ptrs.data();
    p_rows_ = qt_rows_ + D;
    k_rows_ = p_rows_ + M;
    v_rows_f_ = k_rows_ + BK;
    std::fill(qt_, qt_ + D * ld_, 0.0f);
    for (int64_t d = 0; d < D; ++d) qt_rows_[d] = qt_ + d * ld_;
    for (int64_t m = 0; m < M; ++m) p_rows_[m] = st_ + m;
    std::fill(row_max, row_max + ld_, kNegInf);
    std::fill(row_sum, row_sum + ld_, 0.0f);
    std::fill(acc, acc + M * D, 0.0f);
  }

  // Query row m = src * scale.
  template <typename QT>
  void set_query(int64_t m, const QT* src, float scale) {
    for (int64_t d = 0; d < D_; ++d) qt_[d * ld_ + m] = to_float(src[d]) * scale;
  }

  // S^T [n][ld] for the keys at positions start .. start + n - 1 of pool row `row`, kv head
  // `kv_head` (soft-capped when logit_cap > 0); the caller may set masked scores to -inf.
  float* scores(const PoolView& pool, const KVT* k_buf, const KVT* v_buf, int64_t row,
                int64_t start, int64_t n, int64_t kv_head, float logit_cap) {
    const int64_t row_stride = pool.num_kv_heads * D_;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t offset = slot_at(pool, row, start + i) * row_stride + kv_head * D_;
      if constexpr (kConvertKV) {
        load_scaled(k_buf + offset, k_block_ + i * D_, D_, 1.0f);
        load_scaled(v_buf + offset, v_block_ + i * D_, D_, 1.0f);
        k_rows_[i] = k_block_ + i * D_;
        v_rows_f_[i] = v_block_ + i * D_;
      } else {
        k_rows_[i] = k_buf + offset;
        v_rows_[i] = v_buf + offset;
      }
    }
    gemm(n, ld_, D_, k_rows_, 1, qt_rows_, 0, st_, ld_, /*accumulate=*/false);
    if (logit_cap > 0.0f) soft_cap(st_, n * ld_, logit_cap);
    return st_;
  }

  // The online softmax of the block's n scores and acc += P * V. floor_max: see
  // softmax_columns; first: the first key block (nothing to rescale).
  void accumulate(int64_t n, bool floor_max, bool first) {
    softmax_columns(st_, n, ld_, row_max, row_sum, alpha_, floor_max);
    if (!first) {
      for (int64_t m = 0; m < M_; ++m) {
        if (alpha_[m] != 1.0f) scale_row(acc + m * D_, D_, alpha_[m]);
      }
    }
    if constexpr (kConvertKV) {
      gemm(M_, D_, n, p_rows_, ld_, v_rows_f_, 0, acc, D_, /*accumulate=*/true);
    } else {
      gemm(M_, D_, n, p_rows_, ld_, v_rows_, 0, acc, D_, /*accumulate=*/true);
    }
  }

  int64_t ld() const { return ld_; }

  float* acc;      // [M][D], not yet divided by row_sum
  float* row_max;  // [ld]
  float* row_sum;  // [ld]

 private:
  static constexpr bool kConvertKV = !std::is_same_v<KVT, float>;
  int64_t D_, M_, ld_;
  float* qt_;
  float* st_;
  float* alpha_;
  float* k_block_;
  float* v_block_;
  const float** qt_rows_;
  const float** p_rows_;
  const float** k_rows_;
  const float** v_rows_f_;
  const KVT* v_rows_[kKeyBlock];
};

}  // namespace radixengine::cpu
