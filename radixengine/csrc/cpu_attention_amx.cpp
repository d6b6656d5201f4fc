// Attention of a block of query rows over keys of one req_to_token row on AMX tiles (bf16): the
// unit kernel of the shared-prefix decode pass (cpu_cascade.h: a unit's members' query heads over
// their shared keys) and the block kernel of extend (a request's block of new tokens over its
// keys, causal).
//
// One task computes a whole block, every kv head, in passes of up to 256 keys: a pass reads whole
// pool rows (all heads of a slot) once, then per head packs its K and V into the VNNI layout the
// tile B operand needs (pairs of consecutive K-dimension values side by side) and, per 16 query
// rows, computes
//   S [16][pass] = Q [16][D] * K^T            (tdpbf16ps: bf16 products, fp32 sums)
//   softmax along each row of S               (fp32, AVX-512; one max and one sum reduction per
//                                             row and pass, exponentials in base 2)
//   O [16][D] += P [16][pass] * V [pass][D]   (P rounded once to bf16, as SGLang's CPU and the
//                                             GPU flash kernels do; O stays in the tiles for the
//                                             whole pass)
// Row tiles are software-pipelined: one tile's softmax runs on the vector units while the next
// tile's scores and this tile's products run on the tiles, and no tile load reads what a vector
// store has just written. Passes of 256 keys measured fastest (64 and 128 were 10-15% slower on
// the 32 x 420 shared-prefix case: more passes, each with its max/sum and accumulator rescale).
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

constexpr int64_t kBlock = 64;   // keys per K block (four score tiles)
constexpr int64_t kPass = 256;   // keys per softmax pass
constexpr int64_t kRows = 16;    // query rows per tile
constexpr float kLn2 = 0.693147180559945309f;
// The score of a key a row does not see: its weight 2^((kHidden - max) * c) is 0, and as every
// row sees a key in its first pass (a unit's rows all of them, extend's the first key), it never
// becomes a row's max.
constexpr float kHidden = -1e30f;

// Keys a query row sees within a pass of n keys: all n (a shared unit), or under the causal
// mask of extend, those before min(n, limit0 + row / group) (limit0: the block's first query's
// position + 1 - the pass's first key position).
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

// 2^x for x <= 0 (finite, or NaN: stays NaN): 2^f on f in [-0.5, 0.5] by its Taylor
// polynomial of degree 5 in f * ln 2 (relative error < 4e-6, far below the bf16 rounding of the
// weights), times 2^round(x); below -150 the result is 0.
inline __m512 exp2_ps(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558146428443e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Tiles 0-3: C (16 rows x 16 fp32); 4, 5: A (16 rows x 32 bf16); 6, 7: B (16 rows x 32 bf16).
// Consecutive products take their operands from alternating tiles, so that a tile load does not
// wait for the product still reading that tile.

// s [16][kBlock] (row stride ld floats) = qp rows [16][D] * kv (VNNI [D / 2][kBlock * 2]).
void scores_tile(const bf16* qp, int64_t D, const bf16* kv, float* s, int64_t ld) {
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
  _tile_stored(0, s + 0, ld * 4);
  _tile_stored(1, s + 16, ld * 4);
  _tile_stored(2, s + 32, ld * 4);
  _tile_stored(3, s + 48, ld * 4);
}

// acc [16][D] = (acc if load_acc, else 0) + p [16][np] (row stride ldp) * vv (VNNI
// [np / 2][D * 2]); np a multiple of kBlock. Each 64-column slice of acc stays in the C tiles
// for the whole pass.
void values_pass(const bf16* p, int64_t ldp, int64_t np, const bf16* vv, int64_t D, float* acc,
                 bool load_acc) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int64_t nt = std::min<int64_t>(4, (D - d0) / 16);
    if (load_acc) {
      if (nt > 0) _tile_loadd(0, acc + d0 + 0, D * 4);
      if (nt > 1) _tile_loadd(1, acc + d0 + 16, D * 4);
      if (nt > 2) _tile_loadd(2, acc + d0 + 32, D * 4);
      if (nt > 3) _tile_loadd(3, acc + d0 + 48, D * 4);
    } else {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t k = 0; k < np; k += 64) {
      const bf16* b = vv + (k / 2) * D * 2 + d0 * 2;
      _tile_loadd(4, p + k, ldp * 2);
      if (nt > 0) { _tile_loadd(6, b + 0, D * 4); _tile_dpbf16ps(0, 4, 6); }
      if (nt > 1) { _tile_loadd(7, b + 32, D * 4); _tile_dpbf16ps(1, 4, 7); }
      if (nt > 2) { _tile_loadd(6, b + 64, D * 4); _tile_dpbf16ps(2, 4, 6); }
      if (nt > 3) { _tile_loadd(7, b + 96, D * 4); _tile_dpbf16ps(3, 4, 7); }
      b += 16 * D * 2;
      _tile_loadd(5, p + k + 32, ldp * 2);
      if (nt > 0) { _tile_loadd(6, b + 0, D * 4); _tile_dpbf16ps(0, 5, 6); }
      if (nt > 1) { _tile_loadd(7, b + 32, D * 4); _tile_dpbf16ps(1, 5, 7); }
      if (nt > 2) { _tile_loadd(6, b + 64, D * 4); _tile_dpbf16ps(2, 5, 6); }
      if (nt > 3) { _tile_loadd(7, b + 96, D * 4); _tile_dpbf16ps(3, 5, 7); }
    }
    if (nt > 0) _tile_stored(0, acc + d0 + 0, D * 4);
    if (nt > 1) _tile_stored(1, acc + d0 + 16, D * 4);
    if (nt > 2) _tile_stored(2, acc + d0 + 32, D * 4);
    if (nt > 3) _tile_stored(3, acc + d0 + 48, D * 4);
  }
}

void release_tiles() { _tile_release(); }

// One row tile's softmax over a pass (its first `rows` rows; the others are padding, whose
// weights are left as they are): s [16][ld] holds the scores of ncols keys (a multiple of
// kBlock) of which row r sees the first limits.keys(row0 + r, n) (the others are set to
// kHidden); c > 0 converts a score to log2 units (scale * log2(e), or log2(e) after
// soft-capping, which scales first). Running max (log2 units) and sum are updated (set on the
// first pass); p [16][ld] = the bf16 weights (rounded to nearest even); alpha = the factor for
// the row's earlier accumulation (not set on the first pass).
void softmax_pass(float* s, int64_t ld, int64_t n, int64_t ncols, const RowLimits& limits,
                  int64_t row0, int64_t rows, float scale, float c, float logit_cap, bool first,
                  float* row_max, float* row_sum, float* alpha, bf16* p) {
  const __m512 cv = _mm512_set1_ps(c);
  alignas(64) float sums[kRows];
  alignas(64) float maxes[kRows];
  std::fill(sums + rows, sums + kRows, 1.0f);  // rows past `rows`: padding, never read
  std::fill(maxes + rows, maxes + kRows, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    float* x = s + r * ld;
    const int64_t seen = limits.keys(row0 + r, n);
    if (logit_cap > 0.0f) {
      for (int64_t i = 0; i < seen; ++i) x[i] *= scale;
      soft_cap(x, seen, logit_cap);
    }
    for (int64_t i = seen & ~int64_t{15}; i < ncols; i += 16) {
      const int64_t valid = std::max<int64_t>(seen - i, 0);
      _mm512_storeu_ps(x + i, _mm512_mask_mov_ps(_mm512_set1_ps(kHidden), (1u << valid) - 1,
                                                 _mm512_loadu_ps(x + i)));
    }
    __m512 mx0 = _mm512_loadu_ps(x), mx1 = _mm512_loadu_ps(x + 16);
    for (int64_t i = 32; i < ncols; i += 32) {
      mx0 = _mm512_max_ps(mx0, _mm512_loadu_ps(x + i));
      mx1 = _mm512_max_ps(mx1, _mm512_loadu_ps(x + i + 16));
    }
    const float pass_max = _mm512_reduce_max_ps(_mm512_max_ps(mx0, mx1)) * c;
    const float new_max = first ? pass_max : std::max(row_max[r], pass_max);
    const __m512 mv = _mm512_set1_ps(new_max);
    __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
    for (int64_t i = 0; i < ncols; i += 32) {
      const __m512 p0 = exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(x + i), cv, mv));
      const __m512 p1 = exp2_ps(_mm512_fmsub_ps(_mm512_loadu_ps(x + i + 16), cv, mv));
      sum0 = _mm512_add_ps(sum0, p0);
      sum1 = _mm512_add_ps(sum1, p1);
      _mm512_storeu_si512(p + r * ld + i, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));
    }
    sums[r] = _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
    maxes[r] = new_max;
  }
  const __m512 new_max = _mm512_load_ps(maxes);
  if (first) {
    _mm512_storeu_ps(row_sum, _mm512_load_ps(sums));
  } else {
    // The rows' rescale factors 2^(old max - new max), 16 at once.
    const __m512 a = exp2_ps(_mm512_sub_ps(_mm512_loadu_ps(row_max), new_max));
    _mm512_storeu_ps(alpha, a);
    _mm512_storeu_ps(row_sum, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum), a, _mm512_load_ps(sums)));
  }
  _mm512_storeu_ps(row_max, new_max);
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

// Per-thread buffers of one block: qp [Hkv][Mp][D] (the query rows per kv head, rows >= M zero);
// two heads' K (VNNI, per block of kBlock keys) and V (VNNI) of a pass (one head's packed while
// the other's computed); two row tiles' S [kRows][kPass] and P [kRows][kPass] (one tile's softmax
// runs while the other's products do); fp32 per kv head h at scratch + h * per_head: acc [Mp][D],
// row max [Mp], row sum [Mp], alpha [Mp].
struct BlockBuffers {
  bf16* qp;
  bf16* kv[2];
  bf16* vv[2];
  bf16* p[2];
  float* s[2];
  float* scratch;
  int64_t per_head;
};

BlockBuffers block_buffers(int64_t Hkv, int64_t Mp, int64_t D) {
  thread_local std::vector<bf16> bufs;
  bufs.resize(Hkv * Mp * D + 4 * kPass * D + 2 * kRows * kPass);
  BlockBuffers b{};
  b.qp = bufs.data();
  b.kv[0] = b.qp + Hkv * Mp * D;
  b.kv[1] = b.kv[0] + kPass * D;
  b.vv[0] = b.kv[1] + kPass * D;
  b.vv[1] = b.vv[0] + kPass * D;
  b.p[0] = b.vv[1] + kPass * D;
  b.p[1] = b.p[0] + kRows * kPass;
  b.per_head = Mp * D + 3 * Mp;
  b.scratch = thread_scratch(Hkv * b.per_head + 2 * kRows * kPass);
  b.s[0] = b.scratch + Hkv * b.per_head;
  b.s[1] = b.s[0] + kRows * kPass;
  std::fill(b.qp, b.qp + Hkv * Mp * D, bf16(0.0f));
  return b;
}

struct KeyRange {
  int64_t row, start, end;  // positions [start, end) of req_to_token row `row`
  int64_t causal_limit;     // extend: query row m sees positions < causal_limit + m / group; < 0: all
  int64_t group;
};

// Head h's K (per block of kBlock keys) and V of the n keys at k_rows / v_rows, into VNNI.
void pack_head(const bf16* const* k_rows, const bf16* const* v_rows, int64_t n, int64_t h,
               int64_t D, bf16* kv, bf16* vv) {
  for (int64_t i = 0; i < n; i += kBlock) {
    const int64_t nb = std::min(kBlock, n - i);
    pack_keys(k_rows + i, nb, D, h * D, kv + i * D);
    pack_values(v_rows + i, nb, D, h * D, vv + i * D);
  }
}

// One kv head's pass: per row tile, S = Q K^T (all of the pass's keys), the softmax along its
// rows, O += P V. Software-pipelined over the row tiles: tile t + 1's scores and tile t's
// products run on the tiles while the vector units do the softmax, and no tile load reads what a
// vector store has just written (or the other way round).
void attend_head(const BlockBuffers& b, int64_t h, int64_t M, int64_t Mp, int64_t D, int64_t n,
                 const RowLimits& limits, float scale, float c, float logit_cap, bool first) {
  const int64_t ncols = round_up(n, kBlock);
  const bf16* qp = b.qp + h * Mp * D;
  const bf16* kv = b.kv[h & 1];
  const bf16* vv = b.vv[h & 1];
  float* acc = b.scratch + h * b.per_head;
  float* row_max = acc + Mp * D;
  float* row_sum = row_max + Mp;
  float* alpha = row_sum + Mp;
  const int64_t tiles = Mp / kRows;
  const auto scores = [&](int64_t t) {
    for (int64_t i = 0; i < ncols; i += kBlock) {
      scores_tile(qp + t * kRows * D, D, kv + i * D, b.s[t & 1] + i, kPass);
    }
  };
  const auto softmax = [&](int64_t t) {
    const int64_t r0 = t * kRows;
    softmax_pass(b.s[t & 1], kPass, n, ncols, limits, r0, std::min(kRows, M - r0), scale, c,
                 logit_cap, first,
                 row_max + r0, row_sum + r0, alpha + r0, b.p[t & 1]);
    if (!first) {
      for (int64_t r = r0; r < r0 + kRows; ++r) {
        if (alpha[r] != 1.0f) scale_row(acc + r * D, D, alpha[r]);
      }
    }
  };
  scores(0);
  softmax(0);
  for (int64_t t = 0; t < tiles; ++t) {
    if (t + 1 < tiles) scores(t + 1);
    values_pass(b.p[t & 1], kPass, ncols, vv, D, acc + t * kRows * D, !first);
    if (t + 1 < tiles) softmax(t + 1);
  }
}

// Each kv head's acc, row max (log2 units) and row sum for qp's M rows over the keys of `keys`,
// in passes of kPass keys.
void attend_block(const PoolView& pool, const KeyRange& keys, int64_t M, float scale, float logit_cap,
                  const bf16* k_buf, const bf16* v_buf, const BlockBuffers& b) {
  const int64_t D = pool.head_dim;
  const int64_t Hkv = pool.num_kv_heads;
  const int64_t Mp = round_up(M, kRows);
  const float c = (logit_cap > 0.0f ? 1.0f : scale) * kLog2e;
  const bf16* k_rows[kPass];
  const bf16* v_rows[kPass];
  load_full_tile_config();
  for (int64_t start = keys.start; start < keys.end; start += kPass) {
    const int64_t n = std::min(kPass, keys.end - start);
    const RowLimits limits{keys.causal_limit >= 0, keys.causal_limit - start, keys.group};
    gather_block_rows(pool, keys.row, start, n, k_buf, v_buf, k_rows, v_rows);
    pack_head(k_rows, v_rows, n, 0, D, b.kv[0], b.vv[0]);
    for (int64_t h = 0; h < Hkv; ++h) {
      if (h + 1 < Hkv) pack_head(k_rows, v_rows, n, h + 1, D, b.kv[(h + 1) & 1], b.vv[(h + 1) & 1]);
      attend_head(b, h, M, Mp, D, n, limits, scale, c, logit_cap, start == keys.start);
    }
  }
  release_tiles();
}

}  // namespace

bool cascade_amx_available() { return amx_tiles_available(); }

namespace {

// The members' query heads (member j: batch index members[j], its partial into slot slots[j])
// over positions [start, end) of req_to_token row `row`, every kv head.
void attend_members_amx(const CascadeUnits& a, const bf16* q, const bf16* k_buf,
                        const bf16* v_buf, int64_t row, int64_t start, int64_t end,
                        const int64_t* members, const int64_t* slots, int64_t num_members) {
  const int64_t D = a.pool.head_dim;
  const int64_t G = a.group;
  const int64_t Hkv = a.pool.num_kv_heads;
  const int64_t M = num_members * G;  // query rows per kv head, member-major: j * G + g
  const int64_t Mp = round_up(M, kRows);
  const BlockBuffers b = block_buffers(Hkv, Mp, D);
  for (int64_t j = 0; j < num_members; ++j) {
    for (int64_t h = 0; h < a.num_heads; ++h) {
      const int64_t m = (h / G) * Mp * D + (j * G + h % G) * D;
      std::memcpy(b.qp + m, q + members[j] * a.q_stride0 + h * a.q_stride1, D * sizeof(bf16));
    }
  }
  attend_block(a.pool, {row, start, end, -1, G}, M, a.scale, a.logit_cap, k_buf, v_buf, b);
  for (int64_t h = 0; h < Hkv; ++h) {
    float* acc = b.scratch + h * b.per_head;
    float* row_max = acc + Mp * D;
    for (int64_t m = 0; m < M; ++m) row_max[m] *= kLn2;  // log2 units to natural
    store_partials(a, members, slots, num_members, h, acc, row_max, row_max + Mp);
  }
}

}  // namespace

void cascade_unit_task_amx(const CascadeUnits& a, const bf16* q, const bf16* k_buf,
                           const bf16* v_buf, int64_t u) {
  const int64_t m0 = a.member_ptr[u];
  attend_members_amx(a, q, k_buf, v_buf, a.unit_rows[u], a.unit_start[u], a.unit_end[u],
                     a.members + m0, a.member_slots + m0, a.member_ptr[u + 1] - m0);
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
