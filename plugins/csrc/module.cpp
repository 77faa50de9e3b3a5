// The Python module of qkiln's CPU kernels (one extension, built by plugins/cpu_native.py).

#include <torch/extension.h>

#include "decode_stack.h"
#include "cpu_attention_internal.h"
#include "qkiln_cpu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("w4a16_gemm", &w4a16_gemm, "int4 weight x bf16 activation GEMM for few rows");
  m.def("w8a16_gemm", &w8a16_gemm, "int8 weight x float activation GEMM for few rows");
  m.def("w4a8_gemm", &w4a8_gemm, "int4/int8 weight x int8-per-32-channel activation GEMM");
  m.def("w4a8_gemv", &w4a8_gemv, "int4 weight (GEMV layout) x int8-per-32-channel activations");
  m.def("int4_a8_kernel_isa", &int4_a8_kernel_isa, "the kernel w4a8_gemv compiled");
  m.def("w8a8_gemv", &w8a8_gemv, "int8 weight x int8-per-32-channel activations, few rows");
  m.def("int8_a8_kernel_isa", &int8_a8_kernel_isa, "the kernel w8a8_gemv compiled");
  m.def("w4a8_kernel_isa", &w4a8_kernel_isa, "the w4a8 kernel this build compiled");
  m.def("bf16_gemm", &bf16_gemm, "bf16 x bf16 GEMM over 48-channel weight panels, many rows");
  m.def("w4a16_amx_gemm", &w4a16_amx_gemm, "int4 codes x bf16 GEMM on AMX, many rows, exact");
  m.def("int8_codes_amx_gemm", &int8_codes_amx_gemm, "int8 codes x bf16 GEMM on AMX, unscaled");
  m.def("codes_amx_ready", &codes_amx_ready, "whether the AMX codes GEMMs can run here");
  m.def("amx_prefill_ready", &attention_detail::amx_prefill_ready,
        "whether paged_attention serves prefill rows on AMX here (QKILN_AMX_PREFILL=0: never)");
  m.def("bf16_gemm_isa", &bf16_gemm_isa, "the bf16 GEMM kernel this build compiled");
  m.def("int4_kernel_isa", &int4_kernel_isa, "the int4 kernel this build compiled");
  m.def("decode_attention_isa", &decode_attention_isa,
        "the decode attention kernel this build compiled for bf16 queries over bf16 caches");
  m.def("int8_kernel_isa", &int8_kernel_isa, "the int8 kernels this build compiled");
  namespace py = pybind11;
  using Opt = c10::optional<at::Tensor>;
  m.def("paged_attention",
        [](const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
           const at::Tensor& block_tables, const at::Tensor& seq_lens,
           const at::Tensor& query_start_loc, double scale, at::Tensor& out, Opt k_scale,
           Opt v_scale, Opt k_group_scale, Opt k_group_min, Opt v_group_scale, Opt v_group_min) {
          paged_attention(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                          out, {k_scale, v_scale, k_group_scale, k_group_min, v_group_scale, v_group_min});
        },
        "causal paged attention over every query row (float, fp8 or int4 caches)",
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("scale"), py::arg("out"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        py::arg("k_group_scale") = py::none(), py::arg("k_group_min") = py::none(),
        py::arg("v_group_scale") = py::none(), py::arg("v_group_min") = py::none());
  m.def("cache_write",
        [](const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache, at::Tensor& v_cache,
           const at::Tensor& slot_mapping, Opt k_scale, Opt v_scale, Opt k_group_scale,
           Opt k_group_min, Opt v_group_scale, Opt v_group_min) {
          cache_write(key, value, k_cache, v_cache, slot_mapping,
                      {k_scale, v_scale, k_group_scale, k_group_min, v_group_scale, v_group_min});
        },
        "quantize K/V rows into float, fp8 or int4 paged caches",
        py::arg("key"), py::arg("value"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        py::arg("k_group_scale") = py::none(), py::arg("k_group_min") = py::none(),
        py::arg("v_group_scale") = py::none(), py::arg("v_group_min") = py::none());
  m.def("rms_norm", &rms_norm, "RMSNorm with Hugging Face's rounding");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual add + RMSNorm, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("rotary_embedding", &rotary_embedding, "rotate-half RoPE in place");
  m.def("argmax_rows", &argmax_rows, "first index of each row's maximum (torch.argmax's rule)");
  m.def("scale_columns_", &scale_columns_, "x[m, n] *= scales[n] in fp32, rounded once, in place");
  m.def("exp_is_torchs", &silu_exp_is_torchs, "whether SiLU uses torch's own vector exp");

  // module_local: the portable test build loads a second copy of these types in one process.
  py::class_<NativeLinear>(m, "NativeLinear", py::module_local())
      .def(py::init([](int64_t bits, at::Tensor weight, at::Tensor scales,
                       c10::optional<at::Tensor> zero_term, c10::optional<at::Tensor> bias,
                       int64_t group_size, int64_t in_features, int64_t out_features) {
             return NativeLinear(bits, weight, scales, zero_term.value_or(at::Tensor()), bias,
                                 group_size, in_features, out_features);
           }),
           py::arg("bits"), py::arg("weight"), py::arg("scales"), py::arg("zero_term"),
           py::arg("bias"), py::arg("group_size"), py::arg("in_features"),
           py::arg("out_features"))
      .def("add_int8_activations", &NativeLinear::add_int8_activations, py::arg("packed"),
           py::arg("scales"), py::arg("zero_scales"), py::arg("group_size"))
      .def("use_int8_activations", &NativeLinear::use_int8_activations)
      .def("add_dense", &NativeLinear::add_dense, py::arg("weight"))
      .def("add_amx_codes", &NativeLinear::add_amx_codes, py::arg("tables") = py::none());
  py::class_<StackLayer>(m, "StackLayer", py::module_local())
      .def(py::init([](NativeLinear qkv, NativeLinear o, NativeLinear gate_up, NativeLinear down,
                       at::Tensor input_norm, at::Tensor post_norm, at::Tensor k_cache,
                       at::Tensor v_cache, Opt k_scale, Opt v_scale, Opt k_group_scale,
                       Opt k_group_min, Opt v_group_scale, Opt v_group_min, Opt k_offset) {
             const KVParams kv{k_scale, v_scale, k_group_scale, k_group_min, v_group_scale, v_group_min};
             kv.check(k_cache, cache_head_dim(k_cache), "StackLayer");
             return StackLayer{qkv, o, gate_up, down, input_norm, post_norm, k_cache, v_cache, kv,
                               k_offset.value_or(at::Tensor())};
           }),
           py::arg("qkv"), py::arg("o"), py::arg("gate_up"), py::arg("down"),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
           py::arg("k_group_scale") = py::none(), py::arg("k_group_min") = py::none(),
           py::arg("v_group_scale") = py::none(), py::arg("v_group_min") = py::none(),
           py::arg("k_offset") = py::none());
  py::class_<DecodeStack>(m, "DecodeStack", py::module_local())
      .def(py::init<std::vector<StackLayer>, at::Tensor, int64_t, int64_t, int64_t, double, int64_t>(),
           py::arg("layers"), py::arg("final_norm"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("max_gemv_rows"))
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>())
      .def("logits", &DecodeStack::logits, py::call_guard<py::gil_scoped_release>())
      .def("set_head", &DecodeStack::set_head, py::arg("head"))
      .def("set_inputs", &DecodeStack::set_inputs, py::arg("embedding"), py::arg("cos"),
           py::arg("signed_sin"))
      .def("inputs", &DecodeStack::inputs)
      .def_property_readonly("has_head", &DecodeStack::has_head)
      .def_property_readonly("num_layers", &DecodeStack::num_layers)
      .def_property_readonly("int8_activations", &DecodeStack::int8_activations)
      .def_property_readonly("dense_rows", &DecodeStack::dense_rows)
      .def_property_readonly("max_gemv_rows", &DecodeStack::max_gemv_rows);
}
