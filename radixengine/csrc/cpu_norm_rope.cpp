// Fused small ops of a decoder layer: RMSNorm (with the residual add) and rotary embedding in
// place. One pass over each row instead of several torch ops (and their temporaries).
//
// Rounding follows the torch code they replace (radixengine/layers/layernorm.py,
// rotary_embedding.py): in bfloat16 each intermediate a torch op would store in bf16 is rounded
// to bf16 here too, so results agree with torch to the last bit in most elements.
#include "cpu_common.h"
#include "cpu_ops.h"

namespace radixengine::cpu {
namespace {

// Elements per parallel chunk: a decode step's rows stay on the calling thread.
constexpr int64_t kParallelElems = 1 << 16;

inline int64_t grain_rows(int64_t row_elems) {
  return std::max<int64_t>(1, kParallelElems / std::max<int64_t>(1, row_elems));
}

// out = rms_norm(x) * w for one row. float32: x * rsqrt(mean(x^2) + eps) * w. bfloat16 (as the
// torch module): normalised in fp32, rounded to bf16, then multiplied by w in bf16.
template <typename T>
inline void rms_norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  const int64_t nv = n / kVecWidth * kVecWidth;
  VecF acc = VecF::zero();
  for (int64_t i = 0; i < nv; i += kVecWidth) {
    const VecF v = VecF::load(x + i);
    acc = fmadd(v, v, acc);
  }
  float sum = hsum(acc);
  for (int64_t i = nv; i < n; ++i) sum += to_float(x[i]) * to_float(x[i]);
  const float rstd = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  const VecF rv = VecF::broadcast(rstd);
  for (int64_t i = 0; i < nv; i += kVecWidth) {
    const VecF normed = round_to<T>(VecF::load(x + i) * rv);
    (normed * VecF::load(w + i)).store(out + i);
  }
  for (int64_t i = nv; i < n; ++i) {
    const float normed = to_float(from_float<T>(to_float(x[i]) * rstd));
    out[i] = from_float<T>(normed * to_float(w[i]));
  }
}

void check_norm(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name,
              ": x must be [tokens, hidden] with unit stride");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), name,
              ": weight must be a contiguous [hidden]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), name, ": weight dtype ",
              weight.scalar_type(), " differs from x dtype ", x.scalar_type());
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps) {
  const at::Tensor x = x_in.dim() == 2 && x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  check_norm(x, weight, "rms_norm");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t T = x.size(0), n = x.size(1);
  RADIX_DISPATCH_FLOAT_BF16(x.scalar_type(), "rms_norm", S, [&] {
    const S* xp = x.data_ptr<S>();
    const S* wp = weight.data_ptr<S>();
    S* op = out.data_ptr<S>();
    const int64_t ld = x.stride(0);
    at::parallel_for(0, T, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rms_norm_row(xp + t * ld, wp, op + t * n, n, static_cast<float>(eps));
      }
    });
  });
  return out;
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_norm(x, weight, "fused_add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  residual.stride(1) == 1,
              "fused_add_rms_norm: residual must match x");
  const int64_t T = x.size(0), n = x.size(1);
  RADIX_DISPATCH_FLOAT_BF16(x.scalar_type(), "fused_add_rms_norm", S, [&] {
    S* xp = x.data_ptr<S>();
    S* rp = residual.data_ptr<S>();
    const S* wp = weight.data_ptr<S>();
    const int64_t ldx = x.stride(0), ldr = residual.stride(0);
    const int64_t nv = n / kVecWidth * kVecWidth;
    at::parallel_for(0, T, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        S* xr = xp + t * ldx;
        S* rr = rp + t * ldr;
        for (int64_t i = 0; i < nv; i += kVecWidth) {
          (VecF::load(xr + i) + VecF::load(rr + i)).store(rr + i);
        }
        for (int64_t i = nv; i < n; ++i) rr[i] = from_float<S>(to_float(xr[i]) + to_float(rr[i]));
        rms_norm_row(rr, wp, xr, n, static_cast<float>(eps));
      }
    });
  });
}

void rotary_embedding(const at::Tensor& positions_in, at::Tensor& x,
                      const at::Tensor& cos_sin_cache, int64_t rotary_dim) {
  TORCH_CHECK(x.device().is_cpu(), "rotary_embedding: CPU tensors only");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1,
              "rotary_embedding: x must be [tokens, heads, head_dim] with unit stride");
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= x.size(2), "rotary_embedding: bad rotary_dim ",
              rotary_dim);
  TORCH_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == rotary_dim &&
                  cos_sin_cache.is_contiguous() && cos_sin_cache.scalar_type() == x.scalar_type(),
              "rotary_embedding: cos_sin_cache must be a contiguous [max_position, rotary_dim] "
              "in x's dtype");
  const at::Tensor positions = as_int64(positions_in);
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(positions.numel() == T, "rotary_embedding: one position per token");
  const int64_t half = rotary_dim / 2;
  const int64_t hv = half / kVecWidth * kVecWidth;
  const int64_t max_pos = cos_sin_cache.size(0);
  RADIX_DISPATCH_FLOAT_BF16(x.scalar_type(), "rotary_embedding", S, [&] {
    S* xp = x.data_ptr<S>();
    const S* cache = cos_sin_cache.data_ptr<S>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t s0 = x.stride(0), s1 = x.stride(1);
    at::parallel_for(0, T, grain_rows(H * rotary_dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_embedding: position ", pos[t],
                    " outside the cache of ", max_pos);
        const S* cos = cache + pos[t] * rotary_dim;
        const S* sin = cos + half;
        for (int64_t h = 0; h < H; ++h) {
          S* x1 = xp + t * s0 + h * s1;
          S* x2 = x1 + half;
          // Neox style: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each product rounded
          // to S before the add, as the torch expression does.
          for (int64_t i = 0; i < hv; i += kVecWidth) {
            const VecF a = VecF::load(x1 + i), b = VecF::load(x2 + i);
            const VecF c = VecF::load(cos + i), s = VecF::load(sin + i);
            const VecF o1 = round_to<S>(a * c) - round_to<S>(b * s);
            const VecF o2 = round_to<S>(b * c) + round_to<S>(a * s);
            o1.store(x1 + i);
            o2.store(x2 + i);
          }
          for (int64_t i = hv; i < half; ++i) {
            const float a = to_float(x1[i]), b = to_float(x2[i]);
            const float c = to_float(cos[i]), s = to_float(sin[i]);
            const float ac = to_float(from_float<S>(a * c)), bs = to_float(from_float<S>(b * s));
            const float bc = to_float(from_float<S>(b * c)), as = to_float(from_float<S>(a * s));
            x1[i] = from_float<S>(ac - bs);
            x2[i] = from_float<S>(bc + as);
          }
        }
      }
    });
  });
}

}  // namespace radixengine::cpu
