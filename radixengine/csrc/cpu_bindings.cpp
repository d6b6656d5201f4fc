// Python bindings of the native CPU ops (one module per ISA level: radixengine._native_cpu_<level>).
#include <torch/csrc/utils/pybind.h>  // pybind11 with the at::Tensor casters

#include "cpu_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace cpu = radixengine::cpu;
  m.doc() = "radixengine native CPU kernels: paged attention, KV cache writes, RMSNorm, rotary, SiLU-mul, GGUF linears";
  m.def("decode_attention", &cpu::decode_attention, "Decode attention over the paged KV pool",
        py::arg("q"), py::arg("k_buffer"), py::arg("v_buffer"), py::arg("req_to_token"),
        py::arg("req_pool_indices"), py::arg("seq_lens"), py::arg("scale"),
        py::arg("num_kv_splits") = 0, py::arg("window_left") = -1, py::arg("logit_cap") = 0.0);
  m.def("decode_attention_cascade", &cpu::decode_attention_cascade,
        "Decode attention with shared prefixes computed once for all their requests",
        py::arg("q"), py::arg("k_buffer"), py::arg("v_buffer"), py::arg("req_to_token"),
        py::arg("req_pool_indices"), py::arg("seq_lens"), py::arg("scale"), py::arg("unit_rows"),
        py::arg("unit_start"), py::arg("unit_end"), py::arg("unit_member_ptr"),
        py::arg("unit_members"), py::arg("unit_member_slots"), py::arg("own_start"),
        py::arg("own_slot"), py::arg("num_kv_splits") = 0, py::arg("logit_cap") = 0.0,
        py::arg("use_amx") = true);
  m.def("amx_available", &cpu::amx_available, "Whether this process can use AMX tiles (cascade units, amx_linear)");
  m.def("extend_attention", &cpu::extend_attention,
        "Causal extend (prefill) attention over the paged KV pool with a cached prefix",
        py::arg("q"), py::arg("k_buffer"), py::arg("v_buffer"), py::arg("req_to_token"),
        py::arg("req_pool_indices"), py::arg("seq_lens"), py::arg("extend_seq_lens"),
        py::arg("extend_start_loc"), py::arg("scale"), py::arg("window_left") = -1,
        py::arg("logit_cap") = 0.0, py::arg("use_amx") = true, py::arg("short_as_decode") = true);
  m.def("set_kv_buffer", &cpu::set_kv_buffer, "Scatter K/V rows into the pool in place",
        py::arg("k_buffer"), py::arg("v_buffer"), py::arg("loc"), py::arg("k"), py::arg("v"));
  m.def("rms_norm", &cpu::rms_norm, "RMSNorm of [tokens, hidden] rows", py::arg("x"),
        py::arg("weight"), py::arg("eps"));
  m.def("fused_add_rms_norm", &cpu::fused_add_rms_norm,
        "In place: residual = x + residual; x = rms_norm(residual)", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("rotary_embedding", &cpu::rotary_embedding, "Neox-style rotary embedding, in place",
        py::arg("positions"), py::arg("x"), py::arg("cos_sin_cache"), py::arg("rotary_dim"));
  m.def("silu_and_mul", &cpu::silu_and_mul, "silu(x[:, :d]) * x[:, d:] for x [T, 2d]", py::arg("x"));
  m.def("amx_pack_linear_weight", &cpu::amx_pack_linear_weight,
        "A bf16 weight [N, K] in the tile layout amx_linear reads", py::arg("weight"));
  m.def("amx_linear", &cpu::amx_linear, "x [M, K] bf16 times a packed weight's transpose on AMX tiles",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  m.def("dpbf16_available", &cpu::dpbf16_available, "Whether this CPU and build have AVX512-BF16 dot products");
  m.def("dpbf16_linear", &cpu::dpbf16_linear,
        "x [M, K] bf16 times an amx_pack_linear_weight-packed weight's transpose with AVX512-BF16 dot products",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  m.def("bf16_pack_linear_weight", &cpu::bf16_pack_linear_weight,
        "A bf16 weight [N, K] as panels of 32 output columns, [N / 32][K][32], for bf16_linear",
        py::arg("weight"));
  m.def("bf16_linear", &cpu::bf16_linear,
        "x [M, K] float32 or bf16 times a bf16 panel-packed weight's transpose, in fp32 arithmetic",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none());
  m.def("quant_linear", &cpu::quant_linear,
        "x [M, K] float32 times the transpose of a GGUF block-quantized weight given as raw blocks",
        py::arg("x"), py::arg("qweight"), py::arg("qtype"));
  m.def("moe_grouped_linear", &cpu::moe_grouped_linear,
        "Rows of x grouped by expert (offsets [E + 1]) times each expert's weight w [E, K, N]",
        py::arg("x"), py::arg("w"), py::arg("offsets"));
  m.def("lora_delta", &cpu::lora_delta, "Each row's LoRA delta added into y in place, one call a batch",
        py::arg("y"), py::arg("x"), py::arg("a_buf"), py::arg("b_buf"), py::arg("row_slot"),
        py::arg("rank_of_slot"), py::arg("pieces"));
  m.def("isa", &cpu::isa, "Instruction set the extension was compiled for");
}
