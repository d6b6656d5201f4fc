// The units of a shared-prefix (cascade) decode pass, shared by its fp32 and AMX unit kernels.
#pragma once

#include <cstdint>

#include "cpu_attention_common.h"
#include "cpu_vec.h"

namespace radixengine::cpu {

// Unit u: positions unit_start[u] .. unit_end[u] - 1 of req_to_token row unit_rows[u], whose
// slots the requests members[member_ptr[u] .. member_ptr[u + 1]) all hold; member i writes its
// partial into slot member_slots[i] of partial_out [bs, num_heads, num_slots, D] and
// partial_lse [bs, num_heads, num_slots].
struct CascadeUnits {
  PoolView pool;
  int64_t group;  // query heads per kv head
  int64_t num_heads;
  const int64_t* unit_rows;
  const int64_t* unit_start;
  const int64_t* unit_end;
  const int64_t* member_ptr;
  const int64_t* members;
  const int64_t* member_slots;
  const int64_t* own_start;
  const int64_t* own_slot;
  int64_t q_stride0, q_stride1;
  float scale;
  float logit_cap;  // 0: no soft-capping
  int64_t num_slots;
  float* partial_out;
  float* partial_lse;
};

// Writes a part's result for kv head `kv_head`: acc [M][D] (M = num_members x group,
// member-major) divided by row_sum, and the log-sum-exp row_max + log(row_sum), into slot
// slots[j] of member j (batch index members[j]).
void store_partials(const CascadeUnits& a, const int64_t* members, const int64_t* slots,
                    int64_t num_members, int64_t kv_head, const float* acc, const float* row_max,
                    const float* row_sum);

// Whether this process can run the AMX unit kernel: a build with AVX-512, a CPU with AMX-BF16
// (and AVX512-BF16), and the kernel's permission to use the tile registers. Checked once.
bool cascade_amx_available();

// Unit u, every kv head, on AMX tiles (bf16 queries and KV, head_dim a multiple of 32, at most
// 256); call only when cascade_amx_available().
void cascade_unit_task_amx(const CascadeUnits& a, const bf16* q, const bf16* k_buf,
                           const bf16* v_buf, int64_t u);


}  // namespace radixengine::cpu
