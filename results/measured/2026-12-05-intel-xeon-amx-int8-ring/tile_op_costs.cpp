#include <immintrin.h>
#include <x86intrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdio>
#include <cstdint>
#include <algorithm>
#pragma GCC target("amx-tile,amx-int8,avx512f")
struct alignas(64) Cfg { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
alignas(64) int8_t buf[64][64*64];
alignas(64) int32_t cb[8][16][16];
void cfg(int ka) { Cfg c = {}; c.palette = 1;
  for (int t = 0; t < 4; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  for (int t = 4; t < 6; ++t) { c.rows[t] = 16; c.colsb[t] = ka; }
  for (int t = 6; t < 8; ++t) { c.rows[t] = ka/4; c.colsb[t] = 64; }
  asm volatile("" ::: "memory"); _tile_loadconfig(&c); }
template <int V> double run(int n) {
  cfg(V < 4 ? 32 : 64);
  uint64_t t0 = __rdtsc();
  for (int i = 0; i < n; ++i) {
    if constexpr (V == 0 || V == 4) { // loads A (stride = colsb)
      constexpr int S = V == 0 ? 32 : 64;
      _tile_loadd(4, buf[0], S); _tile_loadd(5, buf[2], S); _tile_loadd(4, buf[4], S); _tile_loadd(5, buf[6], S); }
    if constexpr (V == 1 || V == 5) { // loads B
      _tile_loadd(6, buf[1], 64); _tile_loadd(7, buf[3], 64); _tile_loadd(6, buf[5], 64); _tile_loadd(7, buf[7], 64); }
    if constexpr (V == 2 || V == 6) { // current pattern per block
      constexpr int S = V == 2 ? 32 : 64;
      _tile_zero(0); _tile_loadd(4, buf[0], S); _tile_loadd(6, buf[1], 64); _tile_dpbssd(0,4,6);
      _tile_zero(1); _tile_loadd(5, buf[2], S); _tile_loadd(7, buf[3], 64); _tile_dpbssd(1,5,7);
      _tile_stored(0, cb[0], 64); _tile_stored(1, cb[1], 64);
      _tile_zero(2); _tile_loadd(4, buf[4], S); _tile_loadd(6, buf[5], 64); _tile_dpbssd(2,4,6);
      _tile_zero(3); _tile_loadd(5, buf[6], S); _tile_loadd(7, buf[7], 64); _tile_dpbssd(3,5,7);
      _tile_stored(2, cb[2], 64); _tile_stored(3, cb[3], 64); }
    if constexpr (V == 3 || V == 7) { // dp only
      _tile_dpbssd(0,4,6); _tile_dpbssd(1,5,7); _tile_dpbssd(2,4,6); _tile_dpbssd(3,5,7); }
    if constexpr (V == 8) { // option P with stores (64-wide)
      _tile_loadd(6, buf[1], 64);
      _tile_zero(0); _tile_loadd(4, buf[0], 64); _tile_dpbssd(0,4,6);
      _tile_zero(1); _tile_loadd(5, buf[2], 64); _tile_dpbssd(1,5,6);
      _tile_stored(0, cb[0], 64); _tile_stored(1, cb[1], 64);
      _tile_loadd(7, buf[5], 64);
      _tile_zero(2); _tile_loadd(4, buf[4], 64); _tile_dpbssd(2,4,7);
      _tile_zero(3); _tile_loadd(5, buf[6], 64); _tile_dpbssd(3,5,7);
      _tile_stored(2, cb[2], 64); _tile_stored(3, cb[3], 64); }
    if constexpr (V == 9) { // stores only
      _tile_stored(0, cb[0], 64); _tile_stored(1, cb[1], 64); _tile_stored(2, cb[2], 64); _tile_stored(3, cb[3], 64); }
  }
  return double(__rdtsc() - t0) / (4.0 * n);
}
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  const char* nm[] = {"ldA k32", "ldB k32", "block k32", "dp k32", "ldA k64", "ldB k64", "block k64", "dp k64", "optP k64", "stores"};
  double (*fs[])(int) = {run<0>,run<1>,run<2>,run<3>,run<4>,run<5>,run<6>,run<7>,run<8>,run<9>};
  double m[10]; for (auto& x : m) x = 1e9;
  for (int r = 0; r < 300; ++r) for (int v = 0; v < 10; ++v) { if (!r) {fprintf(stderr,"v%d ",v);} m[v] = std::min(m[v], fs[v](500)); }
  for (int v = 0; v < 10; ++v) printf("%-10s %5.1f per op/block\n", nm[v], m[v]);
  _tile_release();
}
