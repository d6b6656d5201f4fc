// bf16 linear y = x W^T (+ b) with AVX512-BF16 dot products (vdpbf16ps: bf16 pairs multiplied,
// summed into fp32), for CPUs that have them but no AMX (AMD Zen 4 and later). W is packed once
// at load in amx_pack_linear_weight's layout:
//
//   packed [N / 32][K / 32][2][16][16][2]:  packed[nb][kb][t][p][c][e] = W[32 nb + 16 t + c][32 kb + 2 p + e]
//
// so that packed[nb][kb][t][p] (16 outputs x one pair of inputs) is one 64-byte vector operand
// of vdpbf16ps, and a block of 32 output columns is one contiguous run of K * 64 bytes. A
// register tile is up to 8 rows x 32 columns (16 fp32 accumulators); per pair of inputs it loads
// two weight vectors and broadcasts each row's pair. A task takes a few column blocks and a chunk
// of rows, so that its blocks stay in L2 while the chunk's row tiles pass over them.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "cpu_amx.h"
#include "cpu_common.h"
#include "cpu_ops.h"
#include "cpu_tile_layout_linear.h"

#if RADIX_HAVE_AMX  // the AVX-512 build on x86-64 Linux: AVX512-BF16 code and its CPUID check
#define RADIX_HAVE_DPBF16 1
#include <immintrin.h>
#endif

namespace radixengine::cpu {

namespace {

constexpr int64_t kCols = kTileLayoutCols;
constexpr int64_t kDepth = kTileLayoutDepth;
constexpr int kTileRows = 8;        // rows of one register tile
constexpr int64_t kRowChunk = 128;  // rows of x per task

struct DpLinearArgs {
  const bf16* x;  // [M][K]
  const bf16* w;  // packed
  const float* bias;  // [N] or null
  bf16* y;  // [M][N]
  int64_t M, N, K;
};

#if RADIX_HAVE_DPBF16

#pragma GCC push_options
#pragma GCC target("avx512bf16")

// Prefetch the K-block of the weight at `b` (2 KB, 32 lines) into L1 (HINT = _MM_HINT_T0) or L2.
template <_mm_hint HINT>
inline void prefetch_block(const bf16* b) {
  const char* p = reinterpret_cast<const char*>(b);
  for (int line = 0; line < kDepth * kCols * 2 / 64; ++line) _mm_prefetch(p + 64 * line, HINT);
}

// y[m0 .. m0 + R) x [n0, n0 + 32) for one column block `wb`.
// Weights to bring into cache K-block by K-block alongside the tile's own, so that streaming
// them from memory overlaps the products (null: none): `ahead` into L1 (this block two K-blocks
// ahead), `next` into L2 (the next column block: this one and it do not both fit in L1).
template <int R>
void tile(const DpLinearArgs& a, const bf16* wb, int64_t m0, int64_t n0, const bf16* ahead, const bf16* next) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const bf16* x = a.x + m0 * a.K;
  for (int64_t kb = 0; kb < a.K / kDepth; ++kb) {
    const bf16* b = wb + kb * kDepth * kCols;
    const bf16* xk = x + kb * kDepth;
    // (prefetches never fault: `ahead` runs past the last block's end)
    if (ahead) prefetch_block<_MM_HINT_T0>(ahead + kb * kDepth * kCols);
    if (next) prefetch_block<_MM_HINT_T1>(next + kb * kDepth * kCols);
    for (int p = 0; p < kDepth / 2; ++p) {
      const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + p * 32));
      const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b + 16 * kDepth + p * 32));
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, xk + r * a.K + 2 * p, sizeof(pair));
        const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
      }
    }
  }
  const __m512 b0 = a.bias ? _mm512_loadu_ps(a.bias + n0) : _mm512_setzero_ps();
  const __m512 b1 = a.bias ? _mm512_loadu_ps(a.bias + n0 + 16) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) {
    const __m512bh out = _mm512_cvtne2ps_pbh(_mm512_add_ps(acc[r][1], b1), _mm512_add_ps(acc[r][0], b0));
    _mm512_storeu_si512(a.y + (m0 + r) * a.N + n0, reinterpret_cast<__m512i>(out));
  }
}

// A block's first row tile streams it from memory; with more tiles, the second one fetches the
// next block meanwhile, so only a task's first block (or every block, with one tile) is read
// ahead by its own first tile.
void column_blocks(const DpLinearArgs& a, int64_t nb0, int64_t nb1, int64_t m_begin, int64_t m_end) {
  const int64_t block = a.K * kCols;
  const bool one_tile = m_end - m_begin <= kTileRows;
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const bf16* wb = a.w + nb * block;
    for (int64_t m0 = m_begin; m0 < m_end; m0 += kTileRows) {
      const bool first = m0 == m_begin;
      const bf16* ahead = first && (one_tile || nb == nb0) ? wb + 2 * kDepth * kCols : nullptr;
      const bf16* next = m0 == m_begin + kTileRows && nb + 1 < nb1 ? wb + block : nullptr;
      with_rows<kTileRows>(static_cast<int>(std::min<int64_t>(kTileRows, m_end - m0)), [&](auto rows) {
        tile<decltype(rows)::value>(a, wb, m0, nb * kCols, ahead, next);
      });
    }
  }
}

#pragma GCC pop_options

void run_dpbf16_linear(const DpLinearArgs& a) {
  run_column_block_tasks(a.N / kCols, a.M, kRowChunk, [&](int64_t nb0, int64_t nb1, int64_t m0, int64_t m1) {
    column_blocks(a, nb0, nb1, m0, m1);
  });
}

#else

void run_dpbf16_linear(const DpLinearArgs&) {
  TORCH_CHECK(false, "dpbf16_linear: this build of the native kernels has no AVX512-BF16 code");
}

#endif

}  // namespace

bool dpbf16_available() {
#if RADIX_HAVE_DPBF16
  static const bool available = cpuid_avx512_bf16();
  return available;
#else
  return false;
#endif
}

at::Tensor dpbf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(dpbf16_available(), "dpbf16_linear: this CPU or build has no AVX512-BF16");
  const TileLayoutShape s = check_tile_layout_linear(x, packed, bias, "dpbf16_linear");
  const int64_t M = s.M, N = s.N, K = s.K;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const at::Tensor xc = x.contiguous();
  run_dpbf16_linear({reinterpret_cast<const bf16*>(xc.data_ptr()), reinterpret_cast<const bf16*>(packed.data_ptr()),
                     s.bias_f.defined() ? s.bias_f.data_ptr<float>() : nullptr, reinterpret_cast<bf16*>(y.data_ptr()),
                     M, N, K});
  return y;
}

}  // namespace radixengine::cpu
