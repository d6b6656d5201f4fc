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

constexpr int64_t kRowWork = 1 << 17;  // multiply-adds a thread takes at least

template <typename T>
float dot(const T* x, const T* w, int64_t n) {
  VecF acc = VecF::zero();
  int64_t i = 0;
  for (; i + kVecWidth <= n; i += kVecWidth) acc = fmadd(VecF::load(x + i), VecF::load(w + i), acc);
  float sum = hsum(acc);
  for (; i < n; ++i) sum += to_float(x[i]) * to_float(w[i]);
  return sum;
}

struct DeltaShape {
  int64_t in, out, max_rank, stack;
  std::vector<int64_t> offsets;  // stack + 1 column offsets of the stacked modules
};

template <typename T>
void shrink_row(const T* x, const T* a_slot, const DeltaShape& s, int64_t rank, float* h) {
  for (int64_t jk = 0; jk < rank * s.stack; ++jk) h[jk] = dot(x, a_slot + jk * s.in, s.in);
}

template <typename T>
void expand_row(T* y, const T* b_slot, const DeltaShape& s, int64_t rank, const float* h) {
  for (int64_t k = 0; k < s.stack; ++k) {
    int64_t c = s.offsets[k];
    const int64_t end = s.offsets[k + 1];
    for (; c + kVecWidth <= end; c += kVecWidth) {
      VecF acc = VecF::load(y + c);
      for (int64_t j = 0; j < rank; ++j) {
        const T* b = b_slot + (j * s.stack + k) * s.out;
        acc = fmadd(VecF::broadcast(h[j * s.stack + k]), VecF::load(b + c), acc);
      }
      round_to<T>(acc).store(y + c);
    }
    for (; c < end; ++c) {
      float acc = to_float(y[c]);
      for (int64_t j = 0; j < rank; ++j) acc += h[j * s.stack + k] * to_float(b_slot[(j * s.stack + k) * s.out + c]);
      y[c] = from_float<T>(acc);
    }
  }
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
  RADIX_DISPATCH_FLOAT_BF16(x.scalar_type(), "lora_delta", S, [&] {
    const S* xp = x.data_ptr<S>();
    S* yp = y.data_ptr<S>();
    const S* ap = a_buf.data_ptr<S>();
    const S* bp = b_buf.data_ptr<S>();
    const int64_t slot_a = s.max_rank * s.stack * s.in, slot_b = s.max_rank * s.stack * s.out;
    const int64_t row_work = std::max<int64_t>(1, s.max_rank * s.stack * (s.in + s.out));
    at::parallel_for(0, T, std::max<int64_t>(1, kRowWork / row_work), [&](int64_t begin, int64_t end) {
      float* h = thread_scratch(s.max_rank * s.stack);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t slot = slot_of[t], rank = slot ? rank_of[slot] : 0;
        if (rank == 0) continue;
        shrink_row(xp + t * x.stride(0), ap + slot * slot_a, s, rank, h);
        expand_row(yp + t * y.stride(0), bp + slot * slot_b, s, rank, h);
      }
    });
  });
}

}  // namespace radixengine::cpu
