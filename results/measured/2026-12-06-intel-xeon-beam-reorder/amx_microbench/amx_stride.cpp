#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <x86intrin.h>
#include <sys/syscall.h>
#include <unistd.h>
struct alignas(64) Cfg { uint8_t palette, start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; };
alignas(64) static uint16_t buf[1 << 18];
template <int BS, int AS>
double run(long n) {
  const char* b = (const char*)buf; const char* a = (const char*)buf + 65536;
  unsigned long long t0 = __rdtsc();
  for (long i = 0; i < n; ++i) {
    _tile_loadd(4, a, AS); _tile_loadd(5, a + 16 * AS, AS);
    _tile_loadd(6, b, BS); _tile_loadd(7, b + 64, BS);
    _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
  }
  return double(__rdtsc() - t0) / (4 * n);
}
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  Cfg c = {}; c.palette = 1; for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
  for (auto& x : buf) x = 0x3f80;
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  { unsigned long long t = __rdtsc(); while (__rdtsc() - t < 2100000000ull) for (int i = 0; i < 1000; ++i) { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); } }
  double m[4] = {1e9, 1e9, 1e9, 1e9};
  for (int r = 0; r < 20; ++r) {
    double v;
    v = run<128, 64>(100000); if (v < m[0]) m[0] = v;
    v = run<64, 64>(100000); if (v < m[1]) m[1] = v;
    v = run<128, 4096>(100000); if (v < m[2]) m[2] = v;
    v = run<64, 128>(100000); if (v < m[3]) m[3] = v;
  }
  printf("B s128 A s64: %.1f  B s64 A s64: %.1f  B s128 A s4096: %.1f  B s64 A s128: %.1f  TSC cycles/DP\n", m[0], m[1], m[2], m[3]);
}
