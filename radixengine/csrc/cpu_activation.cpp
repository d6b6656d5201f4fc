// SiLU-and-mul over a fused gate/up projection: out = silu(x[:, :d]) * x[:, d:], one pass over
// each row instead of the slice, silu and mul of the torch expression (and its temporaries).
//
// silu(g) = g / (1 + exp(-g)) with the kernels' exp (under 1 ulp); bfloat16 rounds silu(g) to
// bf16 before the multiply, as the torch expression stores it.
#include "cpu_common.h"
#include "cpu_ops.h"

namespace radixengine::cpu {
namespace {

constexpr int64_t kParallelElems = 1 << 15;

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

template <typename T>
inline void silu_and_mul_row(const T* gate, const T* up, T* out, int64_t d) {
  const VecF one = VecF::broadcast(1.0f);
  const VecF zero = VecF::zero();
  int64_t i = 0;
  for (; i + kVecWidth <= d; i += kVecWidth) {
    const VecF g = VecF::load(gate + i);
    const VecF act = round_to<T>(g / (one + vexp(zero - g)));
    (act * VecF::load(up + i)).store(out + i);
  }
  for (; i < d; ++i) {
    const float act = to_float(from_float<T>(silu(to_float(gate[i]))));
    out[i] = from_float<T>(act * to_float(up[i]));
  }
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.device().is_cpu(), "silu_and_mul: CPU tensors only");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) % 2 == 0, "silu_and_mul: x must be [tokens, 2 * d], got ",
              x_in.sizes());
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const int64_t T = x.size(0), d = x.size(1) / 2;
  at::Tensor out = at::empty({T, d}, x.options());
  RADIX_DISPATCH_FLOAT_BF16(x.scalar_type(), "silu_and_mul", S, [&] {
    const S* xp = x.data_ptr<S>();
    S* op = out.data_ptr<S>();
    const int64_t ld = x.stride(0);
    const int64_t grain = std::max<int64_t>(1, kParallelElems / std::max<int64_t>(1, d));
    at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) silu_and_mul_row(xp + t * ld, xp + t * ld + d, op + t * d, d);
    });
  });
  return out;
}

}  // namespace radixengine::cpu
