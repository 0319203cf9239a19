// The CPU kernels as one Python extension module: every kernel header in one translation unit
// (parsing torch's headers is most of a compile, so it happens once), bound with pybind11.
// KVSERVE_MODULE is the module's name, which carries the build key (kernels/cpp_build.py): a
// library built from other sources or flags, or for another CPU, has another name.
#include "cpu_ops.h"
#include "cpu_linear.h"
#include "cpu_qlinear.h"
#include "cpu_decode_attention.h"
#include "cpu_prefill_attention.h"
#include "cpu_decode_step.h"
#include "cpu_load.h"

// The kernels touch tensors only: each runs without the GIL (the engine's other threads, the
// event loop among them, run Python meanwhile). Arguments are converted before it is released.
using no_gil = pybind11::call_guard<pybind11::gil_scoped_release>;

PYBIND11_MODULE(KVSERVE_MODULE, m) {
  m.def("rms_norm", &cpu_ops::rms_norm, no_gil());
  m.def("add_rms_norm", &cpu_ops::add_rms_norm, no_gil());
  m.def("rope_", &cpu_ops::rope_, no_gil());
  m.def("silu_mul", &cpu_ops::silu_mul, no_gil());
  m.def("argmax_logsumexp", &cpu_ops::argmax_logsumexp, no_gil());
  m.def("embed_rows", &cpu_ops::embed_rows, no_gil());
  m.def("store_kv", &cpu_ops::store_kv, no_gil(), pybind11::arg("key"), pybind11::arg("value"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("slots"),
        pybind11::arg("k_scale") = pybind11::none(), pybind11::arg("v_scale") = pybind11::none());
  m.def("linear", &cpu_linear::linear, no_gil());
  m.def("geometry", &cpu_linear::geometry);
  m.def("qlinear", &cpu_qlinear::linear, no_gil(), pybind11::arg("x"), pybind11::arg("packed"),
        pybind11::arg("N"), pybind11::arg("float_rows") = cpu_q4i8::FLOAT_ROWS);
  m.def("paged_decode", &cpu_decode_attention::paged_decode, no_gil(), pybind11::arg("query"),
        pybind11::arg("k_cache"), pybind11::arg("v_cache"), pybind11::arg("tables"),
        pybind11::arg("lens"), pybind11::arg("scale"), pybind11::arg("k_scale") = pybind11::none(),
        pybind11::arg("v_scale") = pybind11::none());
  m.def("prefill_attention", &cpu_prefill_attention::prefill_attention, no_gil(),
        pybind11::arg("query"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("tables"), pybind11::arg("cu"), pybind11::arg("lens"), pybind11::arg("scale"),
        pybind11::arg("k_scale") = pybind11::none(), pybind11::arg("v_scale") = pybind11::none());
  using cpu_decode_step::DecoderWeights;
  pybind11::class_<DecoderWeights>(m, "DecoderWeights")
      .def(pybind11::init(
          [](std::vector<std::vector<torch::Tensor>> qkv,
             std::vector<std::vector<int64_t>> qkv_sizes, std::vector<torch::Tensor> o,
             std::vector<std::vector<torch::Tensor>> gate_up,
             std::vector<std::vector<int64_t>> gate_up_sizes, std::vector<torch::Tensor> down,
             std::vector<torch::Tensor> post_norm, std::vector<torch::Tensor> next_norm) {
            return DecoderWeights{qkv, qkv_sizes, o, gate_up, gate_up_sizes, down, post_norm,
                                  next_norm};
          }));
  m.def("decode_layers", &cpu_decode_step::decode_layers);
  using cpu_decode_step::DecodeModel;
  pybind11::class_<DecodeModel>(m, "DecodeModel")
      .def(pybind11::init(
          [](torch::Tensor embed, std::optional<torch::Tensor> embed_d,
             std::optional<torch::Tensor> embed_m, torch::Tensor first_norm, torch::Tensor head,
             int64_t vocab, const DecoderWeights& layers, std::vector<torch::Tensor> k_cache,
             std::vector<torch::Tensor> v_cache, std::vector<torch::Tensor> k_scale,
             std::vector<torch::Tensor> v_scale, int64_t heads, int64_t kv_heads,
             int64_t head_dim, int64_t intermediate, double scale, double eps) {
            return DecodeModel{embed,   embed_d, embed_m,  first_norm, head,     vocab,
                               layers,  k_cache, v_cache,  k_scale,    v_scale,  heads,
                               kv_heads, head_dim, intermediate, scale,  eps};
          }));
  m.def("decode_tokens", &cpu_decode_step::decode_tokens);
  m.def("decode_timing", &cpu_decode_step::timing);
  m.def("write_frames", &cpu_load::write_frames);
  m.def("write_templated", &cpu_load::write_templated);
}
