// Grouped linear of the routed experts of a MoE layer: the rows of x are sorted by expert
// (expert e owns rows offsets[e] .. offsets[e + 1]) and each group is multiplied by its own
// expert's weight w[e] ([in, out] layout), read where it lies in the stacked [E, in, out] tensor.
//
// Small groups (decode) run as tasks of (expert, column block) over the register-tiled gemm of
// cpu_gemm.h, largest groups first, so the weights of every expert hit are streamed once by all
// threads together; a group of at least kBlasRows rows (prefill) is one BLAS matmul.
#include <ATen/ops/mm.h>

#include "cpu_common.h"
#include "cpu_gemm.h"
#include "cpu_ops.h"

namespace radixengine::cpu {
namespace {

constexpr int64_t kBlasRows = 64;
constexpr int64_t kColBlock = 64;

struct Task {
  int64_t expert;
  int64_t col0;
};

template <typename BT>
void small_groups(const float* x, const BT* w, const int64_t* offsets, const std::vector<int64_t>& experts,
                  int64_t K, int64_t N, float* out) {
  std::vector<Task> tasks;
  for (int64_t e : experts) {
    for (int64_t c = 0; c < N; c += kColBlock) tasks.push_back({e, c});
  }
  run_tasks(static_cast<int64_t>(tasks.size()), [&](int64_t t) {
    const Task task = tasks[t];
    const int64_t row0 = offsets[task.expert], rows = offsets[task.expert + 1] - row0;
    thread_local std::vector<const float*> a_rows;
    thread_local std::vector<const BT*> b_rows;
    a_rows.resize(rows);
    b_rows.resize(K);
    for (int64_t i = 0; i < rows; ++i) a_rows[i] = x + (row0 + i) * K;
    const BT* we = w + task.expert * K * N;
    for (int64_t k = 0; k < K; ++k) b_rows[k] = we + k * N;
    const int64_t cols = std::min(kColBlock, N - task.col0);
    gemm<BT>(rows, cols, K, a_rows.data(), 1, b_rows.data(), task.col0, out + row0 * N + task.col0, N,
             false);
  });
}

}  // namespace

at::Tensor moe_grouped_linear(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& offsets_in) {
  TORCH_CHECK(x_in.device().is_cpu() && w_in.device().is_cpu(), "moe_grouped_linear: CPU tensors only");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kFloat, "moe_grouped_linear: x must be float32 [M, K]");
  TORCH_CHECK(w_in.dim() == 3 && w_in.size(1) == x_in.size(1), "moe_grouped_linear: w must be [E, K, N] with K = ",
              x_in.size(1), ", got ", w_in.sizes());
  TORCH_CHECK(w_in.scalar_type() == at::kFloat || w_in.scalar_type() == at::kBFloat16,
              "moe_grouped_linear: w must be float32 or bfloat16");
  const int64_t E = w_in.size(0), K = w_in.size(1), N = w_in.size(2), M = x_in.size(0);
  TORCH_CHECK(N % kVecWidth == 0, "moe_grouped_linear: N (", N, ") must be a multiple of ", kVecWidth);
  TORCH_CHECK(offsets_in.dim() == 1 && offsets_in.size(0) == E + 1, "moe_grouped_linear: offsets must be [E + 1]");
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), offsets_t = as_int64(offsets_in);
  const int64_t* offsets = offsets_t.data_ptr<int64_t>();
  TORCH_CHECK(offsets[0] == 0 && offsets[E] == M, "moe_grouped_linear: offsets must run from 0 to M = ", M);
  at::Tensor out = at::empty({M, N}, x.options());
  std::vector<std::pair<int64_t, int64_t>> small;  // (rows, expert)
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = offsets[e + 1] - offsets[e];
    TORCH_CHECK(rows >= 0, "moe_grouped_linear: offsets must not decrease");
    if (rows >= kBlasRows) {
      const at::Tensor we = w.select(0, e);
      at::Tensor dst = out.narrow(0, offsets[e], rows);
      at::mm_out(dst, x.narrow(0, offsets[e], rows), we.scalar_type() == at::kFloat ? we : we.to(at::kFloat));
    } else if (rows > 0) {
      small.emplace_back(rows, e);
    }
  }
  std::stable_sort(small.begin(), small.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<int64_t> experts;
  for (const auto& s : small) experts.push_back(s.second);
  RADIX_DISPATCH_FLOAT_BF16(w.scalar_type(), "moe_grouped_linear", BT, [&] {
    small_groups<BT>(x.data_ptr<float>(), w.data_ptr<BT>(), offsets, experts, K, N, out.data_ptr<float>());
  });
  return out;
}

}  // namespace radixengine::cpu
