// Extend attention of one block of queries on AMX tiles (cpu_attention_amx.cpp).
#pragma once

#include <cstdint>

#include "cpu_attention_common.h"
#include "cpu_vec.h"

namespace radixengine::cpu {

// Queries first_token .. first_token + num_queries - 1 of the batch (one request, at positions
// first_pos .. first_pos + num_queries - 1 of req_to_token row `row`), every query head, each over
// the keys at positions up to its own.
struct AmxExtendBlock {
  PoolView pool;
  int64_t group;  // query heads per kv head
  int64_t row;
  int64_t first_pos;
  int64_t first_token;
  int64_t num_queries;
  int64_t q_stride0, q_stride1;
  int64_t out_stride0, out_stride1;
  float scale;
  float logit_cap;  // 0: no soft-capping
};

// bf16 queries and KV, head_dim a multiple of 32 (at most 256), no sliding window; call only when
// cascade_amx_available().
void extend_block_amx(const AmxExtendBlock& block, const bf16* q, const bf16* k_buf,
                      const bf16* v_buf, bf16* out);

}  // namespace radixengine::cpu
