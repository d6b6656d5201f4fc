// bf16 linear y = x W^T (+ b) on AMX tiles, for the few rows of a decode step, with W packed once
// at load into the layout the tile B operand reads (amx_pack_linear_weight):
//
//   packed [N / 32][K / 32][2][16][16][2]:  packed[nb][kb][t][p][c][e] = W[32 nb + 16 t + c][32 kb + 2 p + e]
//
// so that each block of 32 output columns is one contiguous run of K * 64 bytes, read once per
// call from front to back (a decode linear is bound by reading its weight). x rows are taken 32
// at a time (16 when fewer are left): per 32 K-values, two A tiles, two B tiles and four
// tdpbf16ps into four fp32 C tiles. Up to 32 rows (a decode or verify step) the tiles are
// configured to the rows there are, so a tile product costs only its rows (a verify step's 23
// rows multiply no padding); more rows are padded to a multiple of 16.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>

#include "cpu_amx.h"
#include "cpu_common.h"
#include "cpu_ops.h"
#include "cpu_tile_layout_linear.h"

namespace radixengine::cpu {

namespace {

constexpr int64_t kCols = kTileLayoutCols;  // output columns per block (two B tiles)
constexpr int64_t kDepth = kTileLayoutDepth;  // K values per tile product
constexpr int64_t kRowChunk = 256;  // rows of x per task (a multiple of 32)

struct AmxLinearArgs {
  const bf16* x;  // [Mp][K]: Mp = M up to 32 rows (one block, tiles of its rows), else M rounded
                  // up to 16 with zero rows (every block 16 or 32 rows, one tile configuration)
  const bf16* w;  // packed
  const float* bias;  // [N] or null
  bf16* y;  // [M][N]
  int64_t M, Mp, N, K;
};

#if RADIX_HAVE_AMX

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512bf16")

// The weight two K-steps ahead into L1: the hardware prefetcher alone leaves the tile loads
// waiting for memory (a whole step of the model's linears: 30 -> 21 ms at 32 rows).
inline void prefetch_ahead(const bf16* b) {
  const char* p = reinterpret_cast<const char*>(b + 2 * kDepth * kCols);
  for (int line = 0; line < kDepth * kCols * 2 / 64; ++line) _mm_prefetch(p + 64 * line, _MM_HINT_T0);
}

// c [rows][32] fp32 -> y rows (+ bias), rows <= 32.
void store_rows(const AmxLinearArgs& a, const float* c, int64_t m0, int64_t rows, int64_t n0) {
  const __m512 b0 = a.bias ? _mm512_loadu_ps(a.bias + n0) : _mm512_setzero_ps();
  const __m512 b1 = a.bias ? _mm512_loadu_ps(a.bias + n0 + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(c + r * kCols), b0);
    const __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(c + r * kCols + 16), b1);
    const __m512bh packed = _mm512_cvtne2ps_pbh(v1, v0);
    _mm512_storeu_si512(a.y + (m0 + r) * a.N + n0, reinterpret_cast<__m512i>(packed));
  }
}

// Rows m0 .. m0 + 31 of one column block: C tiles 0, 1 (rows 0-15), 2, 3 (rows 16-31).
void block_32_rows(const AmxLinearArgs& a, const bf16* wb, int64_t m0, bool prefetch, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const bf16* x0 = a.x + m0 * a.K;
  const bf16* x1 = x0 + 16 * a.K;
  for (int64_t k = 0; k < a.K; k += kDepth) {
    const bf16* b = wb + k * kCols;
    if (prefetch) prefetch_ahead(b);
    _tile_loadd(4, x0 + k, a.K * 2);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + 16 * kDepth, 64);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, x1 + k, a.K * 2);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, kCols * 4);
  _tile_stored(1, c + 16, kCols * 4);
  _tile_stored(2, c + 16 * kCols, kCols * 4);
  _tile_stored(3, c + 16 * kCols + 16, kCols * 4);
}

// Rows m0 .. m0 + 15 of one column block: C tiles 0, 1.
void block_16_rows(const AmxLinearArgs& a, const bf16* wb, int64_t m0, bool prefetch, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  const bf16* x0 = a.x + m0 * a.K;
  for (int64_t k = 0; k < a.K; k += kDepth) {
    const bf16* b = wb + k * kCols;
    if (prefetch) prefetch_ahead(b);
    _tile_loadd(4, x0 + k, a.K * 2);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + 16 * kDepth, 64);
    _tile_dpbf16ps(1, 4, 7);
  }
  _tile_stored(0, c, kCols * 4);
  _tile_stored(1, c + 16, kCols * 4);
}

// Column blocks nb0 .. nb1 - 1 of the rows m_begin .. m_end - 1 (blocks of 32 rows, the last of
// fewer): the tiles are configured to a block's rows, so a short block multiplies no padding.
void column_blocks(const AmxLinearArgs& a, int64_t nb0, int64_t nb1, int64_t m_begin, int64_t m_end) {
  alignas(64) float c[32 * kCols];
  int configured = -1;  // rows_a * 32 + rows_b of the configuration loaded
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const bf16* wb = a.w + nb * a.K * kCols;
    for (int64_t m0 = m_begin; m0 < m_end; m0 += 32) {
      const int64_t tile_rows = std::min<int64_t>(32, m_end - m0);
      const int rows_a = static_cast<int>(std::min<int64_t>(16, tile_rows));
      const int rows_b = tile_rows > 16 ? static_cast<int>(tile_rows - 16) : 16;
      if (rows_a * 32 + rows_b != configured) {
        load_tile_config(rows_a, rows_b);
        configured = rows_a * 32 + rows_b;
      }
      // The first rows stream the block from memory; the block is in cache for the others.
      const bool prefetch = m0 == m_begin;
      if (tile_rows > 16) {
        block_32_rows(a, wb, m0, prefetch, c);
      } else {
        block_16_rows(a, wb, m0, prefetch, c);
      }
      store_rows(a, c, m0, std::min<int64_t>(tile_rows, a.M - m0), nb * kCols);
    }
  }
  _tile_release();
}

#pragma GCC pop_options

void run_amx_linear(const AmxLinearArgs& a) {
  run_column_block_tasks(a.N / kCols, a.Mp, kRowChunk, [&](int64_t nb0, int64_t nb1, int64_t m0, int64_t m1) {
    column_blocks(a, nb0, nb1, m0, m1);
  });
}

#else

void run_amx_linear(const AmxLinearArgs&) {
  TORCH_CHECK(false, "amx_linear: this build of the native kernels has no AMX code");
}

#endif

}  // namespace

at::Tensor amx_pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "amx_pack_linear_weight: weight must be a bfloat16 CPU matrix [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kCols == 0 && K % kDepth == 0, "amx_pack_linear_weight: N = ", N,
              " must be a multiple of 32 and K = ", K, " of 32");
  return weight.contiguous()
      .view({N / kCols, 2, 16, K / kDepth, kDepth / 2, 2})
      .permute({0, 3, 1, 4, 2, 5})
      .contiguous();
}

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(amx_tiles_available(), "amx_linear: this CPU or build cannot use AMX tiles");
  const TileLayoutShape s = check_tile_layout_linear(x, packed, bias, "amx_linear");
  const int64_t M = s.M, N = s.N, K = s.K;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t Mp = M <= 32 ? M : round_up(M, 16);
  at::Tensor xp = x.contiguous();
  if (Mp != M) {
    xp = at::zeros({Mp, K}, x.options());
    xp.narrow(0, 0, M).copy_(x);
  }
  run_amx_linear({reinterpret_cast<const bf16*>(xp.data_ptr()),
                  reinterpret_cast<const bf16*>(packed.data_ptr()),
                  s.bias_f.defined() ? s.bias_f.data_ptr<float>() : nullptr,
                  reinterpret_cast<bf16*>(y.data_ptr()), M, Mp, N, K});
  return y;
}

}  // namespace radixengine::cpu
