// Writes the new tokens' K/V into the paged pool: k_buffer[loc[t]] = k[t] (same for v).
#include <cstring>

#include "cpu_common.h"
#include "cpu_ops.h"

namespace radixengine::cpu {
namespace {

// Bytes per parallel chunk: small writes (a decode step) stay on the calling thread.
constexpr int64_t kParallelBytes = 1 << 20;

template <typename SrcT, typename DstT>
void scatter_rows(DstT* dst, const SrcT* src, const int64_t* loc, int64_t T, int64_t num_heads,
                  int64_t D, int64_t src_stride0, int64_t src_stride1, int64_t num_slots) {
  const int64_t row = num_heads * D;
  const int64_t grain = std::max<int64_t>(1, kParallelBytes / (row * int64_t(sizeof(DstT))));
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = loc[t];
      TORCH_CHECK(slot >= 0 && slot < num_slots, "set_kv_buffer: loc ", slot,
                  " outside the KV buffer of ", num_slots, " slots");
      DstT* d = dst + slot * row;
      const SrcT* s = src + t * src_stride0;
      if constexpr (std::is_same_v<SrcT, DstT>) {
        if (src_stride1 == D) {
          std::memcpy(d, s, row * sizeof(DstT));
          continue;
        }
        for (int64_t h = 0; h < num_heads; ++h) {
          std::memcpy(d + h * D, s + h * src_stride1, D * sizeof(DstT));
        }
      } else {
        for (int64_t h = 0; h < num_heads; ++h) {
          int64_t i = 0;
          for (; i + kVecWidth <= D; i += kVecWidth) {
            VecF::load(s + h * src_stride1 + i).store(d + h * D + i);
          }
          for (; i < D; ++i) d[h * D + i] = from_float<DstT>(to_float(s[h * src_stride1 + i]));
        }
      }
    }
  });
}

void scatter(at::Tensor& buffer, const at::Tensor& loc, const at::Tensor& src_in,
             const char* which) {
  TORCH_CHECK(buffer.dim() == 3 && buffer.is_contiguous(), "set_kv_buffer: ", which,
              "_buffer must be a contiguous [num_slots, num_kv_heads, head_dim]");
  TORCH_CHECK(src_in.dim() == 3 && src_in.size(0) == loc.numel() &&
                  src_in.size(1) == buffer.size(1) && src_in.size(2) == buffer.size(2),
              "set_kv_buffer: ", which, " must be [len(loc), num_kv_heads, head_dim], got ",
              src_in.sizes());
  const at::Tensor src = src_in.stride(2) == 1 ? src_in : src_in.contiguous();
  const int64_t* lp = loc.data_ptr<int64_t>();
  RADIX_DISPATCH_KV(buffer.scalar_type(), "set_kv_buffer", DstT, [&] {
    RADIX_DISPATCH_FLOAT_BF16(src.scalar_type(), "set_kv_buffer", SrcT, [&] {
      scatter_rows(buffer.data_ptr<DstT>(), src.data_ptr<SrcT>(), lp, loc.numel(),
                   buffer.size(1), buffer.size(2), src.stride(0), src.stride(1),
                   buffer.size(0));
    });
  });
}

}  // namespace

void set_kv_buffer(at::Tensor& k_buffer, at::Tensor& v_buffer, const at::Tensor& loc_in,
                   const at::Tensor& k, const at::Tensor& v) {
  const at::Tensor loc = as_int64(loc_in);
  scatter(k_buffer, loc, k, "k");
  scatter(v_buffer, loc, v, "v");
}

}  // namespace radixengine::cpu
