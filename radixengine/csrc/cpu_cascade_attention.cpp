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
// (cpu_attention_amx.cpp); elsewhere on the register-blocked fp32 products of cpu_gemm.h.
#include <algorithm>
#include <cmath>
#include <functional>
#include <vector>

#include "cpu_attention_common.h"
#include "cpu_cascade.h"
#include "cpu_common.h"
#include "cpu_ops.h"
#include "cpu_query_block.h"
#include "cpu_vec.h"

namespace radixengine::cpu {
namespace {

template <typename QT, typename KVT>
void unit_task(const CascadeUnits& a, const QT* q, const KVT* k_buf, const KVT* v_buf,
               int64_t u, int64_t kv_head) {
  const int64_t G = a.group;
  const int64_t m0 = a.member_ptr[u];
  const int64_t num_members = a.member_ptr[u + 1] - m0;
  QueryBlock<KVT> blk(a.pool.head_dim, num_members * G,  // rows member-major: j * G + g
                      std::is_same_v<QT, bf16> && dpbf16_attention_enabled());
  for (int64_t j = 0; j < num_members; ++j) {
    const int64_t b = a.members[m0 + j];
    for (int64_t g = 0; g < G; ++g) {
      blk.set_query(j * G + g, q + b * a.q_stride0 + (kv_head * G + g) * a.q_stride1, a.scale);
    }
  }
  const int64_t begin = a.unit_start[u];
  for (int64_t start = begin; start < a.unit_end[u]; start += QueryBlock<KVT>::kKeyBlock) {
    const int64_t n = std::min(QueryBlock<KVT>::kKeyBlock, a.unit_end[u] - start);
    blk.scores(a.pool, k_buf, v_buf, a.unit_rows[u], start, n, kv_head, a.logit_cap);
    blk.accumulate(n, /*floor_max=*/false, start == begin);
  }
  store_partials(a, a.members + m0, a.member_slots + m0, num_members, kv_head, blk.acc,
                 blk.row_max, blk.row_sum);
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

void store_partials(const CascadeUnits& a, const int64_t* members, const int64_t* slots,
                    int64_t num_members, int64_t kv_head, const float* acc, const float* row_max,
                    const float* row_sum) {
  const int64_t D = a.pool.head_dim;
  const int64_t G = a.group;
  for (int64_t j = 0; j < num_members; ++j) {
    const int64_t b = members[j];
    for (int64_t g = 0; g < G; ++g) {
      const int64_t m = j * G + g;
      const int64_t idx = (b * a.num_heads + kv_head * G + g) * a.num_slots + slots[j];
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
  // The AMX unit kernel keeps scores in log2 units and needs scale > 0 for their max.
  const bool amx = use_amx && q.scalar_type() == at::kBFloat16 &&
                   k_buffer.scalar_type() == at::kBFloat16 && D % 32 == 0 && D <= 256 &&
                   scale > 0.0 && cascade_amx_available();
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
