// Attention of a block of query rows over keys of one req_to_token row on AMX tiles (bf16): the
// unit kernel of the shared-prefix decode pass (cpu_cascade.h: a unit's members' query heads over
// their shared keys) and the block kernel of extend (a request's block of new tokens over its
// keys, causal).
//
// One task computes a whole block, every kv head: a block of 64 keys reads whole pool rows
// (all heads of a slot), and per head, 16 query rows at a time:
//   S [16][64] = Q [16][D] * K^T            (tdpbf16ps: bf16 products, fp32 sums)
//   online softmax along each row of S      (fp32, AVX-512)
//   O [16][D] += P [16][64] * V [64][D]      (P split into bf16 hi + lo parts, two tdpbf16ps,
//                                            so P keeps ~16 bits: the result matches the fp32
//                                            path to fp32 rounding, not to bf16 rounding)
// K and V are copied out of the pool into the VNNI layout the tile B operand needs (pairs of
// consecutive K-dimension values side by side), once per block for all query rows.
//
// Compiled into every level; only the AVX-512 build has the AMX code (enabled for these
// functions alone with target pragmas), and it runs only after the CPU and the kernel allowed it.
#include "cpu_cascade.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_amx.h"
#include "cpu_attention_amx.h"

namespace radixengine::cpu {

#if RADIX_HAVE_AMX

namespace {

constexpr int64_t kBlock = 64;   // keys per block
constexpr int64_t kRows = 16;    // query rows per tile

// Keys a query row sees within a key block of n keys: all n (a shared unit), or under the causal
// mask of extend, those before min(n, limit0 + row / group) (limit0: the block's first query's
// position + 1 - the key block's start).
struct RowLimits {
  bool causal;
  int64_t limit0;
  int64_t group;
  int64_t keys(int64_t row, int64_t n) const {
    return causal ? std::clamp<int64_t>(limit0 + row / group, 0, n) : n;
  }
};

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512bf16")

// Tiles 0-3: C (16 rows x 16 fp32); 4, 5: A (16 rows x 32 bf16); 6, 7: B (16 rows x 32 bf16).
// Consecutive products take their operands from alternating tiles, so that a tile load does not
// wait for the product still reading that tile.

// s [16][kBlock] = qp rows [16][D] * kv (VNNI [D / 2][kBlock * 2]).
void scores_tile(const bf16* qp, int64_t D, const bf16* kv, float* s) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t d = 0; d < D; d += 64) {
    const bf16* b = kv + (d / 2) * kBlock * 2;
    _tile_loadd(4, qp + d, D * 2);
    _tile_loadd(6, b + 0, kBlock * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + 32, kBlock * 4);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, b + 64, kBlock * 4);
    _tile_dpbf16ps(2, 4, 6);
    _tile_loadd(7, b + 96, kBlock * 4);
    _tile_dpbf16ps(3, 4, 7);
    if (d + 32 >= D) break;
    b += 16 * kBlock * 2;
    _tile_loadd(5, qp + d + 32, D * 2);
    _tile_loadd(6, b + 0, kBlock * 4);
    _tile_dpbf16ps(0, 5, 6);
    _tile_loadd(7, b + 32, kBlock * 4);
    _tile_dpbf16ps(1, 5, 7);
    _tile_loadd(6, b + 64, kBlock * 4);
    _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(7, b + 96, kBlock * 4);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, s + 0, kBlock * 4);
  _tile_stored(1, s + 16, kBlock * 4);
  _tile_stored(2, s + 32, kBlock * 4);
  _tile_stored(3, s + 48, kBlock * 4);
}

// acc [16][D] += p_hi * v + p_lo * v (p [16][kBlock] bf16, v VNNI [kBlock / 2][D * 2]).
void values_tile(const bf16* p_hi, const bf16* p_lo, const bf16* vv, int64_t D, float* acc) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t nt = std::min<int64_t>(4, (D - d0) / 16);
    if (nt > 0) _tile_loadd(0, acc + d0 + 0, D * 4);
    if (nt > 1) _tile_loadd(1, acc + d0 + 16, D * 4);
    if (nt > 2) _tile_loadd(2, acc + d0 + 32, D * 4);
    if (nt > 3) _tile_loadd(3, acc + d0 + 48, D * 4);
    for (int64_t k = 0; k < kBlock; k += 32) {
      _tile_loadd(4, p_hi + k, kBlock * 2);
      _tile_loadd(5, p_lo + k, kBlock * 2);
      const bf16* b = vv + (k / 2) * D * 2 + d0 * 2;
      if (nt > 0) { _tile_loadd(6, b + 0, D * 4); _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(0, 5, 6); }
      if (nt > 1) { _tile_loadd(7, b + 32, D * 4); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(1, 5, 7); }
      if (nt > 2) { _tile_loadd(6, b + 64, D * 4); _tile_dpbf16ps(2, 4, 6); _tile_dpbf16ps(2, 5, 6); }
      if (nt > 3) { _tile_loadd(7, b + 96, D * 4); _tile_dpbf16ps(3, 4, 7); _tile_dpbf16ps(3, 5, 7); }
    }
    if (nt > 0) _tile_stored(0, acc + d0 + 0, D * 4);
    if (nt > 1) _tile_stored(1, acc + d0 + 16, D * 4);
    if (nt > 2) _tile_stored(2, acc + d0 + 32, D * 4);
    if (nt > 3) _tile_stored(3, acc + d0 + 48, D * 4);
  }
}

void release_tiles() { _tile_release(); }

// Online softmax of the first `rows` of s [16][kBlock] (scaled, soft-capped; row r sees the keys
// i < min(n, limit0 + (row0 + r) / group), the others hidden);
// writes p as bf16 hi + lo parts (vcvtne2ps2bf16 rounds to nearest even) and each row's rescale
// factor for the accumulated output. Rows past `rows` are padding: their results are never read.
void softmax_rows(float* s, int64_t rows, int64_t n, const RowLimits& limits, int64_t row0,
                  float scale, float logit_cap, float* row_max, float* row_sum, float* alpha,
                  bf16* p_hi, bf16* p_lo) {
  const __m512 sv = _mm512_set1_ps(scale);
  alignas(64) float sums[kRows] = {};
  const __m512 old_max = _mm512_loadu_ps(row_max);
  for (int64_t r = 0; r < rows; ++r) {
    float* x = s + r * kBlock;
    const int64_t seen = limits.keys(row0 + r, n);
    if (logit_cap > 0.0f) {
      for (int64_t i = 0; i < kBlock; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), sv));
      soft_cap(x, seen, logit_cap);
    }
    const float pre = logit_cap > 0.0f ? 1.0f : scale;  // scores not yet scaled are scaled here
    const __m512 pv = _mm512_set1_ps(pre);
    __m512 v[kBlock / 16];
    __m512 mx = _mm512_set1_ps(kNegInf);
    for (int64_t i = 0; i < kBlock / 16; ++i) {
      v[i] = _mm512_mul_ps(_mm512_loadu_ps(x + 16 * i), pv);
      const int64_t valid = std::clamp<int64_t>(seen - 16 * i, 0, 16);
      if (valid < 16) v[i] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), (1u << valid) - 1, v[i]);
      mx = _mm512_max_ps(mx, v[i]);
    }
    const float new_max = std::max(row_max[r], _mm512_reduce_max_ps(mx));
    const VecF mv = VecF::broadcast(new_max);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t i = 0; i < kBlock / 16; i += 2) {
      const __m512 p0 = vexp(VecF{v[i]} - mv).v;
      const __m512 p1 = vexp(VecF{v[i + 1]} - mv).v;
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      const __m512i hi = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0));
      const __m512 hi0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hi)), 16));
      const __m512 hi1 = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hi, 1)), 16));
      const __m512bh lo = _mm512_cvtne2ps_pbh(_mm512_sub_ps(p1, hi1), _mm512_sub_ps(p0, hi0));
      _mm512_storeu_si512(p_hi + r * kBlock + 16 * i, hi);
      _mm512_storeu_si512(p_lo + r * kBlock + 16 * i, reinterpret_cast<__m512i>(lo));
    }
    sums[r] = _mm512_reduce_add_ps(sum);
    row_max[r] = new_max;
  }
  // The rows' rescale factors exp(old max - new max), 16 at once.
  const __m512 a = vexp(VecF{_mm512_sub_ps(old_max, _mm512_loadu_ps(row_max))}).v;
  _mm512_storeu_ps(alpha, a);
  _mm512_storeu_ps(row_sum, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum), a, _mm512_load_ps(sums)));
}


#pragma GCC pop_options

// In place: the 16 x 16 matrix of 32-bit words in r[0..15] (one row a register) transposed.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4g + k], lane L: column 4L + k of rows 4g .. 4g + 3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // gather each column's four 128-bit lanes
    t[k] = _mm512_shuffle_i32x4(r[k], r[k + 4], 0x88);
    t[k + 4] = _mm512_shuffle_i32x4(r[k], r[k + 4], 0xdd);
    t[k + 8] = _mm512_shuffle_i32x4(r[k + 8], r[k + 12], 0x88);
    t[k + 12] = _mm512_shuffle_i32x4(r[k + 8], r[k + 12], 0xdd);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0x88);
    r[k + 8] = _mm512_shuffle_i32x4(t[k], t[k + 8], 0xdd);
    r[k + 4] = _mm512_shuffle_i32x4(t[k + 4], t[k + 12], 0x88);
    r[k + 12] = _mm512_shuffle_i32x4(t[k + 4], t[k + 12], 0xdd);
  }
}

// K block (n keys, rows of D bf16 from column col0) to VNNI: kv[r][2i + e] = K[i][2r + e], a
// transpose of 32-bit words (pairs), 16 keys x 16 pairs at a time; keys >= n are 0.
void pack_keys(const bf16* const* k_rows, int64_t n, int64_t D, int64_t col0, bf16* kv) {
  uint32_t* out = reinterpret_cast<uint32_t*>(kv);
  const int64_t pairs = D / 2;
  __m512i r[16];
  for (int64_t i0 = 0; i0 < kBlock; i0 += 16) {
    for (int64_t w0 = 0; w0 < pairs; w0 += 16) {
      for (int64_t j = 0; j < 16; ++j) {
        r[j] = i0 + j < n ? _mm512_loadu_si512(k_rows[i0 + j] + col0 + 2 * w0) : _mm512_setzero_si512();
      }
      transpose16x16(r);
      for (int64_t w = 0; w < 16; ++w) _mm512_storeu_si512(out + (w0 + w) * kBlock + i0, r[w]);
    }
  }
}

// V block to VNNI: vv[i][2d + e] = V[2i + e][d]; keys >= n are 0.
void pack_values(const bf16* const* v_rows, int64_t n, int64_t D, int64_t col0, bf16* vv) {
  const __m512i zero = _mm512_setzero_si512();
  for (int64_t i = 0; i < kBlock / 2; ++i) {
    uint16_t* out = reinterpret_cast<uint16_t*>(vv + i * 2 * D);
    const bool has0 = 2 * i < n, has1 = 2 * i + 1 < n;
    for (int64_t d = 0; d < D; d += 32) {
      const __m512i a = has0 ? _mm512_loadu_si512(v_rows[2 * i] + col0 + d) : zero;
      const __m512i b = has1 ? _mm512_loadu_si512(v_rows[2 * i + 1] + col0 + d) : zero;
      // 16-bit interleave of a and b, in order: lanes 0..15 then 16..31.
      const __m512i idx_lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                              39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i idx_hi = _mm512_set_epi16(63, 31, 62, 30, 61, 29, 60, 28, 59, 27, 58, 26, 57, 25, 56, 24,
                                              55, 23, 54, 22, 53, 21, 52, 20, 51, 19, 50, 18, 49, 17, 48, 16);
      _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(a, idx_lo, b));
      _mm512_storeu_si512(out + 2 * d + 32, _mm512_permutex2var_epi16(a, idx_hi, b));
    }
  }
}

}  // namespace

namespace {

// Per-thread buffers of one block: qp [Hkv][Mp][D] (the query rows per kv head, rows >= M zero),
// every head's K and V block in VNNI, P hi/lo [Mp][kBlock]; fp32 per kv head h at
// scratch + h * per_head: acc [Mp][D], row max [Mp], row sum [Mp], alpha [Mp]; s [Mp][kBlock].
struct BlockBuffers {
  bf16* qp;
  bf16* kv_all;
  bf16* vv_all;
  bf16* p_hi;
  bf16* p_lo;
  float* scratch;
  float* s;
  int64_t per_head;
};

BlockBuffers block_buffers(int64_t Hkv, int64_t Mp, int64_t D) {
  thread_local std::vector<bf16> bufs;
  bufs.resize(Hkv * Mp * D + 2 * Hkv * kBlock * D + 2 * Mp * kBlock);
  BlockBuffers b{};
  b.qp = bufs.data();
  b.kv_all = b.qp + Hkv * Mp * D;
  b.vv_all = b.kv_all + Hkv * kBlock * D;
  b.p_hi = b.vv_all + Hkv * kBlock * D;
  b.p_lo = b.p_hi + Mp * kBlock;
  b.per_head = Mp * D + 3 * Mp;
  b.scratch = thread_scratch(Hkv * b.per_head + Mp * kBlock);
  b.s = b.scratch + Hkv * b.per_head;
  std::fill(b.qp, b.qp + Hkv * Mp * D, bf16(0.0f));
  for (int64_t h = 0; h < Hkv; ++h) {
    float* acc = b.scratch + h * b.per_head;
    std::fill(acc, acc + Mp * D, 0.0f);
    std::fill(acc + Mp * D, acc + Mp * D + Mp, kNegInf);
    std::fill(acc + Mp * D + Mp, acc + Mp * D + 2 * Mp, 0.0f);
  }
  return b;
}

struct KeyRange {
  int64_t row, start, end;  // positions [start, end) of req_to_token row `row`
  int64_t causal_limit;     // extend: query row m sees positions < causal_limit + m / group; < 0: all
  int64_t group;
};

// Each kv head's acc, row max and row sum for qp's M rows over the keys of `keys`.
void attend_block(const PoolView& pool, const KeyRange& keys, int64_t M, float scale, float logit_cap,
                  const bf16* k_buf, const bf16* v_buf, const BlockBuffers& b) {
  const int64_t D = pool.head_dim;
  const int64_t Hkv = pool.num_kv_heads;
  const int64_t Mp = round_up(M, kRows);
  const bf16* k_rows[kBlock];
  const bf16* v_rows[kBlock];
  load_full_tile_config();
  for (int64_t start = keys.start; start < keys.end; start += kBlock) {
    const int64_t n = std::min(kBlock, keys.end - start);
    const RowLimits limits{keys.causal_limit >= 0, keys.causal_limit - start, keys.group};
    gather_block_rows(pool, keys.row, start, n, k_buf, v_buf, k_rows, v_rows);
    // Every head's K and V packed first: the tile loads then read lines the packing wrote
    // well before (a tile load right after the stores it reads waits for them).
    for (int64_t h = 0; h < Hkv; ++h) {
      pack_keys(k_rows, n, D, h * D, b.kv_all + h * kBlock * D);
      pack_values(v_rows, n, D, h * D, b.vv_all + h * kBlock * D);
    }
    for (int64_t h = 0; h < Hkv; ++h) {
      const bf16* kv = b.kv_all + h * kBlock * D;
      const bf16* vv = b.vv_all + h * kBlock * D;
      float* acc = b.scratch + h * b.per_head;
      float* row_max = acc + Mp * D;
      float* row_sum = row_max + Mp;
      float* alpha = row_sum + Mp;
      // Three passes over the row tiles, so that what the vector code writes has left the store
      // buffer before a tile load reads it (and the other way round).
      for (int64_t r0 = 0; r0 < Mp; r0 += kRows) {
        scores_tile(b.qp + h * Mp * D + r0 * D, D, kv, b.s + r0 * kBlock);
      }
      for (int64_t r0 = 0; r0 < Mp; r0 += kRows) {
        softmax_rows(b.s + r0 * kBlock, std::min(kRows, M - r0), n, limits, r0, scale, logit_cap,
                     row_max + r0, row_sum + r0, alpha + r0, b.p_hi + r0 * kBlock, b.p_lo + r0 * kBlock);
      }
      for (int64_t r = 0; r < M; ++r) {
        if (alpha[r] != 1.0f) scale_row(acc + r * D, D, alpha[r]);
      }
      for (int64_t r0 = 0; r0 < Mp; r0 += kRows) {
        values_tile(b.p_hi + r0 * kBlock, b.p_lo + r0 * kBlock, vv, D, acc + r0 * D);
      }
    }
  }
  release_tiles();
}

}  // namespace

bool cascade_amx_available() { return amx_tiles_available(); }

void cascade_unit_task_amx(const CascadeUnits& a, const bf16* q, const bf16* k_buf,
                           const bf16* v_buf, int64_t u) {
  const int64_t D = a.pool.head_dim;
  const int64_t G = a.group;
  const int64_t Hkv = a.pool.num_kv_heads;
  const int64_t m0 = a.member_ptr[u];
  const int64_t num_members = a.member_ptr[u + 1] - m0;
  const int64_t M = num_members * G;  // query rows per kv head, member-major: j * G + g
  const int64_t Mp = round_up(M, kRows);
  const BlockBuffers b = block_buffers(Hkv, Mp, D);
  for (int64_t j = 0; j < num_members; ++j) {
    const int64_t member = a.members[m0 + j];
    for (int64_t h = 0; h < a.num_heads; ++h) {
      const int64_t m = (h / G) * Mp * D + (j * G + h % G) * D;
      std::memcpy(b.qp + m, q + member * a.q_stride0 + h * a.q_stride1, D * sizeof(bf16));
    }
  }
  attend_block(a.pool, {a.unit_rows[u], a.unit_start[u], a.unit_end[u], -1, G}, M, a.scale,
               a.logit_cap, k_buf, v_buf, b);
  for (int64_t h = 0; h < Hkv; ++h) {
    const float* acc = b.scratch + h * b.per_head;
    store_unit_partials(a, u, h, acc, acc + Mp * D, acc + Mp * D + Mp);
  }
}

void extend_block_amx(const AmxExtendBlock& e, const bf16* q, const bf16* k_buf, const bf16* v_buf,
                      bf16* out) {
  const int64_t D = e.pool.head_dim;
  const int64_t G = e.group;
  const int64_t Hkv = e.pool.num_kv_heads;
  const int64_t M = e.num_queries * G;  // query rows per kv head, query-major: j * G + g
  const int64_t Mp = round_up(M, kRows);
  const BlockBuffers b = block_buffers(Hkv, Mp, D);
  for (int64_t j = 0; j < e.num_queries; ++j) {
    for (int64_t h = 0; h < Hkv * G; ++h) {
      const int64_t m = (h / G) * Mp * D + (j * G + h % G) * D;
      std::memcpy(b.qp + m, q + (e.first_token + j) * e.q_stride0 + h * e.q_stride1, D * sizeof(bf16));
    }
  }
  const int64_t first_limit = e.first_pos + 1;  // the first query sees positions <= first_pos
  attend_block(e.pool, {e.row, 0, e.first_pos + e.num_queries, first_limit, G}, M, e.scale,
               e.logit_cap, k_buf, v_buf, b);
  for (int64_t h = 0; h < Hkv; ++h) {
    const float* acc = b.scratch + h * b.per_head;
    const float* row_sum = acc + Mp * D + Mp;
    for (int64_t j = 0; j < e.num_queries; ++j) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t m = j * G + g;
        store_scaled(acc + m * D, out + (e.first_token + j) * e.out_stride0 + (h * G + g) * e.out_stride1,
                     D, 1.0f / row_sum[m]);
      }
    }
  }
}

#else  // no AVX-512 in this build: no AMX kernel

bool cascade_amx_available() { return false; }

void cascade_unit_task_amx(const CascadeUnits&, const bf16*, const bf16*, const bf16*, int64_t) {
  TORCH_CHECK(false, "this build of the native kernels has no AMX code");
}

void extend_block_amx(const AmxExtendBlock&, const bf16*, const bf16*, const bf16*, bf16*) {
  TORCH_CHECK(false, "this build of the native kernels has no AMX code");
}

#endif

}  // namespace radixengine::cpu
