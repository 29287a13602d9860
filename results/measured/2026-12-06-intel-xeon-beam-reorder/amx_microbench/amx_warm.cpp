#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <unistd.h>
#include <x86intrin.h>
#include <sys/syscall.h>
struct alignas(64) Cfg { uint8_t palette, start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; };
static double slice() {  // TSC cycles per DP over 1000 DPs
  unsigned long long t0 = __rdtsc();
  for (int i = 0; i < 250; ++i) { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
  return double(__rdtsc() - t0) / 1000;
}
int main(int argc, char** argv) {
  syscall(SYS_arch_prctl, 0x1023, 18);
  Cfg c = {}; c.palette = 1; for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3); _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
  // cold start: per 10 ms window, the mean cycles per DP
  unsigned long long start = __rdtsc();
  double sum = 0; int n = 0; unsigned long long w = start;
  while (__rdtsc() - start < 2100000000ull * 1.5) {
    sum += slice(); ++n;
    if (__rdtsc() - w > 21000000ull * 5) { printf("t=%4.0f ms: %.1f cyc/DP\n", (w - start) / 2.1e6, sum / n); w = __rdtsc(); sum = 0; n = 0; }
  }
  // decay: idle (sleep) for d ms, then first 2 ms rate
  for (int d : {1, 5, 20, 50, 100, 200, 500, 1000}) {
    unsigned long long t = __rdtsc(); while (__rdtsc() - t < 2100000000ull / 2) slice();  // re-warm 0.5 s
    usleep(d * 1000);
    double s = 0; for (int i = 0; i < 20; ++i) s += slice();
    unsigned long long t2 = __rdtsc(); double s2 = 0; int k = 0; while (__rdtsc() - t2 < 2100000ull * 50) { s2 += slice(); ++k; }
    printf("idle %4d ms -> first 20k DPs %.1f cyc/DP, next 50 ms %.1f\n", d, s / 20, s2 / k);
  }
}
