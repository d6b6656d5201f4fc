// Native CPU ops of radixengine (declarations; bindings in cpu_bindings.cpp).
//
// The KV cache is a paged pool: per layer, K and V buffers [num_slots, num_kv_heads, head_dim]
// and req_to_token [max_reqs, max_context_len] (int32) mapping (request row, position) -> slot.
// The attention ops read K/V through req_to_token in place.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace radixengine::cpu {

// q [bs, H, D]; each request b attends over positions 0..seq_lens[b]-1 of row
// req_pool_indices[b]. num_kv_splits: 0 picks a split of long sequences across threads
// automatically; n > 0 forces n splits (for tests). window_left >= 0: only the positions
// seq_lens[b] - 1 - window_left .. seq_lens[b] - 1 (a sliding window); logit_cap > 0: scores
// soft-capped to logit_cap * tanh(score / logit_cap). Returns [bs, H, D] in q's dtype.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buffer,
                            const at::Tensor& v_buffer, const at::Tensor& req_to_token,
                            const at::Tensor& req_pool_indices,
                            const at::Tensor& seq_lens, double scale,
                            int64_t num_kv_splits, int64_t window_left, double logit_cap);

// q [T, H, D] holds the new tokens of each request (request b: rows extend_start_loc[b] ..
// + extend_seq_lens[b]); token j of request b is at absolute position prefix_b + j, with
// prefix_b = seq_lens[b] - extend_seq_lens[b], and attends causally over positions
// 0..prefix_b + j (with window_left >= 0, only from prefix_b + j - window_left; logit_cap as in
// decode_attention). Returns [T, H, D] in q's dtype. use_amx: bf16 without a window may run on
// AMX tiles where the CPU has them. short_as_decode: a short extend without a window (at most 8
// queries a request; 1 on AMX tiles) runs as a decode of several queries a request.
at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_buffer,
                            const at::Tensor& v_buffer, const at::Tensor& req_to_token,
                            const at::Tensor& req_pool_indices,
                            const at::Tensor& seq_lens,
                            const at::Tensor& extend_seq_lens,
                            const at::Tensor& extend_start_loc, double scale,
                            int64_t window_left, double logit_cap, bool use_amx,
                            bool short_as_decode);

// decode_attention with a shared-prefix plan (cpu_cascade_attention.cpp): unit u covers
// positions unit_start[u] .. unit_end[u] - 1 of row unit_rows[u], whose KV slots every request
// of unit_members[unit_member_ptr[u] .. unit_member_ptr[u + 1]) holds at the same positions;
// it is computed once for all their query heads, into the partial slot unit_member_slots[i] of
// member i. Request b then reads its own keys from position own_start[b] into its slots
// own_slot[b] .., and all parts are merged by their log-sum-exp. No sliding window.
// use_amx: the unit products may run on AMX tiles where the CPU has them (bf16 q and KV).
at::Tensor decode_attention_cascade(
    const at::Tensor& q, const at::Tensor& k_buffer, const at::Tensor& v_buffer,
    const at::Tensor& req_to_token, const at::Tensor& req_pool_indices,
    const at::Tensor& seq_lens, double scale, const at::Tensor& unit_rows,
    const at::Tensor& unit_start, const at::Tensor& unit_end, const at::Tensor& unit_member_ptr,
    const at::Tensor& unit_members, const at::Tensor& unit_member_slots,
    const at::Tensor& own_start, const at::Tensor& own_slot, int64_t num_kv_splits,
    double logit_cap, bool use_amx);

// Whether this process can use AMX tiles (the cascade unit kernel, amx_linear).
bool amx_available();

// k_buffer[loc[t]] = k[t], v_buffer[loc[t]] = v[t] (in place).
void set_kv_buffer(at::Tensor& k_buffer, at::Tensor& v_buffer, const at::Tensor& loc,
                   const at::Tensor& k, const at::Tensor& v);

// Row-wise RMSNorm of x [tokens, hidden]: x * rsqrt(mean(x^2) + eps) * weight (bf16: the
// normalised row is rounded to bf16 before the weight multiply, as the torch module does).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// In place: residual = x + residual; x = rms_norm(residual) * weight.
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps);

// In place, neox style: for each token t and head h, the first rotary_dim features of
// x[t, h] = (x1, x2) become (x1 cos - x2 sin, x2 cos + x1 sin) with cos | sin read from
// cos_sin_cache [max_position, rotary_dim] at positions[t].
void rotary_embedding(const at::Tensor& positions, at::Tensor& x,
                      const at::Tensor& cos_sin_cache, int64_t rotary_dim);

// out [T, d] = silu(x[:, :d]) * x[:, d:] for x [T, 2d] (rows with unit stride).
at::Tensor silu_and_mul(const at::Tensor& x);

// out [M, N] = x [M, K] (float32, contiguous) times the transpose of a GGUF block-quantized
// weight [N, K] given as its raw blocks: qweight uint8 [N, K / block weights * block bytes],
// qtype the GGML type id (Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12,
// Q5_K = 13, Q6_K = 14). Dequantized exactly as gguf-py does; no bias.
// bf16 W [N, K] (N, K multiples of 32) in the tile layout amx_linear reads; once, at load.
at::Tensor amx_pack_linear_weight(const at::Tensor& weight);

// x [M, K] bf16 times W^T (+ bias) on AMX tiles, W as amx_pack_linear_weight packed it; call only
// when amx_available().
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias);

// Whether this CPU and build have AVX512-BF16 dot products (dpbf16_linear).
bool dpbf16_available();

// x [M, K] bf16 times W^T (+ bias) with AVX512-BF16 dot products, W as amx_pack_linear_weight
// packed it (cpu_dpbf16_linear.cpp); call only when dpbf16_available().
at::Tensor dpbf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, int64_t qtype);

// y [T, out] += each row's LoRA delta, in place: B_s (A_s x[t]) for its slot s = row_slot[t] (0:
// none) of rank rank_of_slot[s]; a_buf [slots, R, stack, in], b_buf [slots, R, stack, out] as the
// LoRA pool keeps them; pieces: the output columns of each stacked module (cpu_lora_delta.cpp).
void lora_delta(at::Tensor& y, const at::Tensor& x, const at::Tensor& a_buf, const at::Tensor& b_buf,
                const at::Tensor& row_slot, const at::Tensor& rank_of_slot, const std::vector<int64_t>& pieces);

// bf16 W [N, K] (N a multiple of 32) as panels of 32 output columns, [N / 32][K][32]; once, at
// load (cpu_bf16_linear.cpp).
at::Tensor bf16_pack_linear_weight(const at::Tensor& weight);

// x [M, K] (float32 or bfloat16) times W^T (+ bias) for W packed by bf16_pack_linear_weight:
// fp32 products and sums, rounded once to x's dtype. Every ISA level; no AMX or AVX512-BF16.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed,
                       const c10::optional<at::Tensor>& bias);

// The routed experts' grouped linear: rows offsets[e] .. offsets[e + 1] of x [M, K] (float32)
// times w[e], for w [E, K, N] (float32 or bfloat16, [in, out] per expert; N a multiple of the
// vector width) and offsets int64 [E + 1] from 0 to M. Returns [M, N] float32.
at::Tensor moe_grouped_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& offsets);

// The vector code path the module was compiled with: "avx512", "avx2" or "portable".
std::string isa();

}  // namespace radixengine::cpu
