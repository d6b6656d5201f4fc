// Linear layers over GGUF block-quantized weights: out[M, N] = x[M, K] * W[N, K]^T, with W read
// in its GGUF blocks and computed in fp32.
//
// A row is a run of blocks, each of 32 consecutive weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or a
// K-quant super-block of 256 (Q4_K, Q5_K, Q6_K); the formats are described at their structs.
// The dequantized weights are bit-identical to `gguf.quants.dequantize` (see "Block formats"),
// and out differs from fp32 matmul with them only in summation order (and, on the K-quants' fused
// path, in applying each sub-block scale and min to sums of products: see byte_planes, plane_x).
//
// Two paths; each reads a weight block from memory once per task, in row order:
//   fused (M <= kFusedMaxM, AVX2): each block is dequantized into registers and multiplied at
//     once with up to four x rows; a few consecutive weight rows stay in L1 while all x rows pass.
//     Decode is bound by reading the weights (5/8 of a byte per weight for Q4_1, 9/16 for Q4_K,
//     17/16 for Q8_0, against 4 for fp32), and by the dequantization's instructions on a single x row.
//   tiled (more rows, and the build without AVX2): a tile of weight rows is dequantized into
//     per-thread fp32 scratch and multiplied with x, packed transposed into panels, by 6 x 16
//     register tiles that broadcast the weights (no horizontal sums); x is split into blocks
//     that stay in L2, and one task is a tile times a block.
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "cpu_ops.h"
#include "cpu_vec.h"

// The vector path needs AVX2, FMA and F16C (every AVX2 CPU that runs this has all three).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RADIX_QUANT_AVX2 1
#include <immintrin.h>
#else
#define RADIX_QUANT_AVX2 0
#endif

#include <c10/util/Half.h>

namespace radixengine::cpu {
namespace {

// GGML type ids
constexpr int64_t kGgmlQ4_0 = 2;
constexpr int64_t kGgmlQ4_1 = 3;
constexpr int64_t kGgmlQ5_0 = 6;
constexpr int64_t kGgmlQ5_1 = 7;
constexpr int64_t kGgmlQ8_0 = 8;
constexpr int64_t kGgmlQ4_K = 12;
constexpr int64_t kGgmlQ5_K = 13;
constexpr int64_t kGgmlQ6_K = 14;

// Fused path (measured on Zen 3: it beats the tiled one up to M = 12; the tiled one pads M to 16).
constexpr int64_t kFusedMaxM = 12;
constexpr int kFusedXRows = 4;            // x rows per pass over a weight row
constexpr int64_t kFusedRowGroup = 16;    // weight rows that stay in L1 while the x rows pass
constexpr int64_t kFusedTasksPerThread = 8;
constexpr int64_t kFusedMinTileRows = 16;
constexpr int64_t kFusedMaxTileRows = 64;

// Tiled path (tile and x block sizes from 24 to 96 KiB and 96 to 384 KiB measured within 5%).
constexpr int64_t kTileBytes = 48 * 1024;     // dequantized weight rows per task
constexpr int64_t kXBlockBytes = 192 * 1024;  // x rows per task: about half of L2
constexpr int64_t kMaxTileRows = 96;
constexpr int64_t kRegisterRows = 6;  // weight rows per register tile (x 2 vectors: 12 registers)
constexpr int64_t kMinTasksPerThread = 4;

inline float fp16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
#if RADIX_QUANT_AVX2
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

// Block formats. Each has kBlockWeights (32, or 256 for a K-quant super-block) and kBlockBytes;
// dequantize() writes a block's weights to dst in order; on AVX2, vectors() hands the block's
// kBlockWeights / 8 vectors of 8 weights to fn(i, w), vector i holding weights 8i .. 8i + 7.
//
// Every weight is one rounding of an exact product and sum, as in gguf-py: the products of the
// fp16 scales (11 significant bits) with the quants (and the K-quants' 6-bit or int8 sub-block
// scales) have at most 23 significant bits, so they are exact in fp32, and a fused multiply-add
// with an offset rounds once, as gguf-py's product (exact) and separate sum do.

#if RADIX_QUANT_AVX2
// The 16 nibble bytes of a 32-weight block as the block's four vectors of quants: weights 0-7
// and 8-15 are the low nibbles of bytes 0-7 and 8-15, weights 16-31 their high nibbles.
inline void nibbles_x16(const uint8_t* qs, __m256i q[4]) {
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs)));
  const __m256i hi =
      _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8)));
  const __m256i mask = _mm256_set1_epi32(0x0f);
  q[0] = _mm256_and_si256(lo, mask);
  q[1] = _mm256_and_si256(hi, mask);
  q[2] = _mm256_srli_epi32(lo, 4);
  q[3] = _mm256_srli_epi32(hi, 4);
}

// The 32 bytes at p widened to four vectors of 32-bit lanes: bytes 0-7, 8-15, 16-23, 24-31.
inline void widen_u8x32(const uint8_t* p, __m256i out[4]) {
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    out[i] = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i)));
  }
}

// Q5_K and Q6_K assemble the quants of 32 weights as 32 bytes, then
// widen them: fn(i, q) gets bytes 8i .. 8i + 7 (signed) as 32-bit lanes.
template <typename Fn>
inline void widen_i8x32(__m256i bytes, const Fn& fn) {
  const __m128i lo = _mm256_castsi256_si128(bytes);
  const __m128i hi = _mm256_extracti128_si256(bytes, 1);
  fn(0, _mm256_cvtepi8_epi32(lo));
  fn(1, _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(lo, lo)));
  fn(2, _mm256_cvtepi8_epi32(hi));
  fn(3, _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(hi, hi)));
}

// kFifthBits[b][j] = 16 if bit j of byte b is set, else 0: byte i of a Q5 block's qh gives the
// fifth bits of its vector i in one load (8 KiB, stays in L1 beside the streamed weights).
struct FifthBitTable {
  alignas(32) int32_t lanes[256][8];
};

constexpr FifthBitTable make_fifth_bit_table() {
  FifthBitTable t{};
  for (int b = 0; b < 256; ++b) {
    for (int j = 0; j < 8; ++j) t.lanes[b][j] = (b >> j) & 1 ? 16 : 0;
  }
  return t;
}

inline constexpr FifthBitTable kFifthBits = make_fifth_bit_table();

// Adds the fifth bits of the 32-bit qh (x 16) to the nibbles q[4] of a Q5_0 / Q5_1 block.
inline void add_fifth_bits(const uint8_t* qh, __m256i q[4]) {
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    q[i] = _mm256_or_si256(
        q[i], _mm256_load_si256(reinterpret_cast<const __m256i*>(kFifthBits.lanes[qh[i]])));
  }
}

// Stores a format's vectors as its dequantize().
template <typename Format>
inline void store_vectors(const uint8_t* block, float* dst) {
  Format::vectors(block, [&](int i, __m256 w) { _mm256_storeu_ps(dst + 8 * i, w); });
}
#endif

// Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles; weight j = d * (q_j - 8), q_j as in Q4_1.
struct Q4_0 {
  static constexpr int64_t kBlockWeights = 32;
  static constexpr int64_t kBlockBytes = 18;

#if RADIX_QUANT_AVX2
  template <typename Fn>
  static void vectors(const uint8_t* block, const Fn& fn) {
    const __m256 dv = _mm256_set1_ps(fp16_at(block));
    __m256i q[4];
    nibbles_x16(block + 2, q);
    const __m256i eight = _mm256_set1_epi32(8);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      fn(i, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[i], eight))));
    }
  }
  static void dequantize(const uint8_t* block, float* dst) { store_vectors<Q4_0>(block, dst); }
#else
  static void dequantize(const uint8_t* block, float* dst) {
    const float d = fp16_at(block);
    const uint8_t* qs = block + 2;
    for (int j = 0; j < 16; ++j) {
      dst[j] = d * static_cast<float>((qs[j] & 0x0f) - 8);
      dst[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
    }
  }
#endif
};

// Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles; weight j < 16 = d * (qs[j] & 15) + m,
// weight 16 + j = d * (qs[j] >> 4) + m.
struct Q4_1 {
  static constexpr int64_t kBlockWeights = 32;
  static constexpr int64_t kBlockBytes = 20;

#if RADIX_QUANT_AVX2
  template <typename Fn>
  static void vectors(const uint8_t* block, const Fn& fn) {
    // d, m, d, m, ... widened together: one conversion, then each spread to all lanes.
    const __m256 dm = _mm256_cvtph_ps(
        _mm_castps_si128(_mm_broadcast_ss(reinterpret_cast<const float*>(block))));
    const __m256 dv = _mm256_moveldup_ps(dm);
    const __m256 mv = _mm256_movehdup_ps(dm);
    __m256i q[4];
    nibbles_x16(block + 4, q);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) fn(i, _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(q[i]), mv));
  }
  static void dequantize(const uint8_t* block, float* dst) { store_vectors<Q4_1>(block, dst); }
#else
  static void dequantize(const uint8_t* block, float* dst) {
    const float d = fp16_at(block);
    const float m = fp16_at(block + 2);
    const uint8_t* qs = block + 4;
    for (int j = 0; j < 16; ++j) {
      dst[j] = d * static_cast<float>(qs[j] & 0x0f) + m;
      dst[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
    }
  }
#endif
};

inline int fifth_bit(const uint8_t* qh_bytes, int j) { return (qh_bytes[j / 8] >> (j % 8)) & 1; }

// Q5_0 (22 bytes): fp16 d, 32 bits qh, 16 bytes of nibbles; weight j = d * (q_j - 16) with q_j
// its nibble (as in Q4_1) plus 16 x bit j of qh.
struct Q5_0 {
  static constexpr int64_t kBlockWeights = 32;
  static constexpr int64_t kBlockBytes = 22;

#if RADIX_QUANT_AVX2
  template <typename Fn>
  static void vectors(const uint8_t* block, const Fn& fn) {
    const __m256 dv = _mm256_set1_ps(fp16_at(block));
    __m256i q[4];
    nibbles_x16(block + 6, q);
    add_fifth_bits(block + 2, q);
    const __m256i sixteen = _mm256_set1_epi32(16);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      fn(i, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_sub_epi32(q[i], sixteen))));
    }
  }
  static void dequantize(const uint8_t* block, float* dst) { store_vectors<Q5_0>(block, dst); }
#else
  static void dequantize(const uint8_t* block, float* dst) {
    const float d = fp16_at(block);
    const uint8_t* qh = block + 2;
    const uint8_t* qs = block + 6;
    for (int j = 0; j < 16; ++j) {
      dst[j] = d * static_cast<float>(((qs[j] & 0x0f) | fifth_bit(qh, j) << 4) - 16);
      dst[j + 16] = d * static_cast<float>(((qs[j] >> 4) | fifth_bit(qh, j + 16) << 4) - 16);
    }
  }
#endif
};

// Q5_1 (24 bytes): fp16 d, fp16 m, 32 bits qh, 16 bytes of nibbles; weight j = d * q_j + m, q_j
// as in Q5_0.
struct Q5_1 {
  static constexpr int64_t kBlockWeights = 32;
  static constexpr int64_t kBlockBytes = 24;

#if RADIX_QUANT_AVX2
  template <typename Fn>
  static void vectors(const uint8_t* block, const Fn& fn) {
    const __m256 dv = _mm256_set1_ps(fp16_at(block));
    const __m256 mv = _mm256_set1_ps(fp16_at(block + 2));
    __m256i q[4];
    nibbles_x16(block + 8, q);
    add_fifth_bits(block + 4, q);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) fn(i, _mm256_fmadd_ps(dv, _mm256_cvtepi32_ps(q[i]), mv));
  }
  static void dequantize(const uint8_t* block, float* dst) { store_vectors<Q5_1>(block, dst); }
#else
  static void dequantize(const uint8_t* block, float* dst) {
    const float d = fp16_at(block);
    const float m = fp16_at(block + 2);
    const uint8_t* qh = block + 4;
    const uint8_t* qs = block + 8;
    for (int j = 0; j < 16; ++j) {
      dst[j] = d * static_cast<float>((qs[j] & 0x0f) | fifth_bit(qh, j) << 4) + m;
      dst[j + 16] = d * static_cast<float>((qs[j] >> 4) | fifth_bit(qh, j + 16) << 4) + m;
    }
  }
#endif
};

// Q8_0 (34 bytes): fp16 d, 32 int8 q; weight j = q[j] * d.
struct Q8_0 {
  static constexpr int64_t kBlockWeights = 32;
  static constexpr int64_t kBlockBytes = 34;

#if RADIX_QUANT_AVX2
  template <typename Fn>
  static void vectors(const uint8_t* block, const Fn& fn) {
    const __m256 dv = _mm256_set1_ps(fp16_at(block));
    const int8_t* qs = reinterpret_cast<const int8_t*>(block + 2);
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * i));
      fn(i, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), dv));
    }
  }
  static void dequantize(const uint8_t* block, float* dst) { store_vectors<Q8_0>(block, dst); }
#else
  static void dequantize(const uint8_t* block, float* dst) {
    const float d = fp16_at(block);
    const int8_t* qs = reinterpret_cast<const int8_t*>(block + 2);
    for (int j = 0; j < kBlockWeights; ++j) dst[j] = static_cast<float>(qs[j]) * d;
  }
#endif
};

// K-quants: super-blocks of 256 weights (llama.cpp's QK_K).
constexpr int64_t kSuperBlockWeights = 256;

// Q4_K / Q5_K sub-block scales: 8 sub-blocks of 32 weights, each with a 6-bit scale sc and a
// 6-bit min m packed in 12 bytes (sc 0-3 and m 0-3 in the low 6 bits of bytes 0-3 and 4-7;
// sc 4-7 and m 4-7 from the nibbles of bytes 8-11 and the top 2 bits of bytes 0-3 and 4-7).
// Sub-block j's weights are d * sc[j] * q - dmin * m[j]; returns d * sc and dmin * m (exact).
struct SubScales {
  float scale[8];
  float min[8];
};

inline SubScales k_sub_scales(const uint8_t* block) {
  const float d = fp16_at(block);
  const float dmin = fp16_at(block + 2);
  const uint8_t* s = block + 4;
  SubScales out;
  for (int j = 0; j < 4; ++j) {
    out.scale[j] = d * static_cast<float>(s[j] & 0x3f);
    out.min[j] = dmin * static_cast<float>(s[j + 4] & 0x3f);
    out.scale[j + 4] = d * static_cast<float>((s[j + 8] & 0x0f) | ((s[j] >> 2) & 0x30));
    out.min[j + 4] = dmin * static_cast<float>((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
  }
  return out;
}

#if RADIX_QUANT_AVX2
// The same d * sc and dmin * m as two vectors of the 8 sub-blocks (the 6-bit fields unpacked four
// bytes at a time); sub-block j's value is spread with one permute.
struct SubScaleVectors {
  __m256 scale;
  __m256 min;
};

inline SubScaleVectors k_sub_scale_vectors(const uint8_t* block) {
  uint32_t a, b, c;
  std::memcpy(&a, block + 4, 4);
  std::memcpy(&b, block + 8, 4);
  std::memcpy(&c, block + 12, 4);
  const uint64_t sc = (a & 0x3f3f3f3fu) |
                      static_cast<uint64_t>((c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u)) << 32;
  const uint64_t m = (b & 0x3f3f3f3fu) |
                     static_cast<uint64_t>(((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u)) << 32;
  const auto widen = [](uint64_t bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes))));
  };
  return {_mm256_mul_ps(_mm256_set1_ps(fp16_at(block)), widen(sc)),
          _mm256_mul_ps(_mm256_set1_ps(fp16_at(block + 2)), widen(m))};
}

inline __m256 lane(__m256 v, int j) { return _mm256_permutevar8x32_ps(v, _mm256_set1_epi32(j)); }

// The K-quants' fused path: 32 quants as bytes (as dword t: weights 4t .. 4t + 3) split into four
// planes, plane k holding weight 4t + k x 2^(8k) in lane t: the byte masked in place, no shifts
// or shuffles, exact in fp32 (see plane_x for the x they meet).
struct BytePlanes {
  __m256 v[4];
};

inline BytePlanes byte_planes(__m256i q) {
  return {{_mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0xff))),
           _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0xff00))),
           _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0xff0000))),
           _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(static_cast<int>(0xff000000u))))}};
}
#endif

// Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of scales, 128 bytes of nibbles: sub-blocks 2c
// and 2c + 1 are the low and high nibbles of bytes 32c .. 32c + 31.
// Q5_K (176 bytes): as Q4_K with 32 bytes qh between the scales and the nibbles: bit j of
// qh[i] is the fifth bit (x 16) of weight i of sub-block j.
template <bool kFifthBit>
struct QK_4_5 {
  static constexpr int64_t kBlockWeights = kSuperBlockWeights;
  static constexpr int64_t kBlockBytes = kFifthBit ? 176 : 144;
  static constexpr int64_t kQsOffset = kFifthBit ? 48 : 16;

#if RADIX_QUANT_AVX2
  template <typename Fn>
  static void vectors(const uint8_t* block, const Fn& fn) {
    if constexpr (kFifthBit) {
      bytes_vectors(block, fn);
    } else {
      lane_vectors(block, fn);
    }
  }

  // Q4_K: bytes widened to 32-bit lanes straight from memory, the nibbles split there (measured
  // faster than splitting them as bytes and widening those).
  template <typename Fn>
  static void lane_vectors(const uint8_t* block, const Fn& fn) {
    const SubScaleVectors s = k_sub_scale_vectors(block);
    const uint8_t* qs = block + kQsOffset;
    const __m256i mask = _mm256_set1_epi32(0x0f);
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      __m256i bytes[4];
      widen_u8x32(qs + 32 * c, bytes);
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * c + half;
        const __m256 dv = lane(s.scale, j);
        const __m256 mv = lane(s.min, j);
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v) {
          __m256i q = half ? _mm256_srli_epi32(bytes[v], 4) : _mm256_and_si256(bytes[v], mask);
          fn(4 * j + v, _mm256_fmsub_ps(dv, _mm256_cvtepi32_ps(q), mv));
        }
      }
    }
  }

  // Q5_K: the quants assembled as bytes (nibble and fifth bit), then widened.
  template <typename Fn>
  static void bytes_vectors(const uint8_t* block, const Fn& fn) {
    const SubScaleVectors s = k_sub_scale_vectors(block);
    const uint8_t* qs = block + kQsOffset;
    const __m256i mask = _mm256_set1_epi8(0x0f);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16));
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * c + half;
        __m256i q = _mm256_and_si256(half ? _mm256_srli_epi16(bytes, 4) : bytes, mask);
        const __m256i bit =
            _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
        q = _mm256_or_si256(q, _mm256_slli_epi16(bit, 4));
        const __m256 dv = lane(s.scale, j);
        const __m256 mv = lane(s.min, j);
        widen_i8x32(q, [&](int v, __m256i q32) {
          fn(4 * j + v, _mm256_fmsub_ps(dv, _mm256_cvtepi32_ps(q32), mv));
        });
      }
    }
  }
  static void dequantize(const uint8_t* block, float* dst) { store_vectors<QK_4_5>(block, dst); }

  // Fused path: sub-block j as Q6_K::planes gives a chunk (byte i of its nibbles and qh bits is
  // weight 32j + i), with the scale d * sc and, as the offset, dmin * m / 32 against plane_x's
  // -32 x sums.
  static constexpr bool kPlanes = true;
  static constexpr bool kPlaneOffset = true;
  template <typename Fn>
  static void planes(const uint8_t* block, const Fn& fn) {
    const SubScaleVectors s = k_sub_scale_vectors(block);
    const __m256 offsets = _mm256_mul_ps(s.min, _mm256_set1_ps(1.0f / 32));
    const uint8_t* qs = block + kQsOffset;
    const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16));
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * c));
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const int j = 2 * c + half;
        __m256i q = _mm256_and_si256(half ? _mm256_srli_epi16(bytes, 4) : bytes, low_nibbles);
        if constexpr (kFifthBit) {
          const __m256i at = j < 4    ? _mm256_slli_epi16(qh, 4 - j)
                             : j == 4 ? qh
                                      : _mm256_srli_epi16(qh, j - 4);
          q = _mm256_or_si256(q, _mm256_and_si256(at, _mm256_set1_epi8(0x10)));
        }
        fn(j, lane(s.scale, j), lane(offsets, j), byte_planes(q));
      }
    }
  }
#else
  static void dequantize(const uint8_t* block, float* dst) {
    const SubScales s = k_sub_scales(block);
    const uint8_t* qh = block + 16;
    const uint8_t* qs = block + kQsOffset;
    for (int j = 0; j < 8; ++j) {
      const uint8_t* bytes = qs + 32 * (j / 2);
      for (int i = 0; i < 32; ++i) {
        int q = j % 2 ? bytes[i] >> 4 : bytes[i] & 0x0f;
        if constexpr (kFifthBit) q |= ((qh[i] >> j) & 1) << 4;
        dst[32 * j + i] = s.scale[j] * static_cast<float>(q) - s.min[j];
      }
    }
  }
#endif
};
using Q4_K = QK_4_5<false>;
using Q5_K = QK_4_5<true>;

// Q6_K (210 bytes): 128 bytes ql, 64 bytes qh, 16 int8 scales, fp16 d. Weight
// w = 128h + 32s + i (h < 2, s < 4, i < 32) is d * scales[w / 16] * (q - 32), q the nibble
// (shifted by 4 x (s / 2)) of ql[64h + 32 (s % 2) + i] plus 16 x bits 2s, 2s + 1 of qh[32h + i].
struct Q6_K {
  static constexpr int64_t kBlockWeights = kSuperBlockWeights;
  static constexpr int64_t kBlockBytes = 210;

  static void sub_scales(const uint8_t* block, float out[16]) {
    const float d = fp16_at(block + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
    for (int k = 0; k < 16; ++k) out[k] = d * static_cast<float>(sc[k]);
  }

#if RADIX_QUANT_AVX2
  template <typename Fn>
  static void vectors(const uint8_t* block, const Fn& fn) {
    // The 16 sub-block scales d * sc as two vectors; each is spread with one permute.
    const __m256 dv = _mm256_set1_ps(fp16_at(block + 208));
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    const __m256 scales[2] = {_mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))),
                              _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                    _mm_unpackhi_epi64(sc, sc))))};
    const __m256i mask = _mm256_set1_epi8(0x0f);
    const __m256i three = _mm256_set1_epi8(3);
    const __m256i thirty_two = _mm256_set1_epi8(32);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i ql[2] = {
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32))};
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        const __m256i lo = _mm256_and_si256(
            _mm256_srl_epi16(ql[s % 2], _mm_cvtsi32_si128(4 * (s / 2))), mask);
        const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * s)), three);
        const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), thirty_two);
        const __m256 scale_lo = lane(scales[h], 2 * s);
        const __m256 scale_hi = lane(scales[h], 2 * s + 1);
        widen_i8x32(q, [&](int v, __m256i q32) {
          fn(16 * h + 4 * s + v, _mm256_mul_ps(v < 2 ? scale_lo : scale_hi, _mm256_cvtepi32_ps(q32)));
        });
      }
    }
  }
  static void dequantize(const uint8_t* block, float* dst) { store_vectors<Q6_K>(block, dst); }

  // Fused path: chunk c = 4h + s (weights 32c .. 32c + 31, byte i of the (h, s) quants above) as
  // four vectors of quants (without the - 32, which the x plane chunk carries) and one of scales.
  // Plane k holds weights 32c + 4t + k (t < 8) as q x 2^(8k): the byte masked in place (no
  // shifts or shuffles; exact in fp32), read against x in that order and scaled by 2^(-8k) (see
  // plane_x). Lanes 0-3 lie in sub-block 2s of half h, lanes 4-7 in 2s + 1, so fn applies the
  // scale once to the sum of the four planes' products.
  static constexpr bool kPlanes = true;
  static constexpr bool kPlaneOffset = false;  // the - 32 is in the sum the scale multiplies
  template <typename Fn>
  static void planes(const uint8_t* block, const Fn& fn) {
    const __m256 dv = _mm256_set1_ps(fp16_at(block + 208));
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
    const __m256 scales[2] = {_mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))),
                              _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                                    _mm_unpackhi_epi64(sc, sc))))};
    const __m256i low_nibbles = _mm256_set1_epi8(0x0f);
    const __m256i high_bits = _mm256_set1_epi8(0x30);
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      const __m256i ql[2] = {
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h)),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * h + 32))};
      const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) {
        const __m256i lo =
            _mm256_and_si256(s < 2 ? ql[s] : _mm256_srli_epi16(ql[s - 2], 4), low_nibbles);
        const __m256i hi_at = s < 2    ? _mm256_slli_epi16(qh, 4 - 2 * s)
                              : s == 2 ? qh
                                       : _mm256_srli_epi16(qh, 2);
        const __m256i q = _mm256_or_si256(lo, _mm256_and_si256(hi_at, high_bits));
        const __m256 scale = _mm256_permutevar8x32_ps(
            scales[h], _mm256_setr_epi32(2 * s, 2 * s, 2 * s, 2 * s, 2 * s + 1, 2 * s + 1,
                                         2 * s + 1, 2 * s + 1));
        fn(4 * h + s, scale, scale, byte_planes(q));
      }
    }
  }
#else
  static void dequantize(const uint8_t* block, float* dst) {
    float scale[16];
    sub_scales(block, scale);
    for (int h = 0; h < 2; ++h) {
      for (int s = 0; s < 4; ++s) {
        for (int i = 0; i < 32; ++i) {
          const int lo = (block[64 * h + 32 * (s % 2) + i] >> (4 * (s / 2))) & 0x0f;
          const int hi = (block[128 + 32 * h + i] >> (2 * s)) & 3;
          const int w = 128 * h + 32 * s + i;
          dst[w] = scale[w / 16] * static_cast<float>((lo | hi << 4) - 32);
        }
      }
    }
  }
#endif
};

struct QuantLinearArgs {
  const float* x;    // [M, K]
  const uint8_t* w;  // [N, row_bytes]
  float* out;        // [M, N]
  int64_t M, N, K;
  int64_t row_bytes;
  bool x_planes = false;  // x arranged by plane_x (fused path, M = 1)
};

// ---------------------------------------------------------------------------------------------
// Tiled path

// tile[r * K + k] = W[n0 + r, k] for r < rows.
template <typename Format>
void dequantize_rows(const QuantLinearArgs& a, int64_t n0, int64_t rows, float* tile) {
  const int64_t blocks = a.K / Format::kBlockWeights;
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = a.w + (n0 + r) * a.row_bytes;
    float* dst = tile + r * a.K;
    for (int64_t b = 0; b < blocks; ++b) {
      Format::dequantize(row + b * Format::kBlockBytes, dst + b * Format::kBlockWeights);
    }
  }
}

// x transposed into panels of kPanelCols rows of x: panel p holds x[p * kPanelCols + j, k] at
// [k * kPanelCols + j] (zero past M), so that a register tile reads one contiguous cache line per
// k (a plain transpose, with rows M floats apart, was 15% slower at M = 256).
constexpr int64_t kPanelCols = 2 * kVecWidth;

struct XPanels {
  std::vector<float> data;
  int64_t num_panels;
};

XPanels pack_x_panels(const QuantLinearArgs& a) {
  const int64_t num_panels = (a.M + kPanelCols - 1) / kPanelCols;
  XPanels x_t{std::vector<float>(num_panels * a.K * kPanelCols, 0.0f), num_panels};
  for (int64_t p = 0; p < num_panels; ++p) {
    float* panel = x_t.data.data() + p * a.K * kPanelCols;
    for (int64_t j = 0; j < std::min(kPanelCols, a.M - p * kPanelCols); ++j) {
      const float* x_row = a.x + (p * kPanelCols + j) * a.K;
      for (int64_t k = 0; k < a.K; ++k) panel[k * kPanelCols + j] = x_row[k];
    }
  }
  return x_t;
}

struct TilePlan {
  int64_t tile_rows;        // weight rows per task
  int64_t panels_per_task;  // x panels per task
  int64_t num_tiles;
  int64_t num_x_blocks;
};

// Tiles as large as kTileBytes (each is reused by all x rows of a task) while every thread gets
// several tasks; x blocks of at most kXBlockBytes, of about equal size.
TilePlan plan_tiles(int64_t M, int64_t N, int64_t K, int64_t num_threads) {
  TilePlan p{};
  p.tile_rows = std::clamp<int64_t>(kTileBytes / (K * 4) / kRegisterRows * kRegisterRows,
                                    kRegisterRows, kMaxTileRows);
  const int64_t num_panels = (M + kPanelCols - 1) / kPanelCols;
  const int64_t panels_fit = std::max<int64_t>(1, kXBlockBytes / (K * 4 * kPanelCols));
  p.num_x_blocks = (num_panels + panels_fit - 1) / panels_fit;
  p.panels_per_task = (num_panels + p.num_x_blocks - 1) / p.num_x_blocks;
  const int64_t min_tasks = kMinTasksPerThread * num_threads;
  while (p.tile_rows > kRegisterRows &&
         (N + p.tile_rows - 1) / p.tile_rows * p.num_x_blocks < min_tasks) {
    p.tile_rows -= kRegisterRows;
  }
  p.num_tiles = (N + p.tile_rows - 1) / p.tile_rows;
  return p;
}

// c[i * ldc + j] = sum_k w[i * K + k] * panel[k * kPanelCols + j] for MR weight rows and the NV
// vectors of a panel (the x panel's part is one cache line per k, read in order).
template <int MR, int NV>
inline void panel_tile(const float* w, int64_t K, const float* panel, float* c, int64_t ldc) {
  VecF acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 2
    for (int j = 0; j < NV; ++j) acc[i][j] = VecF::zero();
  }
  for (int64_t k = 0; k < K; ++k) {
    VecF xv[NV];
#pragma GCC unroll 2
    for (int j = 0; j < NV; ++j) xv[j] = VecF::load(panel + k * kPanelCols + j * kVecWidth);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const VecF wv = VecF::broadcast(w[i * K + k]);
#pragma GCC unroll 2
      for (int j = 0; j < NV; ++j) acc[i][j] = fmadd(wv, xv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 2
    for (int j = 0; j < NV; ++j) acc[i][j].store(c + i * ldc + j * kVecWidth);
  }
}

template <int NV>
void panel_rows(const float* tile, int64_t rows, int64_t K, const float* panel, float* c,
                int64_t ldc) {
  int64_t i = 0;
  for (; i + kRegisterRows <= rows; i += kRegisterRows) {
    panel_tile<kRegisterRows, NV>(tile + i * K, K, panel, c + i * ldc, ldc);
  }
  const float* w = tile + i * K;
  float* ci = c + i * ldc;
  switch (rows - i) {
    case 1: panel_tile<1, NV>(w, K, panel, ci, ldc); break;
    case 2: panel_tile<2, NV>(w, K, panel, ci, ldc); break;
    case 3: panel_tile<3, NV>(w, K, panel, ci, ldc); break;
    case 4: panel_tile<4, NV>(w, K, panel, ci, ldc); break;
    case 5: panel_tile<5, NV>(w, K, panel, ci, ldc); break;
    default: break;
  }
}

// One task: weight rows [n0, n0 + rows) x x panels [p0, p1).
template <typename Format>
void tiled_task(const QuantLinearArgs& a, const TilePlan& plan, const XPanels& x_t, int64_t n0,
                int64_t rows, int64_t p0, int64_t p1) {
  const int64_t ldc = plan.panels_per_task * kPanelCols;
  float* tile = thread_scratch(plan.tile_rows * a.K + plan.tile_rows * ldc);
  float* c = tile + plan.tile_rows * a.K;  // out^T: c[r * ldc + j] = out[m0 + j, n0 + r]
  dequantize_rows<Format>(a, n0, rows, tile);
  const int64_t m0 = p0 * kPanelCols;
  const int64_t m1 = std::min(a.M, p1 * kPanelCols);
  for (int64_t p = p0; p < p1; ++p) {
    const float* panel = x_t.data.data() + p * a.K * kPanelCols;
    float* cp = c + (p - p0) * kPanelCols;
    if (a.M - p * kPanelCols > kVecWidth) {
      panel_rows<2>(tile, rows, a.K, panel, cp, ldc);
    } else {
      panel_rows<1>(tile, rows, a.K, panel, cp, ldc);
    }
  }
  for (int64_t m = m0; m < m1; ++m) {
    float* dst = a.out + m * a.N + n0;
    for (int64_t r = 0; r < rows; ++r) dst[r] = c[r * ldc + (m - m0)];
  }
}

template <typename Format>
void run_tiled(const QuantLinearArgs& a) {
  const TilePlan plan = plan_tiles(a.M, a.N, a.K, at::get_num_threads());
  const XPanels x_t = pack_x_panels(a);
  run_tasks(plan.num_tiles * plan.num_x_blocks, [&](int64_t task) {
    const int64_t n0 = task % plan.num_tiles * plan.tile_rows;
    const int64_t p0 = task / plan.num_tiles * plan.panels_per_task;
    tiled_task<Format>(a, plan, x_t, n0, std::min(plan.tile_rows, a.N - n0), p0,
                       std::min(x_t.num_panels, p0 + plan.panels_per_task));
  });
}

// ---------------------------------------------------------------------------------------------
// Fused path

#if RADIX_QUANT_AVX2
constexpr bool kHaveFusedPath = true;

inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// At M = 1, a format with planes() (the K-quants) reads x as plane_x chunks (with more x rows the
// planes' work per x row costs more than their cheaper dequantization saves: 1.6x at M = 4):
// for each 32 floats x[0..31], the 32 floats [8k + t] = x[4t + k] x 2^(-8k) (k < 4, t < 8;
// exact unless that falls below fp32's normal range), then 8 floats [32 + t] = -32 x (x[4t] +
// x[4t + 1] + x[4t + 2] + x[4t + 3]).
template <typename Format, typename = void>
struct HasPlanes : std::false_type {};
template <typename Format>
struct HasPlanes<Format, std::void_t<decltype(Format::kPlanes)>> : std::true_type {};

constexpr int64_t kPlaneChunkFloats = 40;

std::vector<float> plane_x(const float* x, int64_t M, int64_t K) {
  constexpr float kPlaneScale[4] = {1.0f, 0x1p-8f, 0x1p-16f, 0x1p-24f};
  std::vector<float> out(M * K / 32 * kPlaneChunkFloats);
  for (int64_t b = 0; b < M * K / 32; ++b) {
    const float* src = x + 32 * b;
    float* dst = out.data() + kPlaneChunkFloats * b;
    for (int t = 0; t < 8; ++t) {
      for (int k = 0; k < 4; ++k) dst[8 * k + t] = src[4 * t + k] * kPlaneScale[k];
      dst[32 + t] = -32.0f * (src[4 * t] + src[4 * t + 1] + src[4 * t + 2] + src[4 * t + 3]);
    }
  }
  return out;
}

// out[g * N] = dot(x[g * K ...], W[n]) for G x rows and one weight row, read front to back (the
// hardware prefetcher follows one stream through a task's rows; rows side by side, each a few
// cache lines long, were twice as slow from memory). A accumulators per x row keep enough FMA
// chains in flight.
template <typename Format, int G, bool kXPlanes>
inline void fused_row(const QuantLinearArgs& a, const float* x, int64_t n, float* out) {
  static_assert(!kXPlanes || G == 1);
  constexpr int A = G <= 2 ? 4 : 2;
  __m256 acc[G][A];
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
#pragma GCC unroll 4
    for (int j = 0; j < A; ++j) acc[g][j] = _mm256_setzero_ps();
  }
  const int64_t K = a.K;
  const uint8_t* row = a.w + n * a.row_bytes;
#pragma GCC unroll 1
  for (int64_t k = 0; k < K; k += Format::kBlockWeights, row += Format::kBlockBytes) {
    if constexpr (kXPlanes) {
      Format::planes(row, [&](int c, __m256 scale, __m256 offset, const BytePlanes& q) {
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          const float* xc = x + (k / 32 + c) * kPlaneChunkFloats;
          const __m256 x_sums = _mm256_loadu_ps(xc + 32);
          __m256 p = Format::kPlaneOffset ? _mm256_mul_ps(q.v[0], _mm256_loadu_ps(xc))
                                          : _mm256_fmadd_ps(q.v[0], _mm256_loadu_ps(xc), x_sums);
#pragma GCC unroll 3
          for (int v = 1; v < 4; ++v) p = _mm256_fmadd_ps(q.v[v], _mm256_loadu_ps(xc + 8 * v), p);
          acc[g][c % A] = _mm256_fmadd_ps(scale, p, acc[g][c % A]);
          if constexpr (Format::kPlaneOffset) acc[g][c % A] = _mm256_fmadd_ps(offset, x_sums, acc[g][c % A]);
        }
      });
    } else {
      Format::vectors(row, [&](int i, __m256 w) {
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) {
          acc[g][i % A] = _mm256_fmadd_ps(_mm256_loadu_ps(x + g * K + k + 8 * i), w, acc[g][i % A]);
        }
      });
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    __m256 sum = acc[g][0];
#pragma GCC unroll 4
    for (int j = 1; j < A; ++j) sum = _mm256_add_ps(sum, acc[g][j]);
    out[g * a.N] = hsum256(sum);
  }
}

template <typename Format, int G>
void fused_rows(const QuantLinearArgs& a, int64_t m, int64_t n0, int64_t rows) {
  for (int64_t n = n0; n < n0 + rows; ++n) {
    if constexpr (HasPlanes<Format>::value && G == 1) {
      if (a.x_planes) {
        fused_row<Format, G, true>(a, a.x, n, a.out + n);
        continue;
      }
    }
    fused_row<Format, G, false>(a, a.x + m * a.K, n, a.out + m * a.N + n);
  }
}

// One task: weight rows [n0, n0 + rows) x all x rows, up to kFusedXRows at a time. A group of
// weight rows stays in L1 while the x rows pass over it.
template <typename Format>
void fused_task(const QuantLinearArgs& a, int64_t n0, int64_t rows) {
  for (int64_t r0 = n0; r0 < n0 + rows; r0 += kFusedRowGroup) {
    const int64_t nr = std::min(kFusedRowGroup, n0 + rows - r0);
    int64_t m = 0;
    for (; m + kFusedXRows <= a.M; m += kFusedXRows) fused_rows<Format, kFusedXRows>(a, m, r0, nr);
    switch (a.M - m) {
      case 1: fused_rows<Format, 1>(a, m, r0, nr); break;
      case 2: fused_rows<Format, 2>(a, m, r0, nr); break;
      case 3: fused_rows<Format, 3>(a, m, r0, nr); break;
      default: break;
    }
  }
}

template <typename Format>
void run_fused(const QuantLinearArgs& a) {
  // Contiguous runs of rows, about kFusedTasksPerThread per thread (the tasks balance the threads'
  // uneven progress).
  const int64_t num_threads = at::get_num_threads();
  const int64_t target_tasks = kFusedTasksPerThread * num_threads;
  const int64_t tile_rows =
      std::clamp<int64_t>(round_up((a.N + target_tasks - 1) / target_tasks, 8), kFusedMinTileRows,
                          kFusedMaxTileRows);
  const int64_t num_tiles = (a.N + tile_rows - 1) / tile_rows;
  std::vector<float> x_planes;
  QuantLinearArgs args = a;
  if constexpr (HasPlanes<Format>::value) {
    if (a.M == 1) {
      x_planes = plane_x(a.x, a.M, a.K);
      args.x = x_planes.data();
      args.x_planes = true;
    }
  }
  run_tasks(num_tiles, [&](int64_t task) {
    const int64_t n0 = task * tile_rows;
    fused_task<Format>(args, n0, std::min(tile_rows, a.N - n0));
  });
}
#else
constexpr bool kHaveFusedPath = false;

template <typename Format>
void run_fused(const QuantLinearArgs& a) {
  run_tiled<Format>(a);
}
#endif

// ---------------------------------------------------------------------------------------------

template <typename Format>
void run_quant_linear(const QuantLinearArgs& a) {
  if (kHaveFusedPath && a.M <= kFusedMaxM) {
    run_fused<Format>(a);
  } else {
    run_tiled<Format>(a);
  }
}

struct BlockLayout {
  int64_t weights;  // per block
  int64_t bytes;
};

template <typename Format>
constexpr BlockLayout layout_of() {
  return {Format::kBlockWeights, Format::kBlockBytes};
}

BlockLayout block_layout_of(int64_t qtype) {
  switch (qtype) {
    case kGgmlQ4_0: return layout_of<Q4_0>();
    case kGgmlQ4_1: return layout_of<Q4_1>();
    case kGgmlQ5_0: return layout_of<Q5_0>();
    case kGgmlQ5_1: return layout_of<Q5_1>();
    case kGgmlQ8_0: return layout_of<Q8_0>();
    case kGgmlQ4_K: return layout_of<Q4_K>();
    case kGgmlQ5_K: return layout_of<Q5_K>();
    case kGgmlQ6_K: return layout_of<Q6_K>();
    default: return {0, 0};
  }
}

void check_quant_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype) {
  TORCH_CHECK(x.device().is_cpu() && qweight.device().is_cpu(), "quant_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat, "quant_linear: x must be float32, got ",
              x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "quant_linear: x must be a contiguous [M, K]");
  TORCH_CHECK(qweight.scalar_type() == at::kByte, "quant_linear: qweight must be uint8, got ",
              qweight.scalar_type());
  TORCH_CHECK(qweight.dim() == 2 && qweight.is_contiguous(),
              "quant_linear: qweight must be a contiguous [N, row_bytes]");
  const BlockLayout block = block_layout_of(qtype);
  TORCH_CHECK(block.bytes > 0, "quant_linear: unsupported GGML type ", qtype,
              " (Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14)");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % block.weights == 0, "quant_linear: K = ", K, " is not a multiple of ",
              block.weights);
  TORCH_CHECK(qweight.size(1) == K / block.weights * block.bytes, "quant_linear: qweight rows hold ",
              qweight.size(1), " bytes; K = ", K, " needs ", K / block.weights * block.bytes);
}

}  // namespace

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype) {
  check_quant_linear(x, qweight, qtype);
  const int64_t M = x.size(0), K = x.size(1), N = qweight.size(0);
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  const QuantLinearArgs a{x.data_ptr<float>(), qweight.data_ptr<uint8_t>(), out.data_ptr<float>(),
                          M, N, K, qweight.size(1)};
  switch (qtype) {
    case kGgmlQ4_0: run_quant_linear<Q4_0>(a); break;
    case kGgmlQ4_1: run_quant_linear<Q4_1>(a); break;
    case kGgmlQ5_0: run_quant_linear<Q5_0>(a); break;
    case kGgmlQ5_1: run_quant_linear<Q5_1>(a); break;
    case kGgmlQ8_0: run_quant_linear<Q8_0>(a); break;
    case kGgmlQ4_K: run_quant_linear<Q4_K>(a); break;
    case kGgmlQ5_K: run_quant_linear<Q5_K>(a); break;
    default: run_quant_linear<Q6_K>(a); break;
  }
  return out;
}

}  // namespace radixengine::cpu
