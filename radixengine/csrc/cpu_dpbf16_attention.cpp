// QueryBlock's products on AVX512-BF16 dot products (cpu_dpbf16_attention.h). vdpbf16ps
// multiplies pairs: a score sums over pairs of head dimensions (query pairs packed once per
// block of queries, key pairs read in place), P V over pairs of keys (P and V repacked per key
// block). Register tiles of up to 4 rows x 4 vectors of 16 columns.
#include "cpu_dpbf16_attention.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "cpu_common.h"
#include "cpu_ops.h"

#if defined(__AVX512F__) && defined(__x86_64__)
#include <immintrin.h>
#define RADIX_HAVE_DPBF16_ATTENTION 1
#endif

namespace radixengine::cpu {

bool dpbf16_attention_enabled() {
#if RADIX_HAVE_DPBF16_ATTENTION
  static const bool enabled = [] {
    const char* env = std::getenv("RADIXENGINE_DPBF16_ATTENTION");
    return dpbf16_available() && !(env != nullptr && std::strcmp(env, "0") == 0);
  }();
  return enabled;
#else
  return false;
#endif
}

#if RADIX_HAVE_DPBF16_ATTENTION

#pragma GCC push_options
#pragma GCC target("avx512bf16")

namespace {

constexpr int kTile = 4;  // rows of a register tile
constexpr int kVecs = 4;  // vectors of 16 columns of a register tile

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

inline __m512i broadcast_pair(const void* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  return _mm512_set1_epi32(word);
}

// 16 pairs (a[c], b[c]) of bf16 words from 16 bf16 values each.
inline __m512i pairs_of(__m256i a, __m256i b) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

template <int KT, int CV>
void scores_tile(const bf16* const* k_rows, int64_t D, const uint32_t* qp, int64_t ld, float scale,
                 float* st, int64_t c0) {
  __m512 acc[KT][CV];
  for (int t = 0; t < KT; ++t)
    for (int v = 0; v < CV; ++v) acc[t][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    __m512i q[CV];
    for (int v = 0; v < CV; ++v) q[v] = _mm512_loadu_si512(qp + p * ld + c0 + 16 * v);
    for (int t = 0; t < KT; ++t) {
      const __m512i k = broadcast_pair(k_rows[t] + 2 * p);
      for (int v = 0; v < CV; ++v) acc[t][v] = _mm512_dpbf16_ps(acc[t][v], as_bh(k), as_bh(q[v]));
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int t = 0; t < KT; ++t)
    for (int v = 0; v < CV; ++v) _mm512_storeu_ps(st + t * ld + c0 + 16 * v, _mm512_mul_ps(acc[t][v], s));
}

// The scores of all n keys for CV vectors of query columns from c0, KT keys a tile: KT * CV
// independent accumulators, enough to keep the dot products' pipeline full.
template <int KT, int CV>
void scores_columns(const bf16* const* k_rows, int64_t n, int64_t D, const uint32_t* qp, int64_t ld, float scale,
                    float* st, int64_t c0) {
  for (int64_t i = 0; i < n; i += KT) {
    with_rows<KT>(static_cast<int>(std::min<int64_t>(KT, n - i)), [&](auto kt) {
      scores_tile<decltype(kt)::value, CV>(k_rows + i, D, qp, ld, scale, st + i * ld, c0);
    });
  }
}

template <int MT, int CV>
void pv_tile(const uint32_t* pp, int64_t pairs, int64_t ld, const uint32_t* vp, int64_t D, float* acc,
             int64_t m0, int64_t d0) {
  __m512 c[MT][CV];
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < CV; ++v) c[t][v] = _mm512_loadu_ps(acc + (m0 + t) * D + d0 + 16 * v);
  for (int64_t j = 0; j < pairs; ++j) {
    __m512i w[CV];
    for (int v = 0; v < CV; ++v) w[v] = _mm512_loadu_si512(vp + j * D + d0 + 16 * v);
    for (int t = 0; t < MT; ++t) {
      const __m512i p = _mm512_set1_epi32(static_cast<int32_t>(pp[j * ld + m0 + t]));
      for (int v = 0; v < CV; ++v) c[t][v] = _mm512_dpbf16_ps(c[t][v], as_bh(p), as_bh(w[v]));
    }
  }
  for (int t = 0; t < MT; ++t)
    for (int v = 0; v < CV; ++v) _mm512_storeu_ps(acc + (m0 + t) * D + d0 + 16 * v, c[t][v]);
}

template <int MT>
void pv_rows(const uint32_t* pp, int64_t pairs, int64_t ld, const uint32_t* vp, int64_t D, float* acc, int64_t m0) {
  int64_t d = 0;
  for (; d + 16 * kVecs <= D; d += 16 * kVecs) pv_tile<MT, kVecs>(pp, pairs, ld, vp, D, acc, m0, d);
  for (; d < D; d += 16) pv_tile<MT, 1>(pp, pairs, ld, vp, D, acc, m0, d);
}

}  // namespace

void dpbf16_scores(const bf16* const* k_rows, int64_t n, int64_t D, const uint32_t* qp, int64_t ld,
                   float scale, float* st) {
  int64_t c = 0;
  for (; c + 16 * kVecs <= ld; c += 16 * kVecs) scores_columns<kTile, kVecs>(k_rows, n, D, qp, ld, scale, st, c);
  switch ((ld - c) / 16) {  // the last columns: fewer vectors, more keys a tile
    case 3:
      return scores_columns<kTile, 3>(k_rows, n, D, qp, ld, scale, st, c);
    case 2:
      return scores_columns<2 * kTile, 2>(k_rows, n, D, qp, ld, scale, st, c);
    case 1:
      return scores_columns<2 * kTile, 1>(k_rows, n, D, qp, ld, scale, st, c);
    default:
      return;
  }
}

void dpbf16_accumulate(const float* st, int64_t n, int64_t ld, int64_t M, const bf16* const* v_rows,
                       int64_t D, float* acc, uint32_t* scratch) {
  const int64_t pairs = (n + 1) / 2;
  uint32_t* pp = scratch;              // [pairs][ld]: P of keys 2j, 2j + 1 for each query row
  uint32_t* vp = scratch + pairs * ld;  // [pairs][D]: V of keys 2j, 2j + 1 for each dimension
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t j = 0; j < pairs; ++j) {
    const bool odd_end = 2 * j + 1 == n;  // the last key has no partner: P and V of 0
    for (int64_t m = 0; m < ld; m += 16) {
      const __m256i lo = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(st + 2 * j * ld + m)));
      const __m256i hi = odd_end ? zero
                                 : reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(st + (2 * j + 1) * ld + m)));
      _mm512_storeu_si512(pp + j * ld + m, pairs_of(lo, hi));
    }
    for (int64_t d = 0; d < D; d += 16) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v_rows[2 * j] + d));
      const __m256i hi = odd_end ? zero : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v_rows[2 * j + 1] + d));
      _mm512_storeu_si512(vp + j * D + d, pairs_of(lo, hi));
    }
  }
  for (int64_t m = 0; m < M; m += kTile) {
    with_rows<kTile>(static_cast<int>(std::min<int64_t>(kTile, M - m)), [&](auto mt) {
      pv_rows<decltype(mt)::value>(pp, pairs, ld, vp, D, acc, m);
    });
  }
}

#pragma GCC pop_options

#else

void dpbf16_scores(const bf16* const*, int64_t, int64_t, const uint32_t*, int64_t, float, float*) {
  TORCH_CHECK(false, "dpbf16_scores: this build of the native kernels has no AVX512-BF16 code");
}

void dpbf16_accumulate(const float*, int64_t, int64_t, int64_t, const bf16* const*, int64_t, float*, uint32_t*) {
  TORCH_CHECK(false, "dpbf16_accumulate: this build of the native kernels has no AVX512-BF16 code");
}

#endif

}  // namespace radixengine::cpu
