// Shared-prefix (cascade) decode attention.
//
// Requests of a decode batch that share a prefix hold the same KV slots for it in their
// req_to_token rows (a radix-cache hit). A plan (built in Python, radixengine/layers/attention/
// cascade_plan.py) lists units: positions [start, end) of one row whose slots a set of requests
// share. A unit is computed once for all its members' query heads: per kv head, the members'
// G query heads each are the rows of one matrix, so the shared K/V block is read once and the
// work is two matrix products (S^T = K * Q^T, O += P * V), as in extend. Each request's own keys
// (from own_start[b]) run through the plain decode task. Every part leaves a partial output and
// its log-sum-exp in a slot of the request; the slots are merged exactly by their log-sum-exp.
//
// On a CPU with AMX (bf16 queries and KV cache), the unit's products run on AMX tiles
// (cpu_cascade_amx.cpp); elsewhere on the register-blocked fp32 products of cpu_gemm.h.
#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "cpu_attention_common.h"
#include "cpu_cascade.h"
#include "cpu_common.h"
#include "cpu_gemm.h"
#include "cpu_ops.h"
#include "cpu_vec.h"

namespace radixengine::cpu {
namespace {

constexpr int64_t kUnitKeyBlock = 64;  // keys per online-softmax step of a unit

template <typename QT, typename KVT>
void unit_task(const CascadeUnits& a, const QT* q, const KVT* k_buf, const KVT* v_buf,
               int64_t u, int64_t kv_head) {
  const int64_t D = a.pool.head_dim;
  const int64_t G = a.group;
  const int64_t row = a.unit_rows[u];
  const int64_t m0 = a.member_ptr[u];
  const int64_t num_members = a.member_ptr[u + 1] - m0;
  const int64_t M = num_members * G;          // query rows, member-major: row = j * G + g
  const int64_t ld = round_up(M, kVecWidth);  // padded row count (columns of S^T)
  const int64_t BK = kUnitKeyBlock;
  const int64_t row_stride = a.pool.num_kv_heads * D;
  constexpr bool kConvertKV = !std::is_same_v<KVT, float>;

  // Scratch: Q^T [D][ld], S^T [BK][ld], acc [M][D], max/sum/alpha [ld], fp32 K/V block.
  const int64_t nf = D * ld + BK * ld + M * D + 3 * ld + (kConvertKV ? 2 * BK * D : 0);
  float* qt = thread_scratch(nf);
  float* st = qt + D * ld;
  float* acc = st + BK * ld;
  float* row_max = acc + M * D;
  float* row_sum = row_max + ld;
  float* alpha = row_sum + ld;
  float* k_block = alpha + ld;
  float* v_block = k_block + BK * D;

  thread_local std::vector<const float*> ptrs;
  ptrs.resize(D + M + 2 * BK);
  const float** qt_rows = ptrs.data();
  const float** p_rows = qt_rows + D;
  const float** k_rows = p_rows + M;
  const float** v_rows_f = k_rows + BK;
  const KVT* v_rows[kUnitKeyBlock];

  std::fill(qt, qt + D * ld, 0.0f);
  for (int64_t j = 0; j < num_members; ++j) {
    const int64_t b = a.members[m0 + j];
    for (int64_t g = 0; g < G; ++g) {
      const QT* src = q + b * a.q_stride0 + (kv_head * G + g) * a.q_stride1;
      const int64_t m = j * G + g;
      for (int64_t d = 0; d < D; ++d) qt[d * ld + m] = to_float(src[d]) * a.scale;
    }
  }
  for (int64_t d = 0; d < D; ++d) qt_rows[d] = qt + d * ld;
  for (int64_t m = 0; m < M; ++m) p_rows[m] = st + m;
  std::fill(row_max, row_max + ld, kNegInf);
  std::fill(row_sum, row_sum + ld, 0.0f);
  std::fill(acc, acc + M * D, 0.0f);

  const int64_t begin = a.unit_start[u];
  const int64_t end = a.unit_end[u];
  for (int64_t start = begin; start < end; start += BK) {
    const int64_t n = std::min(BK, end - start);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t offset = slot_at(a.pool, row, start + i) * row_stride + kv_head * D;
      if constexpr (kConvertKV) {
        load_scaled(k_buf + offset, k_block + i * D, D, 1.0f);
        load_scaled(v_buf + offset, v_block + i * D, D, 1.0f);
        k_rows[i] = k_block + i * D;
        v_rows_f[i] = v_block + i * D;
      } else {
        k_rows[i] = k_buf + offset;
        v_rows[i] = v_buf + offset;
      }
    }
    gemm(n, ld, D, k_rows, 1, qt_rows, 0, st, ld, /*accumulate=*/false);
    if (a.logit_cap > 0.0f) soft_cap(st, n * ld, a.logit_cap);
    softmax_columns(st, n, ld, row_max, row_sum, alpha, /*floor_max=*/false);
    if (start > begin) {
      for (int64_t m = 0; m < M; ++m) {
        if (alpha[m] != 1.0f) scale_row(acc + m * D, D, alpha[m]);
      }
    }
    if constexpr (kConvertKV) {
      gemm(M, D, n, p_rows, ld, v_rows_f, 0, acc, D, /*accumulate=*/true);
    } else {
      gemm(M, D, n, p_rows, ld, v_rows, 0, acc, D, /*accumulate=*/true);
    }
  }
  store_unit_partials(a, u, kv_head, acc, row_max, row_sum);
}

// One task of the units: on AMX a whole unit (every kv head, so a pool row is read once), else
// one (unit, kv head).
template <typename QT, typename KVT>
void unit_task_at(const CascadeUnits& a, const QT* q, const KVT* k_buf, const KVT* v_buf,
                  const std::vector<int64_t>& order, bool amx, int64_t task) {
  if constexpr (std::is_same_v<QT, bf16> && std::is_same_v<KVT, bf16>) {
    if (amx) return cascade_unit_task_amx(a, q, k_buf, v_buf, order[task]);
  }
  const int64_t Hkv = a.pool.num_kv_heads;
  unit_task<QT, KVT>(a, q, k_buf, v_buf, order[task / Hkv], task % Hkv);
}

// A buffer of at least `numel` floats kept by the calling thread across calls (a fresh one per
// layer would cost page faults).
float* reused_floats(std::vector<float>& buffer, int64_t numel) {
  if (static_cast<int64_t>(buffer.size()) < numel) buffer.resize(numel);
  return buffer.data();
}

void check_plan(const CascadeUnits& a, int64_t bs, const int64_t* seq_lens, int64_t max_reqs,
                int64_t num_units) {
  for (int64_t b = 0; b < bs; ++b) {
    TORCH_CHECK(a.own_start[b] >= 0 && a.own_start[b] <= seq_lens[b],
                "decode_attention_cascade: own_start of request ", b, " out of range");
    TORCH_CHECK(a.own_slot[b] >= 0, "decode_attention_cascade: negative own_slot");
  }
  for (int64_t u = 0; u < num_units; ++u) {
    TORCH_CHECK(a.unit_rows[u] >= 0 && a.unit_rows[u] < max_reqs,
                "decode_attention_cascade: unit row out of range");
    TORCH_CHECK(0 <= a.unit_start[u] && a.unit_start[u] < a.unit_end[u],
                "decode_attention_cascade: empty or negative unit");
    TORCH_CHECK(a.member_ptr[u] < a.member_ptr[u + 1], "decode_attention_cascade: unit ", u,
                " has no member");
    for (int64_t i = a.member_ptr[u]; i < a.member_ptr[u + 1]; ++i) {
      const int64_t b = a.members[i];
      TORCH_CHECK(b >= 0 && b < bs, "decode_attention_cascade: unit member out of range");
      TORCH_CHECK(a.unit_end[u] <= a.own_start[b],
                  "decode_attention_cascade: a unit reaches into its member's own keys");
      TORCH_CHECK(a.member_slots[i] >= 0 && a.member_slots[i] < a.own_slot[b],
                  "decode_attention_cascade: a unit's slot collides with its member's own slots");
    }
  }
}

}  // namespace

void store_unit_partials(const CascadeUnits& a, int64_t u, int64_t kv_head, const float* acc,
                         const float* row_max, const float* row_sum) {
  const int64_t D = a.pool.head_dim;
  const int64_t G = a.group;
  const int64_t m0 = a.member_ptr[u];
  for (int64_t j = 0; j < a.member_ptr[u + 1] - m0; ++j) {
    const int64_t b = a.members[m0 + j];
    for (int64_t g = 0; g < G; ++g) {
      const int64_t m = j * G + g;
      const int64_t idx = (b * a.num_heads + kv_head * G + g) * a.num_slots + a.member_slots[m0 + j];
      store_scaled(acc + m * D, a.partial_out + idx * D, D, 1.0f / row_sum[m]);
      a.partial_lse[idx] = row_max[m] + std::log(row_sum[m]);
    }
  }
}

bool amx_available() { return cascade_amx_available(); }

at::Tensor decode_attention_cascade(
    const at::Tensor& q_in, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
    const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
    const at::Tensor& seq_lens_in, double scale, const at::Tensor& unit_rows_in,
    const at::Tensor& unit_start_in, const at::Tensor& unit_end_in,
    const at::Tensor& unit_member_ptr_in, const at::Tensor& unit_members_in,
    const at::Tensor& unit_member_slots_in, const at::Tensor& own_start_in,
    const at::Tensor& own_slot_in, int64_t num_kv_splits, double logit_cap, bool use_amx) {
  check_pool(q_in, k_buffer, v_buffer, req_to_token, "decode_attention_cascade");
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor seq_lens = as_int64(seq_lens_in);
  const at::Tensor unit_rows = as_int64(unit_rows_in), unit_start = as_int64(unit_start_in);
  const at::Tensor unit_end = as_int64(unit_end_in), member_ptr = as_int64(unit_member_ptr_in);
  const at::Tensor members = as_int64(unit_members_in);
  const at::Tensor member_slots = as_int64(unit_member_slots_in);
  const at::Tensor own_start = as_int64(own_start_in), own_slot = as_int64(own_slot_in);
  const int64_t bs = q.size(0);
  const int64_t H = q.size(1);
  const int64_t D = q.size(2);
  const int64_t Hkv = k_buffer.size(1);
  const int64_t num_units = unit_rows.numel();
  TORCH_CHECK(seq_lens.numel() == bs && own_start.numel() == bs && own_slot.numel() == bs,
              "decode_attention_cascade: seq_lens, own_start and own_slot need one entry per "
              "request");
  TORCH_CHECK(unit_start.numel() == num_units && unit_end.numel() == num_units &&
                  member_ptr.numel() == num_units + 1 &&
                  members.numel() == member_slots.numel() &&
                  (num_units == 0 || member_ptr[num_units].item<int64_t>() == members.numel()),
              "decode_attention_cascade: inconsistent unit tensors");

  CascadeUnits units{};
  units.pool = make_pool_view(k_buffer, req_to_token);
  units.group = H / Hkv;
  units.num_heads = H;
  units.unit_rows = unit_rows.data_ptr<int64_t>();
  units.unit_start = unit_start.data_ptr<int64_t>();
  units.unit_end = unit_end.data_ptr<int64_t>();
  units.member_ptr = member_ptr.data_ptr<int64_t>();
  units.members = members.data_ptr<int64_t>();
  units.member_slots = member_slots.data_ptr<int64_t>();
  units.own_start = own_start.data_ptr<int64_t>();
  units.own_slot = own_slot.data_ptr<int64_t>();
  units.q_stride0 = q.stride(0);
  units.q_stride1 = q.stride(1);
  units.scale = static_cast<float>(scale);
  units.logit_cap = static_cast<float>(logit_cap);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  check_plan(units, bs, lens, req_to_token.size(0), num_units);

  int64_t max_own = 0, shared_slots = 0;
  for (int64_t b = 0; b < bs; ++b) {
    max_own = std::max(max_own, lens[b] - units.own_start[b]);
    shared_slots = std::max(shared_slots, units.own_slot[b]);
  }
  const int64_t splits = num_kv_splits > 0 ? num_kv_splits : choose_num_splits(bs, max_own);
  units.num_slots = shared_slots + splits;
  thread_local std::vector<float> partial_out, partial_lse;
  units.partial_out = reused_floats(partial_out, bs * H * units.num_slots * D);
  units.partial_lse = reused_floats(partial_lse, bs * H * units.num_slots);

  // Units, longest first.
  std::vector<int64_t> order(num_units);
  for (int64_t u = 0; u < num_units; ++u) order[u] = u;
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    const auto cost = [&](int64_t u) {
      return (units.unit_end[u] - units.unit_start[u]) * (units.member_ptr[u + 1] - units.member_ptr[u]);
    };
    return cost(x) > cost(y);
  });
  const bool amx = use_amx && q.scalar_type() == at::kBFloat16 &&
                   k_buffer.scalar_type() == at::kBFloat16 && D % 32 == 0 && D <= 256 &&
                   cascade_amx_available();
  std::function<void(int64_t)> run_unit_task;
  RADIX_DISPATCH_FLOAT_BF16(q.scalar_type(), "decode_attention_cascade", QT, [&] {
    RADIX_DISPATCH_KV(k_buffer.scalar_type(), "decode_attention_cascade", KVT, [&] {
      run_unit_task = [&units, &order, amx, qp = q.data_ptr<QT>(), kp = k_buffer.data_ptr<KVT>(),
                       vp = v_buffer.data_ptr<KVT>()](int64_t task) {
        unit_task_at<QT, KVT>(units, qp, kp, vp, order, amx, task);
      };
    });
  });

  const DecodeOwnPart own{units.own_start, units.own_slot, units.num_slots, splits,
                          units.partial_out, units.partial_lse,
                          amx ? num_units : num_units * Hkv, run_unit_task};
  return decode_attention_impl(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                               scale, splits, /*window_left=*/-1, logit_cap, &own);
}

}  // namespace radixengine::cpu
