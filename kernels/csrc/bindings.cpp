// The Python module: every function of ops.h, the activation codes (activation.h) and the
// DecoderStep class (decoder_step.h).
// Narrow includes (no <torch/extension.h>): the JIT build takes about half as long.
#include <torch/csrc/utils/pybind.h>

#include <string>

#include "attention.h"
#include "decoder_step.h"
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The GIL is released so the hybrid engine's GPU-tier thread runs while the CPU side works.
  m.def("ffn", &ffn, "sparse (idx) or dense (idx=None) FFN over neuron bundles, fp32 or int8",
        py::arg("x"), py::arg("packed"), py::arg("hidden"), py::arg("idx"), py::arg("act"),
        py::call_guard<py::gil_scoped_release>());
  m.def("ffn_thresholded", &ffn_thresholded,
        "ffn dropping each token's neurons with |act(gate, up)| <= h_threshold; (out, kept)",
        py::arg("x"), py::arg("packed"), py::arg("hidden"), py::arg("idx"), py::arg("act"),
        py::arg("h_threshold"), py::call_guard<py::gil_scoped_release>());
  m.def("has_avx2", &has_avx2, "built with the AVX2/FMA path");
  m.def("parallel_workers", &parallel_workers, "threads one parallel region runs on");
  m.def("q8_0_matmul", &q8_0_matmul, "x @ W^T with W in GGML Q8_0 blocks",
        py::arg("x"), py::arg("w"), py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "x / rms(x) * w per row", py::arg("x"), py::arg("w"),
        py::arg("eps"));
  m.def("residual_norm", &residual_norm, "x + norm(a), and the next sub-layer's normed input",
        py::arg("x"), py::arg("a"), py::arg("post"), py::arg("next"), py::arg("eps"));
  m.def("qk_norm_rope_", &qk_norm_rope_, "q/k head norms and rotary, in place on fused qkv",
        py::arg("qkv"), py::arg("n_heads"), py::arg("n_kv"), py::arg("head_dim"),
        py::arg("q_norm"), py::arg("k_norm"), py::arg("cos"), py::arg("sin"),
        py::arg("interleaved"), py::arg("eps"));
  m.def("attend", &attend, "T query rows' attention over their paged K/V pool rows",
        py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("slots"),
        py::arg("positions"), py::arg("n_heads"), py::arg("scale"), py::arg("softcap") = 0.0,
        py::call_guard<py::gil_scoped_release>());
  m.def("set_attention_first_part_chunks", &ember_attention::set_first_part_chunks,
        "tests: a split context's first part folds at most this many chunks (< 0: no limit)",
        py::arg("chunks"));
  m.def("set_attention_bf16_dots", &ember_attention::set_bf16_dots,
        "whether a bfloat16 KV pool's decoded tokens use AVX512_BF16 dot products; returns the setting before",
        py::arg("on"));
  m.def("activation_name",
        [](int64_t code) { return std::string(activation_name(activation_of(code))); },
        "the activation an integer code stands for (activation.h; models/activations.py)",
        py::arg("code"));
  m.def("argmax", &argmax, "index of the largest value (torch.argmax's rules)", py::arg("v"));
  m.def("top_k", &top_k, "the k largest values and their indices, largest first",
        py::arg("v"), py::arg("k"));
  m.def("q8_0_quantize", &q8_0_quantize, "float32 (N, K) -> Q8_0 rows (N, K/32*34)",
        py::arg("w"), py::call_guard<py::gil_scoped_release>());
  m.def("block_matmul", &block_matmul,
        "x @ W^T for each weight in its GGML blocks, outputs side by side",
        py::arg("x"), py::arg("weights"), py::arg("qtypes"),
        py::call_guard<py::gil_scoped_release>());
  m.def("dequantize_row", &dequantize_row, "one row of GGML blocks as (1, K) float32",
        py::arg("rows"), py::arg("qtype"), py::arg("index"));
  m.def("set_cpu_path", &set_cpu_path, "the instruction-set path block_matmul uses",
        py::arg("name"));
  m.def("cpu_path", &cpu_path, "the instruction-set path block_matmul uses");
  m.def("tile_relayout", &tile_relayout, "a weight's rows -> its input-major tiles (same bytes)",
        py::arg("rows"), py::arg("qtype"), py::arg("n"), py::arg("k"),
        py::call_guard<py::gil_scoped_release>());
  m.def("input_sparse_matmul", &input_sparse_matmul,
        "x @ W^T over input-major tiles, reading only inputs with |x| > threshold",
        py::arg("x"), py::arg("packed"), py::arg("types"), py::arg("n_out"),
        py::arg("threshold"), py::arg("stats"), py::call_guard<py::gil_scoped_release>());
  py::class_<DecoderStep>(m, "DecoderStep",
                          "every decoder layer for T rows on GGML-block weights, in one call")
      .def(py::init<>())
      .def("add_layer", &DecoderStep::add_layer, py::arg("attn_norm"), py::arg("qkv"),
           py::arg("qkv_types"), py::arg("n_heads"), py::arg("n_kv"), py::arg("head_dim"),
           py::arg("q_norm"), py::arg("k_norm"), py::arg("interleaved"), py::arg("wo"),
           py::arg("wo_type"), py::arg("post_attn_norm"), py::arg("ffn_norm"),
           py::arg("gate_up"), py::arg("gate_up_types"), py::arg("down"), py::arg("down_type"),
           py::arg("activation"), py::arg("post_ffn_norm"), py::arg("eps"), py::arg("scale"),
           py::arg("qkv_bias"), py::arg("attn_softcap"))
      .def("run", &DecoderStep::run, py::arg("x"), py::arg("k_pool"), py::arg("v_pool"),
           py::arg("slots"), py::arg("positions"), py::arg("cos"), py::arg("sin"),
           py::call_guard<py::gil_scoped_release>())
      .def("run_attention", &DecoderStep::run_attention, py::arg("layer"), py::arg("x"),
           py::arg("k_pool"), py::arg("v_pool"), py::arg("read_slots"), py::arg("positions"), py::arg("cos"),
           py::arg("sin"), py::call_guard<py::gil_scoped_release>())
      .def("set_input_sparse", &DecoderStep::set_input_sparse, py::arg("layer"), py::arg("slot"),
           py::arg("packed"), py::arg("types"), py::arg("n_out"), py::arg("threshold"),
           py::arg("stats"));
}
