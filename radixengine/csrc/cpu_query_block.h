// Online-softmax attention of a block of query rows over key blocks read in place from the KV
// pool: the part that extend (a request's block of new tokens) and the shared-prefix units (the
// query heads of a unit's members) share. Per key block of n <= kKeyBlock keys:
//   S^T [n][ld] = K [n][D] * Q^T [D][ld]      (scores(): the caller may mask S^T after it)
//   online softmax down the columns of S^T, acc [M][D] += P [M][n] * V [n][D]   (accumulate())
// With bf16 queries and a bf16 KV cache on a CPU with AVX512-BF16 (`dp`), both products run on
// its dot products (cpu_dpbf16_attention.h); else on the fp32 register tiles of cpu_gemm.h.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_attention_common.h"
#include "cpu_common.h"
#include "cpu_dpbf16_attention.h"
#include "cpu_gemm.h"
#include "cpu_vec.h"

namespace radixengine::cpu {

template <typename KVT>
class QueryBlock {
 public:
  static constexpr int64_t kKeyBlock = 64;

  // M query rows of head size D; every row starts at zero (set_query fills them). dp: take the
  // dot-product path where it applies (bf16 queries: the caller knows them).
  QueryBlock(int64_t D, int64_t M, bool dp = false)
      : D_(D), M_(M), ld_(round_up(M, kVecWidth)), dp_(kBf16KV && dp && D % 16 == 0 && kVecWidth == 16) {
    // Scratch: Q^T [D][ld], S^T [BK][ld], acc [M][D], max/sum/alpha [ld], fp32 K/V block; on the
    // dot-product path Q as bf16 pairs [D / 2][ld] and the P / V pairs of a key block instead.
    const int64_t BK = kKeyBlock;
    const int64_t tail = dp_ ? D / 2 * ld_ + dpbf16_accumulate_scratch(BK, ld_, D) : (kConvertKV ? 2 * BK * D : 0);
    float* base = thread_scratch(D * ld_ + BK * ld_ + M * D + 3 * ld_ + tail);
    qt_ = base;
    st_ = qt_ + D * ld_;
    acc = st_ + BK * ld_;
    row_max = acc + M * D;
    row_sum = row_max + ld_;
    alpha_ = row_sum + ld_;
    k_block_ = alpha_ + ld_;
    v_block_ = k_block_ + BK * D;
    qp_ = reinterpret_cast<uint32_t*>(k_block_);
    pv_scratch_ = qp_ + D / 2 * ld_;
    thread_local std::vector<const float*> ptrs;
    ptrs.resize(D + M + 2 * BK);
    qt_rows_ = ptrs.data();
    p_rows_ = qt_rows_ + D;
    k_rows_ = p_rows_ + M;
    v_rows_f_ = k_rows_ + BK;
    if (dp_) {
      std::fill(qp_, qp_ + D / 2 * ld_, 0u);
    } else {
      std::fill(qt_, qt_ + D * ld_, 0.0f);
    }
    for (int64_t d = 0; d < D; ++d) qt_rows_[d] = qt_ + d * ld_;
    for (int64_t m = 0; m < M; ++m) p_rows_[m] = st_ + m;
    std::fill(row_max, row_max + ld_, kNegInf);
    std::fill(row_sum, row_sum + ld_, 0.0f);
    std::fill(acc, acc + M * D, 0.0f);
  }

  // Query row m = src * scale (on the dot-product path the scale applies to the scores).
  template <typename QT>
  void set_query(int64_t m, const QT* src, float scale) {
    if constexpr (std::is_same_v<QT, bf16>) {
      if (dp_) {
        scale_ = scale;
        for (int64_t p = 0; p < D_ / 2; ++p) qp_[p * ld_ + m] = bf16_pair(src[2 * p], src[2 * p + 1]);
        return;
      }
    }
    for (int64_t d = 0; d < D_; ++d) qt_[d * ld_ + m] = to_float(src[d]) * scale;
  }

  // S^T [n][ld] for the keys at positions start .. start + n - 1 of pool row `row`, kv head
  // `kv_head` (soft-capped when logit_cap > 0); the caller may set masked scores to -inf.
  float* scores(const PoolView& pool, const KVT* k_buf, const KVT* v_buf, int64_t row,
                int64_t start, int64_t n, int64_t kv_head, float logit_cap) {
    gather_rows(pool, k_buf, v_buf, row, start, n, kv_head);
    if constexpr (kBf16KV) {
      if (dp_) {
        dpbf16_scores(k_rows_kv_, n, D_, qp_, ld_, scale_, st_);
        if (logit_cap > 0.0f) soft_cap(st_, n * ld_, logit_cap);
        return st_;
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      if constexpr (kConvertKV) {
        load_scaled(k_rows_kv_[i], k_block_ + i * D_, D_, 1.0f);
        load_scaled(v_rows_[i], v_block_ + i * D_, D_, 1.0f);
        k_rows_[i] = k_block_ + i * D_;
        v_rows_f_[i] = v_block_ + i * D_;
      } else {
        k_rows_[i] = k_rows_kv_[i];
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
    if constexpr (kBf16KV) {
      if (dp_) return dpbf16_accumulate(st_, n, ld_, M_, v_rows_, D_, acc, pv_scratch_);
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
  // k_rows_kv_ / v_rows_ = kv head `kv_head` of the pool rows of positions start .. start + n - 1
  // of req_to_token row `row`, each touched once (touch_row) so that their cache misses overlap.
  void gather_rows(const PoolView& pool, const KVT* k_buf, const KVT* v_buf, int64_t row, int64_t start,
                   int64_t n, int64_t kv_head) {
    const int64_t row_stride = pool.num_kv_heads * D_;
    const int64_t head_bytes = D_ * static_cast<int64_t>(sizeof(KVT));
    uint32_t touched = 0;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t offset = slot_at(pool, row, start + i) * row_stride + kv_head * D_;
      k_rows_kv_[i] = k_buf + offset;
      v_rows_[i] = v_buf + offset;
      touched += touch_row(k_rows_kv_[i], head_bytes) + touch_row(v_rows_[i], head_bytes);
    }
    asm volatile("" : : "r"(touched));  // keep the loads
  }

  static constexpr bool kConvertKV = !std::is_same_v<KVT, float>;
  static constexpr bool kBf16KV = std::is_same_v<KVT, bf16>;
  int64_t D_, M_, ld_;
  bool dp_;
  float scale_ = 1.0f;
  uint32_t* qp_;
  uint32_t* pv_scratch_;
  const KVT* k_rows_kv_[kKeyBlock];
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
