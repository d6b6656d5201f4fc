// Decode and extend (prefill) attention over the paged KV pool.
//
// Both kernels read K/V rows where they live in the pool (row = req_to_token[req, pos]) and use
// an online softmax, so nothing is gathered per request. Query heads are processed per KV head
// group (GQA): each K/V row is read once for all query heads that share it.
//
// Decode: one task per (request, kv split), all heads: a key block reads whole pool rows (the kv
// heads of a slot are contiguous), touching all of the block's rows first so that their cache
// misses overlap (the slots of a request are scattered over the pool). Long sequences at small batch are split so that every
// thread has work (flash-decoding); the partial results are merged by their log-sum-exp.
//
// Sliding window (window_left >= 0): a query at position p reads only the keys at positions
// p - window_left .. p; decode starts its keys there, extend starts each query block's keys at
// its first query's window and masks the keys that fall out of the later queries' windows.
// Soft-capping (logit_cap > 0): each score s becomes logit_cap * tanh(s / logit_cap).
//
// Extend: one task per (request, kv head, block of queries). A block of queries x a block of
// keys is two small matrix products (scores = K * Q^T, out += P * V), so each K/V block is read
// once per query block and the work is compute-bound. On a CPU with AMX, bf16 extend without a
// sliding window runs each (request, query block) for every kv head on AMX tiles instead
// (cpu_attention_amx.cpp; bench_attention_cpu.py --dtypes bfloat16 --cases extend measures both).
// A short extend (a verify step) runs as a decode whose tasks hold all of a request's queries
// (extend_as_decode).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu_attention_amx.h"
#include "cpu_attention_common.h"
#include "cpu_cascade.h"
#include "cpu_common.h"
#include "cpu_gemm.h"
#include "cpu_ops.h"
#include "cpu_query_block.h"
#include "cpu_vec.h"

namespace radixengine::cpu {
namespace {

constexpr int64_t kDecodeBlock = 64;       // keys per online-softmax step in decode
constexpr int64_t kExtendKeyBlock = QueryBlock<float>::kKeyBlock;  // keys per block in extend
constexpr int64_t kExtendRowTarget = 96;   // query rows (queries x group) per extend task

// Decode scores for GB query rows and four keys: out[g * ld + j] = dot(q[g], k_rows[j] + k_col0)
// (q rows contiguous, length D). Four keys per tile turn the horizontal sums into one
// four-way reduction per query row.
template <int GB, typename KT>
inline void dot_tile(const float* q, int64_t D, const KT* const* k_rows, int64_t k_col0,
                     float* out, int64_t ld) {
  VecF acc[GB][4];
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[g][j] = VecF::zero();
  }
  const KT* k[4] = {k_rows[0] + k_col0, k_rows[1] + k_col0, k_rows[2] + k_col0,
                    k_rows[3] + k_col0};
  for (int64_t d = 0; d < D; d += kVecWidth) {
    VecF qv[GB];
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) qv[g] = VecF::load(q + g * D + d);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const VecF kv = VecF::load(k[j] + d);
#pragma GCC unroll 4
      for (int g = 0; g < GB; ++g) acc[g][j] = fmadd(qv[g], kv, acc[g][j]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) hsum4(acc[g], out + g * ld);
}

// One key (the tail of a block).
template <int GB, typename KT>
inline void dot_one(const float* q, int64_t D, const KT* k, float* out, int64_t ld) {
  VecF acc[GB];
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) acc[g] = VecF::zero();
  for (int64_t d = 0; d < D; d += kVecWidth) {
    const VecF kv = VecF::load(k + d);
#pragma GCC unroll 4
    for (int g = 0; g < GB; ++g) acc[g] = fmadd(VecF::load(q + g * D + d), kv, acc[g]);
  }
#pragma GCC unroll 4
  for (int g = 0; g < GB; ++g) out[g * ld] = hsum(acc[g]);
}

template <int GB, typename KT>
inline void dot_keys(const float* q, int64_t D, const KT* const* k_rows, int64_t k_col0,
                     int64_t n, float* out, int64_t ld) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) dot_tile<GB>(q, D, k_rows + i, k_col0, out + i, ld);
  for (; i < n; ++i) dot_one<GB>(q, D, k_rows[i] + k_col0, out + i, ld);
}

// scores[g][i] = dot(q[g], k_rows[i] + k_col0) for G query rows and n keys (scores row stride ld).
template <typename KT>
inline void decode_scores(const float* q, int64_t G, int64_t D, const KT* const* k_rows,
                          int64_t k_col0, int64_t n, float* scores, int64_t ld) {
  int64_t g = 0;
  for (; g + 3 <= G; g += 3) dot_keys<3>(q + g * D, D, k_rows, k_col0, n, scores + g * ld, ld);
  switch (G - g) {
    case 1: dot_keys<1>(q + g * D, D, k_rows, k_col0, n, scores + g * ld, ld); break;
    case 2: dot_keys<2>(q + g * D, D, k_rows, k_col0, n, scores + g * ld, ld); break;
    default: break;
  }
}

// ---------------------------------------------------------------------------------------------
// Decode

struct DecodeArgs {
  PoolView pool;
  int64_t batch;
  int64_t num_heads;
  int64_t group;  // query heads per kv head
  const int64_t* req_pool_indices;
  const int64_t* seq_lens;
  int64_t q_stride0, q_stride1;
  int64_t out_stride0, out_stride1;
  int64_t num_splits;
  float scale;
  int64_t window_left;  // -1: no sliding window
  float logit_cap;      // 0: no soft-capping
  // Partial results, merged by their log-sum-exp: [batch, H, num_slots, D] and [batch, H,
  // num_slots], when num_splits > 1 or under a shared-prefix pass (nullptr: write `out`).
  float* partial_out;
  float* partial_lse;
  int64_t num_slots;
  // Shared-prefix pass: request b reads only its own keys from position own_start[b], into
  // slots own_slot[b] .. + num_splits (nullptr: from position 0 into slots 0 .. num_splits).
  const int64_t* own_start;
  const int64_t* own_slot;
  // A short extend (a verify step) as a decode: request b's queries are the q rows
  // query_start[b] .. + query_count[b], at positions seq_len - count .. seq_len - 1, each seeing
  // the keys up to its own position; partials are indexed by q row (nullptr: one query a
  // request, q row b).
  const int64_t* query_start;
  const int64_t* query_count;
};

// Keys of a block (positions start ..) a query at position `pos` sees: those up to `pos`.
inline int64_t visible_keys(int64_t start, int64_t n, int64_t pos) {
  return std::min(n, std::max<int64_t>(0, pos - start + 1));
}

// One task: request b, keys [split * chunk, (split + 1) * chunk), all heads and all its queries
// (one, or query_count[b]: rows m = j * G + g of each kv head's M = queries * G).
template <typename QT, typename KVT>
void decode_task(const DecodeArgs& a, const QT* q, const KVT* k_buf, const KVT* v_buf, QT* out,
                 int64_t b, int64_t split) {
  const int64_t D = a.pool.head_dim;
  const int64_t G = a.group;
  const int64_t H = a.num_heads;
  const int64_t Hkv = a.pool.num_kv_heads;
  const int64_t row = a.req_pool_indices[b];
  const int64_t seq_len = a.seq_lens[b];
  const int64_t nq = a.query_count != nullptr ? a.query_count[b] : 1;
  const int64_t q0 = a.query_start != nullptr ? a.query_start[b] : b;
  const int64_t M = nq * G;
  const int64_t pos0 = seq_len - nq;  // position of the first query
  const int64_t own = a.own_start != nullptr ? a.own_start[b] : 0;
  const int64_t first = std::min(seq_len, std::max(own, window_start(seq_len - 1, a.window_left)));
  const int64_t num_keys = seq_len - first;
  const int64_t chunk = round_up((num_keys + a.num_splits - 1) / a.num_splits, kDecodeBlock);
  const int64_t begin = first + std::min(num_keys, split * chunk);
  const int64_t end = std::min(seq_len, begin + chunk);

  // Scratch: q [Hkv][M][D], out acc [Hkv][M][D], scores [Hkv][M][block], max/sum [Hkv][M].
  const int64_t rows = Hkv * M;
  float* scratch = thread_scratch(2 * rows * D + rows * kDecodeBlock + 2 * rows);
  float* qf = scratch;
  float* acc = qf + rows * D;
  float* scores = acc + rows * D;
  float* row_max = scores + rows * kDecodeBlock;
  float* row_sum = row_max + rows;
  const KVT* k_rows[kDecodeBlock];
  const KVT* v_rows[kDecodeBlock];
  const float* p_rows[kMaxGroup];

  for (int64_t h = 0; h < Hkv; ++h) {
    for (int64_t m = 0; m < M; ++m) {
      const QT* src = q + (q0 + m / G) * a.q_stride0 + (h * G + m % G) * a.q_stride1;
      load_scaled(src, qf + (h * M + m) * D, D, a.scale);
      row_max[h * M + m] = kNegInf;
      row_sum[h * M + m] = 0.0f;
    }
  }
  std::fill(acc, acc + rows * D, 0.0f);

  for (int64_t start = begin; start < end; start += kDecodeBlock) {
    const int64_t n = std::min(kDecodeBlock, end - start);
    const int64_t n_pad = round_up(n, kVecWidth);
    gather_block_rows(a.pool, row, start, n, k_buf, v_buf, k_rows, v_rows);

    // Every head's scores (masked) first, then the softmax: its vector loads then read stores
    // that have left the store buffer (right after the narrow stores of the scores and the mask
    // they would wait for them).
    for (int64_t h = 0; h < Hkv; ++h) {
      decode_scores(qf + h * M * D, M, D, k_rows, h * D, n, scores + h * M * kDecodeBlock, kDecodeBlock);
      for (int64_t m = 0; m < M; ++m) {
        float* s = scores + (h * M + m) * kDecodeBlock;
        const int64_t visible = nq > 1 ? visible_keys(start, n, pos0 + m / G) : n;
        if (visible == 0) {  // a query before every key of the block: its row takes nothing
          std::fill(s, s + n_pad, 0.0f);
          continue;
        }
        if (a.logit_cap > 0.0f) soft_cap(s, n, a.logit_cap);
        std::fill(s + visible, s + n_pad, kNegInf);
      }
    }
    for (int64_t h = 0; h < Hkv; ++h) {
      for (int64_t m = 0; m < M; ++m) {
        const int64_t hg = h * M + m;
        float* s = scores + hg * kDecodeBlock;
        p_rows[m] = s;
        if (nq > 1 && visible_keys(start, n, pos0 + m / G) == 0) continue;
        VecF mx = VecF::broadcast(kNegInf);
        for (int64_t i = 0; i < n_pad; i += kVecWidth) mx = vmax(mx, VecF::load(s + i));
        const float new_max = std::max(row_max[hg], hmax(mx));
        const float alpha = std::exp(row_max[hg] - new_max);
        const VecF mv = VecF::broadcast(new_max);
        VecF sum = VecF::zero();
        for (int64_t i = 0; i < n_pad; i += kVecWidth) {
          const VecF p = vexp(VecF::load(s + i) - mv);
          p.store(s + i);
          sum = sum + p;
        }
        row_sum[hg] = row_sum[hg] * alpha + hsum(sum);
        row_max[hg] = new_max;
        if (alpha != 1.0f) scale_row(acc + hg * D, D, alpha);
      }
      gemm(M, D, n, p_rows, 1, v_rows, h * D, acc + h * M * D, D, /*accumulate=*/true);
    }
  }

  // row_sum is 0 only for no keys (an empty split); NaN (a NaN score) stays NaN in both outputs.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = q0 + r % M / G;   // q row of the query
    const int64_t hh = r / M * G + r % G;  // its head
    const bool empty = row_sum[r] == 0.0f;
    const float inv = empty ? 0.0f : 1.0f / row_sum[r];
    if (a.partial_out == nullptr) {
      store_scaled(acc + r * D, out + t * a.out_stride0 + hh * a.out_stride1, D, inv);
    } else {
      const int64_t slot = (a.own_slot != nullptr ? a.own_slot[b] : 0) + split;
      const int64_t idx = (t * H + hh) * a.num_slots + slot;
      store_scaled(acc + r * D, a.partial_out + idx * D, D, inv);
      a.partial_lse[idx] = empty ? kNegInf : row_max[r] + std::log(row_sum[r]);
    }
  }
}

template <typename QT>
void merge_splits(const DecodeArgs& a, QT* out) {
  const int64_t D = a.pool.head_dim;
  const int64_t S = a.num_slots;
  // Equal cheap tasks: static ranges (a shared task counter would cost more than the work).
  at::parallel_for(0, a.batch * a.num_heads, 16, [&](int64_t task_begin, int64_t task_end) {
   for (int64_t task = task_begin; task < task_end; ++task) {
    const int64_t b = task / a.num_heads;
    const int64_t h = task % a.num_heads;
    const float* lse = a.partial_lse + task * S;
    const float* po = a.partial_out + task * S * D;
    // Under a shared-prefix pass a request fills only its first own_slot[b] + num_splits slots.
    const int64_t used = a.own_slot != nullptr ? a.own_slot[b] + a.num_splits : S;
    float* acc = thread_scratch(D);
    std::fill(acc, acc + D, 0.0f);
    // Empty splits (lse -inf) are skipped; a NaN lse (a NaN score) makes its weight, and so
    // the output, NaN (the max skips NaN, so it does not depend on the order of the splits).
    float max_lse = kNegInf;
    for (int64_t s = 0; s < used; ++s) max_lse = lse[s] > max_lse ? lse[s] : max_lse;
    float total = 0.0f;
    for (int64_t s = 0; s < used; ++s) {
      if (lse[s] == kNegInf) continue;
      const float w = std::exp(lse[s] - max_lse);
      total += w;
      const VecF wv = VecF::broadcast(w);
      for (int64_t d = 0; d < D; d += kVecWidth) {
        fmadd(wv, VecF::load(po + s * D + d), VecF::load(acc + d)).store(acc + d);
      }
    }
    store_scaled(acc, out + b * a.out_stride0 + h * a.out_stride1, D,
                 total == 0.0f ? 0.0f : 1.0f / total);
   }
  });
}

// Indices of the batch sorted by a cost, largest first (so the longest tasks start first).
std::vector<int64_t> order_by_cost_desc(const std::vector<int64_t>& cost) {
  std::vector<int64_t> order(cost.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return cost[x] > cost[y]; });
  return order;
}

// ---------------------------------------------------------------------------------------------
// Extend

struct ExtendArgs {
  PoolView pool;
  int64_t group;
  int64_t block_queries;
  const int64_t* req_pool_indices;
  const int64_t* seq_lens;
  const int64_t* extend_seq_lens;
  const int64_t* extend_start_loc;
  int64_t q_stride0, q_stride1;
  int64_t out_stride0, out_stride1;
  float scale;
  int64_t window_left;  // -1: no sliding window
  float logit_cap;      // 0: no soft-capping
};

template <typename QT, typename KVT>
void extend_task(const ExtendArgs& a, const QT* q, const KVT* k_buf, const KVT* v_buf, QT* out,
                 int64_t b, int64_t kv_head, int64_t q_block) {
  const int64_t D = a.pool.head_dim;
  const int64_t G = a.group;
  const int64_t row = a.req_pool_indices[b];
  const int64_t ext_len = a.extend_seq_lens[b];
  const int64_t prefix = a.seq_lens[b] - ext_len;
  const int64_t j0 = q_block * a.block_queries;
  const int64_t nq = std::min(a.block_queries, ext_len - j0);
  if (nq <= 0) return;
  const int64_t first_pos = prefix + j0;      // position of the block's first query
  const int64_t num_keys = first_pos + nq;    // keys visible to the block's last query
  const int64_t M = nq * G;                   // query rows, query-major: row = j * G + g
  QueryBlock<KVT> blk(D, M, std::is_same_v<QT, bf16> && dpbf16_attention_enabled());
  for (int64_t j = 0; j < nq; ++j) {
    for (int64_t g = 0; g < G; ++g) {
      const QT* src = q + (a.extend_start_loc[b] + j0 + j) * a.q_stride0 +
                      (kv_head * G + g) * a.q_stride1;
      blk.set_query(j * G + g, src, a.scale);
    }
  }
  const int64_t ld = blk.ld();

  // With a window, a query block's later queries may see no key of an early key block: their
  // running max is floored at -FLT_MAX there (exp(-inf - -inf) would be NaN), which keeps their
  // weights 0 until a visible key comes.
  const int64_t key_begin = window_start(first_pos, a.window_left);
  const bool windowed = a.window_left >= 0;
  for (int64_t start = key_begin; start < num_keys; start += kExtendKeyBlock) {
    const int64_t n = std::min(kExtendKeyBlock, num_keys - start);
    float* st = blk.scores(a.pool, k_buf, v_buf, row, start, n, kv_head, a.logit_cap);

    // Causal mask: the key at position p is hidden from the queries before it, i.e. from
    // rows m < (p - first_pos) * G; the window hides it from the queries after
    // p + window_left, rows m >= (p + window_left + 1 - first_pos) * G.
    for (int64_t i = 0; i < n; ++i) {
      const int64_t hidden = std::min(M, (start + i - first_pos) * G);
      if (hidden > 0) std::fill(st + i * ld, st + i * ld + hidden, kNegInf);
      if (windowed) {
        const int64_t from = std::max<int64_t>(0, (start + i + a.window_left + 1 - first_pos) * G);
        if (from < M) std::fill(st + i * ld + from, st + i * ld + M, kNegInf);
      }
    }
    blk.accumulate(n, windowed, start == key_begin);
  }

  for (int64_t j = 0; j < nq; ++j) {
    const int64_t t = a.extend_start_loc[b] + j0 + j;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t m = j * G + g;
      store_scaled(blk.acc + m * D, out + t * a.out_stride0 + (kv_head * G + g) * a.out_stride1,
                   D, 1.0f / blk.row_sum[m]);
    }
  }
}

// A short extend without a sliding window (a verify step: a few queries a request) runs as a
// decode whose tasks take all of a request's queries: each K/V block is read once for all of
// them, with the decode's splits when the batch is small. Up to 8 queries a request this beats
// the extend tasks 1.3-2x (fp32, 8 requests x 260 keys); on AMX tiles the extend wins from two
// queries on (bf16: 3 queries 9.5 ms against 11.4 a step of 30 layers), so there it runs as a
// decode for one query a request only (bench_attention_cpu.py --cases short_extend).
constexpr int64_t kDecodeQueriesMax = 8;

bool extend_runs_as_decode(const ExtendArgs& a, int64_t bs, int64_t window_left, bool amx) {
  if (window_left >= 0) return false;
  const int64_t most = amx ? 1 : std::min<int64_t>(kDecodeQueriesMax, kMaxGroup / a.group);
  for (int64_t b = 0; b < bs; ++b) {
    if (a.extend_seq_lens[b] > most) return false;
  }
  return true;
}

template <typename QT, typename KVT>
void extend_as_decode(const ExtendArgs& e, int64_t bs, int64_t T, int64_t H, const QT* q,
                      const KVT* k_buf, const KVT* v_buf, QT* out, const at::TensorOptions& options) {
  DecodeArgs a{};
  a.pool = e.pool;
  a.num_heads = H;
  a.group = e.group;
  a.req_pool_indices = e.req_pool_indices;
  a.seq_lens = e.seq_lens;
  a.q_stride0 = e.q_stride0;
  a.q_stride1 = e.q_stride1;
  a.out_stride0 = e.out_stride0;
  a.out_stride1 = e.out_stride1;
  a.scale = e.scale;
  a.window_left = -1;
  a.logit_cap = e.logit_cap;
  a.query_start = e.extend_start_loc;
  a.query_count = e.extend_seq_lens;
  std::vector<int64_t> cost(bs);
  int64_t max_len = 0;
  for (int64_t b = 0; b < bs; ++b) {
    cost[b] = e.extend_seq_lens[b] > 0 ? e.seq_lens[b] : -1;
    max_len = std::max(max_len, e.seq_lens[b]);
  }
  a.num_splits = choose_num_splits(bs, max_len);
  at::Tensor partial_out, partial_lse;
  if (a.num_splits > 1) {
    partial_out = at::empty({T, H, a.num_splits, e.pool.head_dim}, options.dtype(at::kFloat));
    partial_lse = at::empty({T, H, a.num_splits}, options.dtype(at::kFloat));
    a.num_slots = a.num_splits;
    a.partial_out = partial_out.data_ptr<float>();
    a.partial_lse = partial_lse.data_ptr<float>();
  }
  a.batch = T;  // the merge runs per q row
  const std::vector<int64_t> order = order_by_cost_desc(cost);
  int64_t active = 0;
  while (active < bs && cost[order[active]] >= 0) ++active;
  run_tasks(active * a.num_splits, [&](int64_t task) {
    decode_task<QT, KVT>(a, q, k_buf, v_buf, out, order[task / a.num_splits], task % a.num_splits);
  });
  if (a.partial_out != nullptr) merge_splits<QT>(a, out);
}

// bf16 queries and KV on a CPU with AMX tiles, no sliding window, a positive scale (the tile
// kernel takes the max of unscaled scores): each (request, query block) runs every kv head on
// the tiles (cpu_attention_amx.cpp).
bool use_amx_extend(const at::Tensor& q, const at::Tensor& k_buffer, int64_t window_left,
                    double scale) {
  const int64_t D = q.size(2);
  return q.scalar_type() == at::kBFloat16 && k_buffer.scalar_type() == at::kBFloat16 &&
         window_left < 0 && D % 32 == 0 && D <= 256 && scale > 0.0 && cascade_amx_available();
}

AmxExtendBlock amx_block(const ExtendArgs& a, int64_t b, int64_t q_block) {
  const int64_t j0 = q_block * a.block_queries;
  const int64_t ext = a.extend_seq_lens[b];
  AmxExtendBlock e{};
  e.pool = a.pool;
  e.group = a.group;
  e.row = a.req_pool_indices[b];
  e.first_pos = a.seq_lens[b] - ext + j0;
  e.first_token = a.extend_start_loc[b] + j0;
  e.num_queries = std::min(a.block_queries, ext - j0);
  e.q_stride0 = a.q_stride0;
  e.q_stride1 = a.q_stride1;
  e.out_stride0 = a.out_stride0;
  e.out_stride1 = a.out_stride1;
  e.scale = a.scale;
  e.logit_cap = a.logit_cap;
  return e;
}

}  // namespace

at::Tensor decode_attention_impl(const at::Tensor& q_in, const at::Tensor& k_buffer,
                                 const at::Tensor& v_buffer, const at::Tensor& req_to_token,
                                 const at::Tensor& req_pool_indices_in,
                                 const at::Tensor& seq_lens_in, double scale,
                                 int64_t num_kv_splits, int64_t window_left, double logit_cap,
                                 const DecodeOwnPart* own) {
  check_pool(q_in, k_buffer, v_buffer, req_to_token, "decode_attention");
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor req_pool_indices = as_int64(req_pool_indices_in);
  const at::Tensor seq_lens = as_int64(seq_lens_in);
  const int64_t bs = q.size(0);
  const int64_t H = q.size(1);
  const int64_t D = q.size(2);
  const int64_t Hkv = k_buffer.size(1);
  TORCH_CHECK(req_pool_indices.numel() == bs && seq_lens.numel() == bs,
              "decode_attention: req_pool_indices and seq_lens need one entry per request");

  at::Tensor out = at::empty({bs, H, D}, q.options());
  if (bs == 0) return out;

  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* rows = req_pool_indices.data_ptr<int64_t>();
  int64_t max_len = 0;
  for (int64_t b = 0; b < bs; ++b) {
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= req_to_token.size(1),
                "decode_attention: seq_len ", lens[b], " out of range");
    TORCH_CHECK(rows[b] >= 0 && rows[b] < req_to_token.size(0),
                "decode_attention: req_pool_index ", rows[b], " out of range");
    max_len = std::max(max_len, lens[b] - std::min(lens[b], window_start(lens[b] - 1, window_left)));
  }

  DecodeArgs args{};
  args.pool = make_pool_view(k_buffer, req_to_token);
  args.batch = bs;
  args.num_heads = H;
  args.group = H / Hkv;
  args.req_pool_indices = rows;
  args.seq_lens = lens;
  args.q_stride0 = q.stride(0);
  args.q_stride1 = q.stride(1);
  args.out_stride0 = out.stride(0);
  args.out_stride1 = out.stride(1);
  args.num_splits = num_kv_splits > 0 ? num_kv_splits : choose_num_splits(bs, max_len);
  args.scale = static_cast<float>(scale);
  args.window_left = window_left;
  args.logit_cap = static_cast<float>(logit_cap);

  at::Tensor partial_out, partial_lse;
  if (own != nullptr) {
    args.num_splits = own->num_splits;
    args.num_slots = own->num_slots;
    args.partial_out = own->partial_out;
    args.partial_lse = own->partial_lse;
    args.own_start = own->own_start;
    args.own_slot = own->own_slot;
  } else if (args.num_splits > 1) {
    partial_out = at::empty({bs, H, args.num_splits, D}, q.options().dtype(at::kFloat));
    partial_lse = at::empty({bs, H, args.num_splits}, q.options().dtype(at::kFloat));
    args.num_slots = args.num_splits;
    args.partial_out = partial_out.data_ptr<float>();
    args.partial_lse = partial_lse.data_ptr<float>();
  }

  const std::vector<int64_t> order = order_by_cost_desc(std::vector<int64_t>(lens, lens + bs));
  const int64_t per_request = args.num_splits;

  RADIX_DISPATCH_FLOAT_BF16(q.scalar_type(), "decode_attention", QT, [&] {
    RADIX_DISPATCH_KV(k_buffer.scalar_type(), "decode_attention", KVT, [&] {
      const QT* qp = q.data_ptr<QT>();
      const KVT* kp = k_buffer.data_ptr<KVT>();
      const KVT* vp = v_buffer.data_ptr<KVT>();
      QT* op = out.data_ptr<QT>();
      // A shared-prefix pass's unit tasks (longest) run first, in the same parallel region.
      const int64_t extra = own != nullptr ? own->num_unit_tasks : 0;
      run_tasks(extra + bs * per_request, [&](int64_t task) {
        if (task < extra) return own->run_unit_task(task);
        task -= extra;
        decode_task<QT, KVT>(args, qp, kp, vp, op, order[task / per_request],
                             task % per_request);
      });
      if (args.partial_out != nullptr) merge_splits<QT>(args, op);
    });
  });
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_buffer,
                            const at::Tensor& v_buffer, const at::Tensor& req_to_token,
                            const at::Tensor& req_pool_indices, const at::Tensor& seq_lens,
                            double scale, int64_t num_kv_splits, int64_t window_left,
                            double logit_cap) {
  return decode_attention_impl(q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens,
                               scale, num_kv_splits, window_left, logit_cap, nullptr);
}

at::Tensor extend_attention(const at::Tensor& q_in, const at::Tensor& k_buffer,
                            const at::Tensor& v_buffer, const at::Tensor& req_to_token,
                            const at::Tensor& req_pool_indices_in,
                            const at::Tensor& seq_lens_in,
                            const at::Tensor& extend_seq_lens_in,
                            const at::Tensor& extend_start_loc_in, double scale,
                            int64_t window_left, double logit_cap, bool use_amx,
                            bool short_as_decode) {
  check_pool(q_in, k_buffer, v_buffer, req_to_token, "extend_attention");
  const at::Tensor q = q_in.stride(2) == 1 ? q_in : q_in.contiguous();
  const at::Tensor req_pool_indices = as_int64(req_pool_indices_in);
  const at::Tensor seq_lens = as_int64(seq_lens_in);
  const at::Tensor extend_seq_lens = as_int64(extend_seq_lens_in);
  const at::Tensor extend_start_loc = as_int64(extend_start_loc_in);
  const int64_t T = q.size(0);
  const int64_t H = q.size(1);
  const int64_t D = q.size(2);
  const int64_t Hkv = k_buffer.size(1);
  const int64_t bs = seq_lens.numel();
  TORCH_CHECK(req_pool_indices.numel() == bs && extend_seq_lens.numel() == bs &&
                  extend_start_loc.numel() == bs,
              "extend_attention: the per-request tensors need one entry per request");

  at::Tensor out = at::empty({T, H, D}, q.options());
  if (bs == 0 || T == 0) return out;

  ExtendArgs args{};
  args.pool = make_pool_view(k_buffer, req_to_token);
  args.group = H / Hkv;
  args.block_queries = std::max<int64_t>(1, kExtendRowTarget / args.group);
  args.req_pool_indices = req_pool_indices.data_ptr<int64_t>();
  args.seq_lens = seq_lens.data_ptr<int64_t>();
  args.extend_seq_lens = extend_seq_lens.data_ptr<int64_t>();
  args.extend_start_loc = extend_start_loc.data_ptr<int64_t>();
  args.q_stride0 = q.stride(0);
  args.q_stride1 = q.stride(1);
  args.out_stride0 = out.stride(0);
  args.out_stride1 = out.stride(1);
  args.scale = static_cast<float>(scale);
  args.window_left = window_left;
  args.logit_cap = static_cast<float>(logit_cap);

  // Tasks: (request, query block), longest first; each runs for every kv head.
  struct Block {
    int64_t b, q_block, cost;
  };
  std::vector<Block> blocks;
  for (int64_t b = 0; b < bs; ++b) {
    const int64_t ext = args.extend_seq_lens[b];
    const int64_t len = args.seq_lens[b];
    TORCH_CHECK(ext >= 0 && ext <= len && len <= req_to_token.size(1),
                "extend_attention: bad lengths for request ", b, " (seq_len ", len,
                ", extend_seq_len ", ext, ")");
    TORCH_CHECK(args.extend_start_loc[b] >= 0 && args.extend_start_loc[b] + ext <= T,
                "extend_attention: extend_start_loc out of range for request ", b);
    TORCH_CHECK(args.req_pool_indices[b] >= 0 && args.req_pool_indices[b] < req_to_token.size(0),
                "extend_attention: req_pool_index out of range for request ", b);
    for (int64_t qb = 0; qb * args.block_queries < ext; ++qb) {
      const int64_t j0 = qb * args.block_queries;
      const int64_t nq = std::min(args.block_queries, ext - j0);
      blocks.push_back({b, qb, nq * (len - ext + j0 + nq)});
    }
  }
  std::stable_sort(blocks.begin(), blocks.end(),
                   [](const Block& x, const Block& y) { return x.cost > y.cost; });

  const bool amx = use_amx && use_amx_extend(q, k_buffer, window_left, scale);
  if (short_as_decode && extend_runs_as_decode(args, bs, window_left, amx)) {
    RADIX_DISPATCH_FLOAT_BF16(q.scalar_type(), "extend_attention", QT, [&] {
      RADIX_DISPATCH_KV(k_buffer.scalar_type(), "extend_attention", KVT, [&] {
        extend_as_decode<QT, KVT>(args, bs, T, H, q.data_ptr<QT>(), k_buffer.data_ptr<KVT>(),
                                  v_buffer.data_ptr<KVT>(), out.data_ptr<QT>(), q.options());
      });
    });
    return out;
  }
  if (amx) {
    run_tasks(static_cast<int64_t>(blocks.size()), [&](int64_t task) {
      extend_block_amx(amx_block(args, blocks[task].b, blocks[task].q_block),
                       reinterpret_cast<const bf16*>(q.data_ptr()),
                       reinterpret_cast<const bf16*>(k_buffer.data_ptr()),
                       reinterpret_cast<const bf16*>(v_buffer.data_ptr()),
                       reinterpret_cast<bf16*>(out.data_ptr()));
    });
    return out;
  }
  RADIX_DISPATCH_FLOAT_BF16(q.scalar_type(), "extend_attention", QT, [&] {
    RADIX_DISPATCH_KV(k_buffer.scalar_type(), "extend_attention", KVT, [&] {
      const QT* qp = q.data_ptr<QT>();
      const KVT* kp = k_buffer.data_ptr<KVT>();
      const KVT* vp = v_buffer.data_ptr<KVT>();
      QT* op = out.data_ptr<QT>();
      const int64_t num_tasks = static_cast<int64_t>(blocks.size()) * Hkv;
      run_tasks(num_tasks, [&](int64_t task) {
        const Block& blk = blocks[task / Hkv];
        extend_task<QT, KVT>(args, qp, kp, vp, op, blk.b, task % Hkv, blk.q_block);
      });
    });
  });
  return out;
}

std::string isa() { return kIsaName; }

}  // namespace radixengine::cpu
