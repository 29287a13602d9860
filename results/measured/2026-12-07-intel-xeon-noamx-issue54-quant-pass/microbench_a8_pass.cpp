#include "fk_quant_avx512.cpp"
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>
// One thread, the AVX-512 VNNI a8 micro-kernel alone (no activation quantization, no pool): M tokens over
// GROUPS row groups of 4096 columns, best of the repetitions, ns per block (16 rows x 32) and token.
//   g++ -O3 -std=c++17 -I fiddler/kernels/csrc microbench_a8_pass.cpp -o mb
//   [PASS=16] [PF=1] ./mb FMT(0 q8_0, 1 q4_0) M GROUPS     (12 groups: L2; 5000 / 9000: DRAM, with PF=1 the
//                                                           Intel table's prefetch, T0 1 KiB + T1 4 KiB)
namespace fk {
int qpass() { static const int p = getenv("PASS") ? atoi(getenv("PASS")) : 8; return p; }
StreamTuning stream_tuning() { static StreamTuning s{getenv("PF") ? 1 : kHintNone, 1024, getenv("PF") ? 4096 : 0}; return s; }
uint16_t f32_to_half(float f) { (void)f; return 0x2000; }
void silu_mul_f32_avx512(const float*, const float*, int64_t, float*) {}
void silu_mul_f32_generic(const float*, const float*, int64_t, float*) {}
}
using namespace fk;
int main(int argc, char** argv) {
  const int fmt = argc > 1 ? atoi(argv[1]) : 0, m = argc > 2 ? atoi(argv[2]) : 16;
  const int groups = argc > 3 ? atoi(argv[3]) : 12;
  const int64_t units = 64, ld = 16, ub = fmt == 0 ? 1088 : 576;
  std::vector<uint8_t> wv(groups * units * ub + 64);
  uint8_t* w = (uint8_t*)(((uintptr_t)wv.data() + 63) & ~63ull);
  for (size_t i = 0; i < groups * units * ub; ++i) w[i] = uint8_t(i * 2654435761u >> 13);
  for (int g = 0; g < groups; ++g) for (int u = 0; u < units; ++u) for (int i = 0; i < 32; ++i) {
    uint16_t h = f32_to_half(0.01f); memcpy(w + (g * units + u) * ub + 2 * i, &h, 2); }
  std::vector<int8_t> xq(units * 2 * ld * 32, 3); std::vector<float> xd(units * 2 * ld, 0.5f), acc(16 * 16);
  std::vector<int32_t> xs(units * 2 * ld, 0);
  double best = 1e9;
  const int reps = groups > 100 ? 20 : 400; for (int r = 0; r < reps; ++r) {
    auto a = std::chrono::steady_clock::now();
    for (int g = 0; g < groups; ++g) kQuantAvx512Ops.mk_a8(fmt, w + g * units * ub, units, xq.data(), xd.data(), xs.data(), ld, m, acc.data());
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
    if (s < best) best = s;
  }
  const double bt = double(groups) * units * 2 * m;
  printf("fmt %s m %d: %.3f ns per block-token (%.0f us)  acc %g\n", fmt == 0 ? "q8" : "q4", m, best / bt * 1e9, best * 1e6, acc[0]);
}
