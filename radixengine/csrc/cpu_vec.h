// A minimal fp32 SIMD vector for the CPU kernels.
//
// The instruction set is picked at compile time by the flags of the level being built (setup.py
// builds every level; radixengine/utils/cpu_isa.py has the flags): AVX-512F (16 lanes), AVX2 +
// FMA (8 lanes), or a portable fallback (8 lanes of plain loops that the compiler may still
// vectorize for the baseline). bfloat16 and float16 data (a KV cache stored in
// 16 bits) are widened to fp32 on load; all arithmetic is fp32.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace radixengine::cpu {

using bf16 = c10::BFloat16;
using fp16 = c10::Half;

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return static_cast<float>(x); }
inline float to_float(fp16 x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);  // c10::BFloat16 and c10::Half round to nearest even
}

// exp(x) range constants shared by all implementations: below kExpLo the result is 0, above
// kExpHi it saturates at exp(kExpHi) (scores are max-subtracted, so that never happens here).
// exp(NaN) is NaN, as std::exp: a NaN score (a NaN in a K row) must reach the output, as it does
// in the reference. The clamps put x second in max/min, whose NaN rule returns the second
// operand, so a NaN goes through the polynomial unchanged.
constexpr float kExpLo = -87.33654f;
constexpr float kExpHi = 88.37626f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
// Taylor coefficients of e^r on |r| <= ln2/2 (degree 7 keeps the error below 1 ulp of fp32).
constexpr float kExpC2 = 1.0f / 2;
constexpr float kExpC3 = 1.0f / 6;
constexpr float kExpC4 = 1.0f / 24;
constexpr float kExpC5 = 1.0f / 120;
constexpr float kExpC6 = 1.0f / 720;
constexpr float kExpC7 = 1.0f / 5040;

#if defined(__AVX512F__)

constexpr const char* kIsaName = "avx512";

struct VecF {
  static constexpr int kWidth = 16;
  __m512 v;

  static VecF zero() { return {_mm512_setzero_ps()}; }
  static VecF broadcast(float x) { return {_mm512_set1_ps(x)}; }
  static VecF load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static VecF load(const bf16* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
  }
  static VecF load(const fp16* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(fp16* p) const {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  // The bfloat16 bit patterns (round to nearest even, NaN kept quiet) in the high halves.
  __m512i bf16_bits() const {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                                 _mm512_set1_epi32(0x7fc00000));
  }
  void store(bf16* p) const {
    const __m512i r = _mm512_srli_epi32(bf16_bits(), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  VecF round_bf16() const {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    return {_mm512_castsi512_ps(_mm512_and_si512(bf16_bits(), high))};
  }
};

inline VecF operator+(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VecF operator-(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline VecF operator*(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VecF operator/(VecF a, VecF b) { return {_mm512_div_ps(a.v, b.v)}; }
inline VecF fmadd(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline VecF vmax(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float hsum(VecF a) { return _mm512_reduce_add_ps(a.v); }
inline float hmax(VecF a) { return _mm512_reduce_max_ps(a.v); }

// out[i] = hsum(v[i]) for four vectors.
inline void hsum4(const VecF* v, float* out) {
  __m256 h[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v[i].v), 1));
    h[i] = _mm256_add_ps(_mm512_castps512_ps256(v[i].v), hi);
  }
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

inline VecF vexp(VecF x) {
  const __m512 lo = _mm512_set1_ps(kExpLo);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x.v, lo, _CMP_LT_OQ);  // false for NaN
  __m512 xc = _mm512_min_ps(_mm512_set1_ps(kExpHi), _mm512_max_ps(lo, x.v));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(kLog2e)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpC7);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC5));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i biased = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  const __m512i e = _mm512_slli_epi32(biased, 23);
  __m512 result = _mm512_mul_ps(p, _mm512_castsi512_ps(e));
  return {_mm512_mask_mov_ps(result, underflow, _mm512_setzero_ps())};
}

#elif defined(__AVX2__) && defined(__FMA__)

constexpr const char* kIsaName = "avx2";

struct VecF {
  static constexpr int kWidth = 8;
  __m256 v;

  static VecF zero() { return {_mm256_setzero_ps()}; }
  static VecF broadcast(float x) { return {_mm256_set1_ps(x)}; }
  static VecF load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static VecF load(const bf16* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(w, 16))};
  }
  static VecF load(const fp16* p) {
#if defined(__F16C__)
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))};
#else
    alignas(32) float f[8];
    for (int i = 0; i < 8; ++i) f[i] = static_cast<float>(p[i]);
    return {_mm256_load_ps(f)};
#endif
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(fp16* p) const {
#if defined(__F16C__)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    alignas(32) float f[8];
    _mm256_store_ps(f, v);
    for (int i = 0; i < 8; ++i) p[i] = fp16(f[i]);
#endif
  }
  // The bfloat16 bit patterns (round to nearest even, NaN kept quiet) in the high halves.
  __m256i bf16_bits() const {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), nan);
  }
  VecF round_bf16() const {
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    return {_mm256_castsi256_ps(_mm256_and_si256(bf16_bits(), high))};
  }
  void store(bf16* p) const {
    const __m256i r = _mm256_srli_epi32(bf16_bits(), 16);
    // Pack the eight 32-bit lanes to 16 bits (packus works per 128-bit half; reorder after).
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
};

inline VecF operator+(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
inline VecF operator-(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
inline VecF operator*(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline VecF operator/(VecF a, VecF b) { return {_mm256_div_ps(a.v, b.v)}; }
inline VecF fmadd(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
inline VecF vmax(VecF a, VecF b) { return {_mm256_max_ps(a.v, b.v)}; }

inline float hsum(VecF a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[i] = hsum(v[i]) for four vectors.
inline void hsum4(const VecF* v, float* out) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(v[0].v, v[1].v), _mm256_hadd_ps(v[2].v, v[3].v));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}

inline float hmax(VecF a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline VecF vexp(VecF x) {
  const __m256 lo = _mm256_set1_ps(kExpLo);
  const __m256 keep = _mm256_cmp_ps(x.v, lo, _CMP_NLT_UQ);  // false for x < lo, true for NaN
  __m256 xc = _mm256_min_ps(_mm256_set1_ps(kExpHi), _mm256_max_ps(lo, x.v));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(kLog2e)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpC7);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC5));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  const __m256i e = _mm256_slli_epi32(biased, 23);
  __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  return {_mm256_and_ps(result, keep)};
}

#else

constexpr const char* kIsaName = "portable";

struct VecF {
  static constexpr int kWidth = 8;
  float v[kWidth];

  static VecF zero() { return broadcast(0.0f); }
  static VecF broadcast(float x) {
    VecF r;
    for (int i = 0; i < kWidth; ++i) r.v[i] = x;
    return r;
  }
  template <typename T>
  static VecF load(const T* p) {
    VecF r;
    for (int i = 0; i < kWidth; ++i) r.v[i] = to_float(p[i]);
    return r;
  }
  void store(float* p) const {
    for (int i = 0; i < kWidth; ++i) p[i] = v[i];
  }
  void store(bf16* p) const {
    for (int i = 0; i < kWidth; ++i) p[i] = bf16(v[i]);
  }
  void store(fp16* p) const {
    for (int i = 0; i < kWidth; ++i) p[i] = fp16(v[i]);
  }
  VecF round_bf16() const {
    VecF r;
    for (int i = 0; i < kWidth; ++i) r.v[i] = static_cast<float>(bf16(v[i]));
    return r;
  }
};

template <typename Op>
inline VecF vec_map2(VecF a, VecF b, Op op) {
  VecF r;
  for (int i = 0; i < VecF::kWidth; ++i) r.v[i] = op(a.v[i], b.v[i]);
  return r;
}
inline VecF operator+(VecF a, VecF b) {
  return vec_map2(a, b, [](float x, float y) { return x + y; });
}
inline VecF operator-(VecF a, VecF b) {
  return vec_map2(a, b, [](float x, float y) { return x - y; });
}
inline VecF operator*(VecF a, VecF b) {
  return vec_map2(a, b, [](float x, float y) { return x * y; });
}
inline VecF operator/(VecF a, VecF b) {
  return vec_map2(a, b, [](float x, float y) { return x / y; });
}
inline VecF vmax(VecF a, VecF b) {
  return vec_map2(a, b, [](float x, float y) { return x > y ? x : y; });
}
inline VecF fmadd(VecF a, VecF b, VecF c) {
  VecF r;
  for (int i = 0; i < VecF::kWidth; ++i) r.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline float hsum(VecF a) {
  float s = 0.0f;
  for (int i = 0; i < VecF::kWidth; ++i) s += a.v[i];
  return s;
}
inline void hsum4(const VecF* v, float* out) {
  for (int i = 0; i < 4; ++i) out[i] = hsum(v[i]);
}
inline float hmax(VecF a) {
  float m = a.v[0];
  for (int i = 1; i < VecF::kWidth; ++i) m = a.v[i] > m ? a.v[i] : m;
  return m;
}
inline VecF vexp(VecF x) {
  VecF r;
  for (int i = 0; i < VecF::kWidth; ++i) r.v[i] = x.v[i] < kExpLo ? 0.0f : std::exp(x.v[i]);
  return r;
}

#endif

constexpr int kVecWidth = VecF::kWidth;

// x rounded to the precision of T (bfloat16 rounding, as a torch op in that dtype does).
template <typename T>
inline VecF round_to(VecF x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    return x.round_bf16();
  }
}
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

}  // namespace radixengine::cpu
