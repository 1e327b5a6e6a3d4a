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

bool detect_avx2() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

enum class Isa { kPortable, kAvx2, kVnni };
const Isa kBest = detect_vnni() ? Isa::kVnni : (detect_avx2() ? Isa::kAvx2 : Isa::kPortable);
Isa g_isa = kBest;  // lowered by set_isa (tests compare the paths)

}  // namespace

bool has_vnni() { return g_isa == Isa::kVnni; }
bool has_avx2() { return g_isa == Isa::kAvx2; }

std::string isa_name() {
  return std::string("int8:") + (has_vnni() ? "avx512-vnni" : (has_avx2() ? "avx2" : "portable"));
}

std::vector<std::string> cpu_isas() {  // the paths this CPU can run, fastest first
  std::vector<std::string> r;
  if (kBest == Isa::kVnni) r.push_back("avx512-vnni");
  if (kBest != Isa::kPortable) r.push_back("avx2");
  r.push_back("portable");
  return r;
}

void set_isa(const std::string& name) {
  TORCH_CHECK(name == "auto" || name == "avx2" || name == "portable", "unknown ISA '", name,
              "' (expected auto, avx2 or portable)");
  TORCH_CHECK(name != "avx2" || kBest != Isa::kPortable, "this CPU has no AVX2 (with FMA and F16C)");
  g_isa = name == "auto" ? kBest : (name == "avx2" ? Isa::kAvx2 : Isa::kPortable);
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
  m.def("decoder_layer_paged", &verispec::decoder_layer_paged,
        "one decoder layer for the new tokens of several sequences on a paged KV cache (see decoder_layer.cpp)");
  m.def("attend_parts", &verispec::attend_parts,
        "test hook: one head group's attention on either path -> weights, fp32 sums, bf16 output");
  m.def("isa", &verispec::isa_name, "the instruction sets the kernels use now");
  m.def("gguf_layout", []() { return verispec::kGgufLayout; }, "the GGUF block layout linear_gguf expects");
  m.def("cpu_isas", &verispec::cpu_isas, "the kernel paths this CPU can run, fastest first");
  m.def("int8_peak_macs", &verispec::int8_peak_macs, "one core's measured int8 multiply-accumulates a second on the "
        "instruction the kernels use now (vpdpbusd or vpmaddubsw; 0 on the portable path)", py::arg("iters") = 20000000);
  m.def("set_isa", &verispec::set_isa, "'avx2' or 'portable' forces those paths (tests); 'auto' undoes it");
}
