// The batched LoRA delta of one target linear, in place: y[t] += B_s (A_s x[t]) for each row t of
// slot s = row_slot[t] > 0, with the slot's own rank. One call for the whole batch, whatever the
// number of adapters in it (the torch forms take three ops over all slots' columns, or two ops
// a slot); each row computes only its own slot's columns and, per stacked module (q/k/v,
// gate/up), only that module's output columns.
//
// a_buf [slots, R, stack, in], b_buf [slots, R, stack, out] (the LoRA pool's layout); `pieces`:
// the output columns of each stacked module, in order. The shrink is accumulated in fp32 and
// not rounded; a bfloat16 y is rounded once, after the add.
#include "cpu_common.h"
#include "cpu_ops.h"

namespace radixengine::cpu {
namespace {

constexpr int64_t kParallelWork = 1 << 22;  // multiply-adds below which one thread does all
constexpr int64_t kBlockRows = 4;            // rows of one slot that share each weight load

struct DeltaShape {
  int64_t in, out, max_rank, stack;
  std::vector<int64_t> offsets;  // stack + 1 column offsets of the stacked modules
};

// h[b][jk] = x_b . A[jk] for the block's rows (jk = j * stack + k, the pool's row order).
template <typename T>
void shrink_block(const T* const* x, int64_t rows, const T* a_slot, const DeltaShape& s, int64_t rank, float* h) {
  const int64_t n = s.in, hk = s.max_rank * s.stack;
  for (int64_t jk = 0; jk < rank * s.stack; ++jk) {
    const T* w = a_slot + jk * n;
    VecF acc[kBlockRows];
    for (int64_t b = 0; b < rows; ++b) acc[b] = VecF::zero();
    int64_t i = 0;
    for (; i + kVecWidth <= n; i += kVecWidth) {
      const VecF wv = VecF::load(w + i);
      for (int64_t b = 0; b < rows; ++b) acc[b] = fmadd(VecF::load(x[b] + i), wv, acc[b]);
    }
    for (int64_t b = 0; b < rows; ++b) {
      float sum = hsum(acc[b]);
      for (int64_t t = i; t < n; ++t) sum += to_float(x[b][t]) * to_float(w[t]);
      h[b * hk + jk] = sum;
    }
  }
}

// y_b[c] += sum_j h[b][j, k] B[j, k, c] over each stacked module k's own columns c.
template <typename T>
void expand_block(T* const* y, int64_t rows, const T* b_slot, const DeltaShape& s, int64_t rank, const float* h) {
  const int64_t hk = s.max_rank * s.stack;
  for (int64_t k = 0; k < s.stack; ++k) {
    int64_t c = s.offsets[k];
    const int64_t end = s.offsets[k + 1];
    for (; c + kVecWidth <= end; c += kVecWidth) {
      for (int64_t b = 0; b < rows; ++b) {
        VecF acc = VecF::load(y[b] + c);
        for (int64_t j = 0; j < rank; ++j) {
          const VecF wv = VecF::load(b_slot + (j * s.stack + k) * s.out + c);
          acc = fmadd(VecF::broadcast(h[b * hk + j * s.stack + k]), wv, acc);
        }
        round_to<T>(acc).store(y[b] + c);
      }
    }
    for (; c < end; ++c) {
      for (int64_t b = 0; b < rows; ++b) {
        float acc = to_float(y[b][c]);
        for (int64_t j = 0; j < rank; ++j)
          acc += h[b * hk + j * s.stack + k] * to_float(b_slot[(j * s.stack + k) * s.out + c]);
        y[b][c] = from_float<T>(acc);
      }
    }
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
      const int64_t slot = slot_of[rows[0]], rank = rank_of[slot], n = rows.size();
      if (rank == 0) return;
      const S* xr[kBlockRows];
      S* yr[kBlockRows];
      for (int64_t b = 0; b < n; ++b) {
        xr[b] = x.data_ptr<S>() + rows[b] * x.stride(0);
        yr[b] = y.data_ptr<S>() + rows[b] * y.stride(0);
      }
      float* h = thread_scratch(kBlockRows * s.max_rank * s.stack);
      shrink_block(xr, n, ap + slot * slot_a, s, rank, h);
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
