// The instruction set's own compute peak: dot-product instructions on registers only (no loads, no
// stores in the timed loop), independent accumulators enough to cover each instruction's latency, on
// `threads` threads of the kernel's pool. It judges the kernels without being one of them: the
// roofline's other compute source (torch's GEMM, the kernel's own best) rests on code whose speed is in
// question, this one only on what the CPU issues per cycle.
//
// Kinds (ops = 2 per multiply-add):
//   avx512_bf16  vdpbf16ps zmm   16 lanes x 2 bf16 pairs       =    64 FLOP an instruction
//   avx512_vnni  vpdpbusd zmm    16 lanes x 4 u8*s8 products   =   128 OP
//   avx512_fma   vfmadd231ps zmm 16 lanes                      =    32 FLOP (the AVX-512 F path's bf16 math)
//   avx2_fma     vfmadd231ps ymm  8 lanes                      =    16 FLOP (the AVX2 path's bf16 math)
//   amx_bf16     tdpbf16ps       16 x 16 fp32, K = 32 bf16     = 16384 FLOP
//   amx_int8     tdpbssd         16 x 16 int32, K = 64 int8    = 32768 OP
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>

#include "fk_internal.h"

namespace fk {
namespace {

constexpr int64_t kChunks = 64;  // pieces a thread claims dynamically: a descheduled thread delays little

// The operands come from the caller (a run-time value), so nothing can be folded away; zero weights
// keep every accumulator finite.
#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bf16"))) float loop_avx512_bf16(int64_t iters, float v) {
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0), b = (__m512bh)_mm512_castps_si512(_mm512_set1_ps(v));
  __m512 c[12];
  for (auto& x : c) x = _mm512_setzero_ps();
  for (int64_t i = 0; i < iters; ++i)
    for (auto& x : c) x = _mm512_dpbf16_ps(x, a, b);
  __m512 s = c[0];
  for (int j = 1; j < 12; ++j) s = _mm512_add_ps(s, c[j]);
  float out[16];
  _mm512_storeu_ps(out, s);
  return out[0] + out[15];
}

__attribute__((target("avx512f,avx512vnni"))) float loop_avx512_vnni(int64_t iters, float v) {
  const __m512i a = _mm512_set1_epi32(int(v)), b = _mm512_setzero_si512();
  __m512i c[12];
  for (auto& x : c) x = _mm512_setzero_si512();
  for (int64_t i = 0; i < iters; ++i)
    for (auto& x : c) x = _mm512_dpbusd_epi32(x, a, b);
  __m512i s = c[0];
  for (int j = 1; j < 12; ++j) s = _mm512_add_epi32(s, c[j]);
  int out[16];
  _mm512_storeu_si512(out, s);
  return float(out[0] + out[15]);
}

__attribute__((target("avx512f"))) float loop_avx512_fma(int64_t iters, float v) {
  const __m512 a = _mm512_set1_ps(0.0f), b = _mm512_set1_ps(v);
  __m512 c[12];
  for (auto& x : c) x = _mm512_setzero_ps();
  for (int64_t i = 0; i < iters; ++i)
    for (auto& x : c) x = _mm512_fmadd_ps(a, b, x);
  __m512 s = c[0];
  for (int j = 1; j < 12; ++j) s = _mm512_add_ps(s, c[j]);
  float out[16];
  _mm512_storeu_ps(out, s);
  return out[0] + out[15];
}

__attribute__((target("avx2,fma"))) float loop_avx2_fma(int64_t iters, float v) {
  const __m256 a = _mm256_set1_ps(0.0f), b = _mm256_set1_ps(v);
  __m256 c[12];
  for (auto& x : c) x = _mm256_setzero_ps();
  for (int64_t i = 0; i < iters; ++i)
    for (auto& x : c) x = _mm256_fmadd_ps(a, b, x);
  __m256 s = c[0];
  for (int j = 1; j < 12; ++j) s = _mm256_add_ps(s, c[j]);
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0] + out[7];
}

// Four accumulator tiles (0..3) from two A (4, 5) and two B (6, 7) tiles, loaded once before the loop.
template <bool Int8>
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) float loop_amx(int64_t iters, float v) {
  alignas(64) uint8_t cfg[64] = {};
  cfg[0] = 1;  // palette 1: 16 rows x 64 bytes per tile
  for (int t = 0; t < 8; ++t) {
    cfg[16 + 2 * t] = 64;
    cfg[48 + t] = 16;
  }
  load_tile_config(cfg);
  alignas(64) uint8_t src[16 * 64];
  std::memset(src, 0, sizeof src);
  src[0] = uint8_t(int(v) & 1);
  _tile_loadd(4, src, 64);
  _tile_loadd(5, src, 64);
  _tile_loadd(6, src, 64);
  _tile_loadd(7, src, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < iters; ++i) {
    if constexpr (Int8) {
      _tile_dpbssd(0, 4, 6);
      _tile_dpbssd(1, 4, 7);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    } else {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  return out[0];
}
#endif

struct Kind {
  const char* name;
  double ops_per_iter;  // ops of one loop iteration (all its accumulators)
  float (*loop)(int64_t, float);
  bool (*supported)();
};

#if defined(__x86_64__)
const Kind kKinds[] = {
    {"avx512_bf16", 12 * 64.0, loop_avx512_bf16, [] { return cpu().avx512_bf16(); }},
    {"avx512_vnni", 12 * 128.0, loop_avx512_vnni,
     [] { return cpu().has[kAvx512f] && cpu().has[kAvx512vnni] && cpu().has[kOsAvx512]; }},
    {"avx512_fma", 12 * 32.0, loop_avx512_fma, [] { return cpu().avx512(); }},
    {"avx2_fma", 12 * 16.0, loop_avx2_fma, [] { return cpu().avx2(); }},
    {"amx_bf16", 4 * 16384.0, loop_amx<false>, [] { return cpu().amx() && request_amx_permission(); }},
    {"amx_int8", 4 * 32768.0, loop_amx<true>,
     [] { return cpu().amx() && cpu().has[kAmxInt8] && request_amx_permission(); }},
};
#endif

}  // namespace

double isa_peak(const char* kind, int threads, double ops, int repeats) {
#if defined(__x86_64__)
  const Kind* k = nullptr;
  for (const Kind& c : kKinds)
    if (kind && std::strcmp(kind, c.name) == 0) k = &c;
  if (!k) return fail(std::string("isa_peak: unknown kind '") + (kind ? kind : "(null)") +
                      "'; one of avx512_bf16, avx512_vnni, avx512_fma, avx2_fma, amx_bf16, amx_int8");
  if (!k->supported()) return fail(std::string("isa_peak: this CPU (or OS) cannot run ") + k->name);
  if (!(ops > 0)) return fail("isa_peak: ops must be positive");
  const int n = threads > 0 ? threads : default_threads();
  // iterations of one piece (on whichever thread claims it): `ops` in all, at least one a piece
  const int64_t per_chunk = std::max<int64_t>(1, int64_t(ops / (k->ops_per_iter * n * kChunks)));
  volatile float seed = 0.0f;
  const float v = seed;
  std::atomic<uint32_t> sink{0};
  double best = 0;
  for (int r = 0; r < std::max(1, repeats); ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    pool().run(n, int64_t(n) * kChunks, 1, [&](int64_t b, int64_t e) {
      float s = 0;
      for (int64_t i = b; i < e; ++i) s += k->loop(per_chunk, v);
      sink.fetch_xor(uint32_t(s), std::memory_order_relaxed);
    });
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(n) * kChunks * per_chunk * k->ops_per_iter / dt / 1e9);
  }
  return best + 0.0 * double(sink.load() & 1);
#else
  (void)kind, (void)threads, (void)ops, (void)repeats;
  return fail("isa_peak: x86-64 only");
#endif
}

}  // namespace fk
