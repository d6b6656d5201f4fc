// bf16-stored linear y = x W^T (+ b) in fp32 arithmetic, for CPUs whose bf16 matmul has no
// native bf16 products (no AMX, no AVX512-BF16: there torch's bf16 matmul runs 4-5x slower than
// its fp32 one). W is packed once at load (bf16_pack_linear_weight):
//
//   packed [N / 32][K][32]:  packed[nb][k][c] = W[32 nb + c][k]
//
// so a panel of 32 output columns is one contiguous run of K * 64 bytes. Every vector of weights
// is widened to fp32 in registers (a 16-bit shift) and multiplied in fp32 with fp32 sums, so the
// result is x.float() @ W.float().T rounded once to x's dtype.
//
// Up to kDirectRows rows of x (a decode step) each task takes one panel and all rows, reading
// the bf16 panel straight into the register tiles: the weight streams from memory once, at half
// the bytes of fp32. More rows (prefill) are cut into blocks of kRowBlock; a task widens its
// panel once into fp32 scratch and runs the fp32 register tiles over the block, so the widening
// costs 1 / kRowBlock of the products.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <vector>

#include "cpu_common.h"
#include "cpu_gemm.h"
#include "cpu_ops.h"

namespace radixengine::cpu {

namespace {

constexpr int64_t kCols = 32;  // output columns per packed panel
constexpr int64_t kDirectRows = 24;  // up to this many rows the tiles read the bf16 panel
constexpr int64_t kRowBlock = 96;  // rows per prefill task (a multiple of kTileRows)

struct Bf16LinearArgs {
  const float* x;  // [M][K]
  const bf16* w;  // packed
  float* y;  // [M][N]
  int64_t M, N, K;
};

template <typename BT>
void panel_product(const Bf16LinearArgs& a, const BT* panel, int64_t m0, int64_t rows, int64_t nb) {
  thread_local std::vector<const float*> a_rows;
  thread_local std::vector<const BT*> b_rows;
  a_rows.resize(rows);
  b_rows.resize(a.K);
  for (int64_t i = 0; i < rows; ++i) a_rows[i] = a.x + (m0 + i) * a.K;
  for (int64_t k = 0; k < a.K; ++k) b_rows[k] = panel + k * kCols;
  gemm<BT>(rows, kCols, a.K, a_rows.data(), 1, b_rows.data(), 0, a.y + m0 * a.N + nb * kCols, a.N,
           false);
}

// panel [K][32] bf16 -> out [K][32] fp32.
void widen_panel(const bf16* panel, int64_t K, float* out) {
  for (int64_t i = 0; i < K * kCols; i += kVecWidth) VecF::load(panel + i).store(out + i);
}

void bf16_linear_kernel(const Bf16LinearArgs& a) {
  const int64_t panels = a.N / kCols;
  if (a.M <= kDirectRows) {
    run_tasks(panels, [&](int64_t nb) {
      panel_product<bf16>(a, a.w + nb * a.K * kCols, 0, a.M, nb);
    });
    return;
  }
  const int64_t row_blocks = (a.M + kRowBlock - 1) / kRowBlock;
  // Row block major: the threads work on the same rows of x at a time (each in its own L2).
  run_tasks(row_blocks * panels, [&](int64_t task) {
    const int64_t mb = task / panels, nb = task % panels;
    const int64_t m0 = mb * kRowBlock;
    float* panel = thread_scratch(a.K * kCols);
    widen_panel(a.w + nb * a.K * kCols, a.K, panel);
    panel_product<float>(a, panel, m0, std::min(kRowBlock, a.M - m0), nb);
  });
}

}  // namespace

at::Tensor bf16_pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "bf16_pack_linear_weight: weight must be a 2-D bfloat16 tensor");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kCols == 0, "bf16_pack_linear_weight: output features (", N,
              ") must be a multiple of ", kCols);
  return weight.reshape({N / kCols, kCols, K}).transpose(1, 2).contiguous();
}

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "bf16_linear: x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "bf16_linear: x must be float32 or bfloat16");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == kCols && packed.is_contiguous(),
              "bf16_linear: packed must come from bf16_pack_linear_weight");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0) * kCols;
  TORCH_CHECK(packed.size(1) == K, "bf16_linear: x has ", K, " features, the weight ",
              packed.size(1));
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M > 0 && K > 0) {
    bf16_linear_kernel({x32.data_ptr<float>(), packed.data_ptr<at::BFloat16>(),
                        y.data_ptr<float>(), M, N, K});
  } else {
    y.zero_();
  }
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bf16_linear: bias must be [N]");
    y.add_(bias->to(at::kFloat));
  }
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace radixengine::cpu
