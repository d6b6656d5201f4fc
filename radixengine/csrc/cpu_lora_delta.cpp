// The batched LoRA delta of one target linear, in place: y[t] += B_s (A_s x[t]) for each row t of
// slot s = row_slot[t] > 0, with the slot's own rank. One call for the whole batch, whatever the
// number of adapters in it (the torch forms take three ops over all slots' columns, or two ops
// a slot); each row computes only its own slot's columns and, per stacked module (q/k/v,
// gate/up), only that module's output columns.
//
// a_buf [slots, R, stack, in], b_buf [slots, R, stack, out] (the LoRA pool's layout); `pieces`:
// the output columns of each stacked module, in order. The shrink is accumulated in fp32 and
// not rounded; a bfloat16 y is rounded once, after the add.
//
// The rows of each slot are cut into blocks of up to kBlockRows; a block is one task. Its shrink
// runs register tiles of up to 4 rows x kShrinkCols rows of A (each x and A vector loaded once
// per tile), its expand tiles of all the block's rows x 2 vectors of output columns (each B
// vector loaded once per block): the weights are read once per block, and the products run on
// independent accumulators.
#include "cpu_common.h"
#include "cpu_ops.h"

namespace radixengine::cpu {
namespace {

constexpr int64_t kParallelWork = 1 << 18;  // multiply-adds below which one thread does all
constexpr int kBlockRows = 8;                // rows of one slot that share each weight load
constexpr int kShrinkRows = 4;
constexpr int kShrinkCols = kVecWidth == 16 ? 4 : 2;  // A rows per shrink tile (register budget)

struct DeltaShape {
  int64_t in, out, max_rank, stack;
  std::vector<int64_t> offsets;  // stack + 1 column offsets of the stacked modules
};

// h[b * hk + jk0 + c] = x_b . A[jk0 + c] for RT rows (widened to fp32) and JT rows of A.
template <int RT, int JT, typename T>
void shrink_tile(const float* const* x, const T* a, int64_t n, int64_t jk0, int64_t hk, float* h) {
  VecF acc[RT][JT];
  for (int b = 0; b < RT; ++b)
    for (int c = 0; c < JT; ++c) acc[b][c] = VecF::zero();
  const T* w[JT];
  for (int c = 0; c < JT; ++c) w[c] = a + (jk0 + c) * n;
  int64_t i = 0;
  for (; i + kVecWidth <= n; i += kVecWidth) {
    VecF wv[JT];
    for (int c = 0; c < JT; ++c) wv[c] = VecF::load(w[c] + i);
    for (int b = 0; b < RT; ++b) {
      const VecF xv = VecF::load(x[b] + i);
      for (int c = 0; c < JT; ++c) acc[b][c] = fmadd(xv, wv[c], acc[b][c]);
    }
  }
  for (int b = 0; b < RT; ++b) {
    float sums[JT];
    if constexpr (JT == 4) {
      hsum4(acc[b], sums);
    } else {
      for (int c = 0; c < JT; ++c) sums[c] = hsum(acc[b][c]);
    }
    for (int c = 0; c < JT; ++c) {
      for (int64_t t = i; t < n; ++t) sums[c] += x[b][t] * to_float(w[c][t]);
      h[b * hk + jk0 + c] = sums[c];
    }
  }
}

template <int RT, typename T>
void shrink_rows(const float* const* x, const T* a, int64_t n, int64_t jks, int64_t hk, float* h) {
  int64_t jk = 0;
  for (; jk + kShrinkCols <= jks; jk += kShrinkCols) shrink_tile<RT, kShrinkCols>(x, a, n, jk, hk, h);
  for (; jk < jks; ++jk) shrink_tile<RT, 1>(x, a, n, jk, hk, h);
}

// h[b][jk] = x_b . A[jk] for the block's rows (jk = j * stack + k, the pool's row order). 16-bit
// rows are widened once into `x32` ([kBlockRows][in]), not once per tile.
template <typename T>
void shrink_block(const T* const* x, int rows, const T* a_slot, const DeltaShape& s, int64_t rank, float* h,
                  float* x32) {
  const float* xf[kBlockRows];
  for (int b = 0; b < rows; ++b) {
    if constexpr (std::is_same_v<T, float>) {
      xf[b] = x[b];
    } else {
      float* row = x32 + b * s.in;
      int64_t i = 0;
      for (; i + kVecWidth <= s.in; i += kVecWidth) VecF::load(x[b] + i).store(row + i);
      for (; i < s.in; ++i) row[i] = to_float(x[b][i]);
      xf[b] = row;
    }
  }
  const int64_t hk = s.max_rank * s.stack, jks = rank * s.stack;
  for (int b = 0; b < rows; b += kShrinkRows) {
    with_rows<kShrinkRows>(std::min(kShrinkRows, rows - b), [&](auto rt) {
      shrink_rows<decltype(rt)::value>(xf + b, a_slot, s.in, jks, hk, h + b * hk);
    });
  }
}

// y_b[c .. c + CV vectors) += sum_j h[b][j, k] B[j, k, c ..] for the block's R rows.
template <int R, int CV, typename T>
void expand_tile(T* const* y, const T* b_slot, const DeltaShape& s, int64_t rank, int64_t k, const float* h,
                 int64_t c) {
  const int64_t hk = s.max_rank * s.stack;
  VecF acc[R][CV];
  for (int b = 0; b < R; ++b)
    for (int v = 0; v < CV; ++v) acc[b][v] = VecF::load(y[b] + c + v * kVecWidth);
  for (int64_t j = 0; j < rank; ++j) {
    const T* row = b_slot + (j * s.stack + k) * s.out + c;
    VecF wv[CV];
    for (int v = 0; v < CV; ++v) wv[v] = VecF::load(row + v * kVecWidth);
    for (int b = 0; b < R; ++b) {
      const VecF hv = VecF::broadcast(h[b * hk + j * s.stack + k]);
      for (int v = 0; v < CV; ++v) acc[b][v] = fmadd(hv, wv[v], acc[b][v]);
    }
  }
  for (int b = 0; b < R; ++b)
    for (int v = 0; v < CV; ++v) round_to<T>(acc[b][v]).store(y[b] + c + v * kVecWidth);
}

template <int R, typename T>
void expand_rows(T* const* y, const T* b_slot, const DeltaShape& s, int64_t rank, const float* h) {
  const int64_t hk = s.max_rank * s.stack;
  for (int64_t k = 0; k < s.stack; ++k) {
    int64_t c = s.offsets[k];
    const int64_t end = s.offsets[k + 1];
    for (; c + 2 * kVecWidth <= end; c += 2 * kVecWidth) expand_tile<R, 2>(y, b_slot, s, rank, k, h, c);
    for (; c + kVecWidth <= end; c += kVecWidth) expand_tile<R, 1>(y, b_slot, s, rank, k, h, c);
    for (; c < end; ++c) {
      for (int b = 0; b < R; ++b) {
        float acc = to_float(y[b][c]);
        for (int64_t j = 0; j < rank; ++j)
          acc += h[b * hk + j * s.stack + k] * to_float(b_slot[(j * s.stack + k) * s.out + c]);
        y[b][c] = from_float<T>(acc);
      }
    }
  }
}

// y_b[c] += sum_j h[b][j, k] B[j, k, c] over each stacked module k's own columns c. On AVX-512
// all of a block's rows share a tile; with 16 registers (AVX2) halves of it.
template <typename T>
void expand_block(T* const* y, int rows, const T* b_slot, const DeltaShape& s, int64_t rank, const float* h) {
  constexpr int kTileRows = kVecWidth == 16 ? kBlockRows : kBlockRows / 2;
  const int64_t hk = s.max_rank * s.stack;
  for (int b = 0; b < rows; b += kTileRows) {
    with_rows<kTileRows>(std::min(kTileRows, rows - b), [&](auto r) {
      expand_rows<decltype(r)::value>(y + b, b_slot, s, rank, h + b * hk);
    });
  }
}

// The rows of each slot (slot 0 left out), cut into blocks of at most kBlockRows.
std::vector<std::vector<int64_t>> slot_blocks(const int64_t* slot_of, int64_t T, int64_t num_slots) {
  std::vector<std::vector<int64_t>> by_slot(num_slots);
  for (int64_t t = 0; t < T; ++t)
    if (slot_of[t] > 0) by_slot[slot_of[t]].push_back(t);
  std::vector<std::vector<int64_t>> blocks;
  for (const auto& rows : by_slot)
    for (size_t i = 0; i < rows.size(); i += kBlockRows)
      blocks.emplace_back(rows.begin() + i, rows.begin() + std::min(rows.size(), i + kBlockRows));
  return blocks;
}

DeltaShape delta_shape(const at::Tensor& a_buf, const at::Tensor& b_buf, const std::vector<int64_t>& pieces) {
  TORCH_CHECK(a_buf.dim() == 4 && b_buf.dim() == 4, "lora_delta: a_buf and b_buf must be [slots, R, stack, dim]");
  DeltaShape s{a_buf.size(3), b_buf.size(3), a_buf.size(1), a_buf.size(2), {0}};
  TORCH_CHECK(b_buf.size(0) == a_buf.size(0) && b_buf.size(1) == s.max_rank && b_buf.size(2) == s.stack,
              "lora_delta: a_buf ", a_buf.sizes(), " and b_buf ", b_buf.sizes(), " do not match");
  TORCH_CHECK(static_cast<int64_t>(pieces.size()) == s.stack, "lora_delta: ", pieces.size(),
              " output pieces for a stack of ", s.stack);
  for (int64_t p : pieces) s.offsets.push_back(s.offsets.back() + p);
  TORCH_CHECK(s.offsets.back() == s.out, "lora_delta: the pieces sum to ", s.offsets.back(), ", not ", s.out);
  return s;
}

}  // namespace

void lora_delta(at::Tensor& y, const at::Tensor& x, const at::Tensor& a_buf, const at::Tensor& b_buf,
                const at::Tensor& row_slot_in, const at::Tensor& rank_of_slot_in,
                const std::vector<int64_t>& pieces) {
  TORCH_CHECK(y.device().is_cpu() && x.device().is_cpu(), "lora_delta: CPU tensors only");
  const DeltaShape s = delta_shape(a_buf, b_buf, pieces);
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.size(1) == s.in && y.size(1) == s.out,
              "lora_delta: x ", x.sizes(), " and y ", y.sizes(), " do not match the buffers' ", s.in, " -> ", s.out);
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1, "lora_delta: x and y rows must have unit stride");
  TORCH_CHECK(a_buf.is_contiguous() && b_buf.is_contiguous(), "lora_delta: the buffers must be contiguous");
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && a_buf.scalar_type() == x.scalar_type() &&
                  b_buf.scalar_type() == x.scalar_type(),
              "lora_delta: x, y and the buffers must share one dtype");
  const at::Tensor row_slot = as_int64(row_slot_in), rank_of_slot = as_int64(rank_of_slot_in);
  const int64_t T = x.size(0), num_slots = rank_of_slot.numel();
  TORCH_CHECK(row_slot.numel() == T, "lora_delta: ", row_slot.numel(), " row slots for ", T, " rows");
  TORCH_CHECK(num_slots <= a_buf.size(0), "lora_delta: ranks of ", num_slots, " slots, the pool has ", a_buf.size(0));
  const int64_t* slot_of = row_slot.data_ptr<int64_t>();
  const int64_t* rank_of = rank_of_slot.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slot_of[t] >= 0 && slot_of[t] < num_slots, "lora_delta: row ", t, " has slot ", slot_of[t]);
    TORCH_CHECK(rank_of[slot_of[t]] >= 0 && rank_of[slot_of[t]] <= s.max_rank, "lora_delta: slot ", slot_of[t],
                " has rank ", rank_of[slot_of[t]], " beyond the pool's ", s.max_rank);
  }
  const auto blocks = slot_blocks(slot_of, T, num_slots);
  const int64_t block_work = kBlockRows * s.max_rank * s.stack * (s.in + s.out);
  RADIX_DISPATCH_FLOAT_BF16(x.scalar_type(), "lora_delta", S, [&] {
    const S* ap = a_buf.data_ptr<S>();
    const S* bp = b_buf.data_ptr<S>();
    const int64_t slot_a = s.max_rank * s.stack * s.in, slot_b = s.max_rank * s.stack * s.out;
    auto run_block = [&](int64_t i) {
      const auto& rows = blocks[i];
      const int64_t slot = slot_of[rows[0]], rank = rank_of[slot];
      const int n = static_cast<int>(rows.size());
      if (rank == 0) return;
      const S* xr[kBlockRows];
      S* yr[kBlockRows];
      for (int b = 0; b < n; ++b) {
        xr[b] = x.data_ptr<S>() + rows[b] * x.stride(0);
        yr[b] = y.data_ptr<S>() + rows[b] * y.stride(0);
      }
      float* h = thread_scratch(kBlockRows * (s.max_rank * s.stack + s.in));
      shrink_block(xr, n, ap + slot * slot_a, s, rank, h, h + kBlockRows * s.max_rank * s.stack);
      expand_block(yr, n, bp + slot * slot_b, s, rank, h);
    };
    const int64_t num_blocks = blocks.size();
    if (num_blocks * block_work < kParallelWork) {
      for (int64_t i = 0; i < num_blocks; ++i) run_block(i);
    } else {
      run_tasks(num_blocks, run_block);
    }
  });
}

}  // namespace radixengine::cpu
