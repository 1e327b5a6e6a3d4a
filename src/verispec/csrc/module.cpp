// The extension module: CPU feature dispatch and the op registrations (torch.ops.verispec.*).
#include "kernels.h"

namespace verispec {
namespace {

bool detect_vnni() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

const bool kCpuVnni = detect_vnni();
bool g_portable = false;  // forced by set_isa("portable")

}  // namespace

bool has_vnni() { return !g_portable && kCpuVnni; }

std::string isa_name() { return std::string("int8:") + (has_vnni() ? "avx512-vnni" : "portable"); }

void set_isa(const std::string& name) {
  TORCH_CHECK(name == "auto" || name == "portable", "unknown ISA '", name, "' (expected auto or portable)");
  g_portable = name == "portable";
}

}  // namespace verispec

TORCH_LIBRARY(verispec, m) {
  m.def("linear_int8(Tensor x, Tensor packed, Tensor scale, Tensor rowsum, Tensor? bias, int n) -> Tensor");
  m.def("linear_q4(Tensor x, Tensor packed, Tensor d, Tensor m, Tensor? bias, int n) -> Tensor");
  m.def("linear_gguf(Tensor x, Tensor q, Tensor s, Tensor meta, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(verispec, CPU, m) {
  m.impl("linear_int8", &verispec::linear_int8);
  m.impl("linear_q4", &verispec::linear_q4);
  m.impl("linear_gguf", &verispec::linear_gguf);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decoder_layer_quantized", &verispec::decoder_layer_quantized,
        "one decoder layer for <= 16 new tokens of one sequence, int8 matrices (see decoder_layer.cpp)");
  m.def("isa", &verispec::isa_name, "the instruction sets the kernels use now");
  m.def("set_isa", &verispec::set_isa, "'portable' forces the plain C++ paths (tests); 'auto' undoes it");
}
