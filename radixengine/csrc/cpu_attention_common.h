// Helpers shared by the attention kernels (plain decode/extend and the shared-prefix pass).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>

#include "cpu_common.h"
#include "cpu_vec.h"

namespace radixengine::cpu {

constexpr int64_t kMaxGroup = 64;         // query heads per kv head
constexpr int64_t kMinSplitLen = 128;     // shortest KV split in decode
constexpr int64_t kTasksPerThread = 4;    // decode split target

struct PoolView {
  int64_t num_slots;
  int64_t num_kv_heads;
  int64_t head_dim;
  const int32_t* req_to_token;
  int64_t max_context_len;
};

inline int64_t slot_at(const PoolView& pool, int64_t row, int64_t pos) {
  const int64_t slot = pool.req_to_token[row * pool.max_context_len + pos];
  TORCH_CHECK(slot >= 0 && slot < pool.num_slots, "req_to_token holds slot ", slot,
              " outside the KV buffer of ", pool.num_slots, " slots");
  return slot;
}

// dst[d] = src[d] * s (fp32), d < D (D is a multiple of the vector width).
template <typename T>
inline void load_scaled(const T* src, float* dst, int64_t D, float s) {
  const VecF sv = VecF::broadcast(s);
  for (int64_t d = 0; d < D; d += kVecWidth) (VecF::load(src + d) * sv).store(dst + d);
}

// dst[d] = src[d] * s, converted to the output type.
template <typename T>
inline void store_scaled(const float* src, T* dst, int64_t D, float s) {
  const VecF sv = VecF::broadcast(s);
  for (int64_t d = 0; d < D; d += kVecWidth) (VecF::load(src + d) * sv).store(dst + d);
}

// x[i] = cap * tanh(x[i] / cap) (scalar tanh: soft-capped models only).
inline void soft_cap(float* x, int64_t n, float cap) {
  const float inv = 1.0f / cap;
  for (int64_t i = 0; i < n; ++i) x[i] = cap * std::tanh(x[i] * inv);
}

// The first key position a query at `pos` reads: pos - window_left (0 without a window).
inline int64_t window_start(int64_t pos, int64_t window_left) {
  return window_left >= 0 ? std::max<int64_t>(0, pos - window_left) : 0;
}

inline void scale_row(float* x, int64_t D, float s) {
  const VecF sv = VecF::broadcast(s);
  for (int64_t d = 0; d < D; d += kVecWidth) (VecF::load(x + d) * sv).store(x + d);
}

// Reads one word of every cache line of a pool row (all kv heads of one slot) and returns their
// sum, which the caller keeps alive. Run over a whole key block before its compute, these
// independent loads keep many cache misses in flight at once; the compute's own loads, with
// arithmetic in between, do not. Measured on scattered slots (batch 8-32 x 512, 30 layers):
// decode 1.4-2x faster than reading in place; software prefetches of the next block gained
// 12-15% alone and nothing on top of this; copying the block out gained less and slowed the
// cache-resident case.
inline uint32_t touch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  uint32_t sum = 0;
  for (int64_t off = 0; off < bytes; off += 64) {
    uint32_t word;
    std::memcpy(&word, c + off, sizeof(word));
    sum += word;
  }
  return sum;
}

// k_rows[i] / v_rows[i] = the pool rows (all kv heads) of positions start .. start + n - 1 of
// req_to_token row `row`, each touched once (touch_row) so that their cache misses overlap.
template <typename KVT>
inline void gather_block_rows(const PoolView& pool, int64_t row, int64_t start, int64_t n,
                              const KVT* k_buf, const KVT* v_buf, const KVT** k_rows,
                              const KVT** v_rows) {
  const int64_t row_stride = pool.num_kv_heads * pool.head_dim;
  const int64_t row_bytes = row_stride * static_cast<int64_t>(sizeof(KVT));
  uint32_t touched = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t offset = slot_at(pool, row, start + i) * row_stride;
    k_rows[i] = k_buf + offset;
    v_rows[i] = v_buf + offset;
    touched += touch_row(k_rows[i], row_bytes) + touch_row(v_rows[i], row_bytes);
  }
  asm volatile("" : : "r"(touched));  // keep the loads
}

// Online softmax down the columns of S^T [n][ld] (one column per query row): each column's
// running max and sum are updated, S^T becomes exp(S^T - new max), and alpha holds the factor
// that rescales the column's earlier accumulation. `floor_max` keeps a column that has seen only
// masked (-inf) scores at -FLT_MAX, so that its weights stay 0 instead of NaN.
inline void softmax_columns(float* st, int64_t n, int64_t ld, float* row_max, float* row_sum,
                            float* alpha, bool floor_max) {
  const VecF max_floor = VecF::broadcast(-std::numeric_limits<float>::max());
  for (int64_t c = 0; c < ld; c += kVecWidth) {
    VecF mx = VecF::broadcast(kNegInf);
    for (int64_t i = 0; i < n; ++i) mx = vmax(mx, VecF::load(st + i * ld + c));
    const VecF old_max = VecF::load(row_max + c);
    const VecF new_max = floor_max ? vmax(max_floor, vmax(old_max, mx)) : vmax(old_max, mx);
    const VecF scale_old = vexp(old_max - new_max);
    VecF sum = VecF::zero();
    for (int64_t i = 0; i < n; ++i) {
      const VecF p = vexp(VecF::load(st + i * ld + c) - new_max);
      p.store(st + i * ld + c);
      sum = sum + p;
    }
    fmadd(VecF::load(row_sum + c), scale_old, sum).store(row_sum + c);
    new_max.store(row_max + c);
    scale_old.store(alpha + c);
  }
}

inline void check_pool(const at::Tensor& q, const at::Tensor& k_buffer,
                const at::Tensor& v_buffer, const at::Tensor& req_to_token,
                const char* name) {
  TORCH_CHECK(q.device().is_cpu() && k_buffer.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(q.dim() == 3, name, ": q must be 3-D, got ", q.sizes());
  TORCH_CHECK(k_buffer.dim() == 3 && v_buffer.sizes() == k_buffer.sizes(), name,
              ": k_buffer and v_buffer must be [num_slots, num_kv_heads, head_dim]");
  TORCH_CHECK(k_buffer.scalar_type() == v_buffer.scalar_type(), name,
              ": k_buffer and v_buffer dtypes differ");
  TORCH_CHECK(k_buffer.is_contiguous() && v_buffer.is_contiguous(), name,
              ": k_buffer and v_buffer must be contiguous");
  TORCH_CHECK(req_to_token.scalar_type() == at::kInt && req_to_token.dim() == 2 &&
                  req_to_token.is_contiguous(),
              name, ": req_to_token must be a contiguous int32 [max_reqs, max_context_len]");
  const int64_t D = q.size(2);
  TORCH_CHECK(k_buffer.size(2) == D, name, ": head_dim of q (", D, ") and the KV buffer (",
              k_buffer.size(2), ") differ");
  TORCH_CHECK(D % 16 == 0 && D <= 512, name, ": head_dim must be a multiple of 16, got ", D);
  TORCH_CHECK(q.size(1) % k_buffer.size(1) == 0, name, ": ", q.size(1),
              " query heads are not a multiple of ", k_buffer.size(1), " kv heads");
  TORCH_CHECK(q.size(1) / k_buffer.size(1) <= kMaxGroup, name, ": at most ", kMaxGroup,
              " query heads per kv head");
}

inline PoolView make_pool_view(const at::Tensor& k_buffer, const at::Tensor& req_to_token) {
  return PoolView{k_buffer.size(0), k_buffer.size(1), k_buffer.size(2),
                  req_to_token.data_ptr<int32_t>(), req_to_token.size(1)};
}

// KV splits of a decode batch: enough tasks for every thread (flash-decoding), none below
// kMinSplitLen keys.
inline int64_t choose_num_splits(int64_t batch, int64_t max_len) {
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || batch >= kTasksPerThread * threads) return 1;
  const int64_t wanted = (kTasksPerThread * threads + batch - 1) / batch;
  const int64_t most = std::max<int64_t>(1, max_len / kMinSplitLen);
  return std::max<int64_t>(1, std::min(wanted, most));
}

// The own keys of each request under a shared-prefix pass: request b reads positions
// own_start[b] .. seq_lens[b] - 1 in num_splits splits, written as partials into slots
// own_slot[b] .. + num_splits of partial_out [bs, H, num_slots, D] / partial_lse [bs, H,
// num_slots] (slots the pass does not fill hold lse -inf), then every request's partials are
// merged into the output. Each request uses only its first own_slot[b] + num_splits slots.
struct DecodeOwnPart {
  const int64_t* own_start;
  const int64_t* own_slot;
  int64_t num_slots;
  int64_t num_splits;
  float* partial_out;
  float* partial_lse;
  // The shared units' tasks, run before the own parts in the same parallel region.
  int64_t num_unit_tasks;
  std::function<void(int64_t)> run_unit_task;
};

// decode_attention (cpu_ops.h), with `own` (nullptr: the plain pass).
at::Tensor decode_attention_impl(const at::Tensor& q, const at::Tensor& k_buffer,
                                 const at::Tensor& v_buffer, const at::Tensor& req_to_token,
                                 const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                                 double scale, int64_t num_kv_splits, int64_t window_left,
                                 double logit_cap, const DecodeOwnPart* own);

}  // namespace radixengine::cpu
