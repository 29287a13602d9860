#include <immintrin.h>
#include <x86intrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdio>
#include <cstdint>
#include <algorithm>
#pragma GCC target("amx-tile,amx-int8,avx512f,avx512dq")
struct alignas(64) Cfg { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
alignas(64) int8_t buf[64][64*64];
alignas(64) int32_t cb[8][16][16];
alignas(64) float fl[64][16];
void cfg() { Cfg c = {}; c.palette = 1;
  for (int t = 0; t < 4; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  for (int t = 4; t < 6; ++t) { c.rows[t] = 16; c.colsb[t] = 32; }
  for (int t = 6; t < 8; ++t) { c.rows[t] = 8; c.colsb[t] = 64; }
  asm volatile("" ::: "memory"); _tile_loadconfig(&c); }
// per iteration: 2 blocks of tile work (TILE) and/or 2 x 16 x (ALU ops) of vector work (VEC: 1 = reg-only fma, 2 = loads+cvt+mul+fma)
template <int TILE, int VEC> double run(int n) {
  __m512 f[16]; for (int t = 0; t < 16; ++t) f[t] = _mm512_set1_ps(t);
  const __m512 d = _mm512_set1_ps(1.0001f);
  uint64_t t0 = __rdtsc();
  for (int i = 0; i < n; ++i) {
    if constexpr (TILE >= 1) {
      _tile_zero(0); _tile_loadd(4, buf[0], 32); _tile_loadd(6, buf[1], 64); _tile_dpbssd(0,4,6);
      _tile_zero(1); _tile_loadd(5, buf[2], 32); _tile_loadd(7, buf[3], 64); _tile_dpbssd(1,5,7);
      if constexpr (TILE == 2) { _tile_stored(0, cb[(i&1)*2], 64); _tile_stored(1, cb[(i&1)*2+1], 64); }
    }
    if constexpr (VEC == 1) {
#pragma GCC unroll 32
      for (int k = 0; k < 48; ++k) f[k & 15] = _mm512_fmadd_ps(f[k & 15], d, d);
    }
    if constexpr (VEC == 2) {
#pragma GCC unroll 32
      for (int k = 0; k < 32; ++k) f[k & 15] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb[4 + (k >> 4)][k & 15])), _mm512_mul_ps(d, _mm512_set1_ps(fl[k][0])), f[k & 15]);
    }
  }
  uint64_t t1 = __rdtsc();
  for (int t = 0; t < 16; ++t) _mm512_store_ps(fl[32 + t], f[t]);
  return double(t1 - t0) / (2.0 * n);
}
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  cfg();
  const char* nm[] = {"tile", "tile+store", "fma48 only", "tile+fma48", "tile+store+fma48", "scale only", "tile+scale", "tile+store+scale"};
  double (*fs[])(int) = {run<1,0>, run<2,0>, run<0,1>, run<1,1>, run<2,1>, run<0,2>, run<1,2>, run<2,2>};
  double m[8]; for (auto& x : m) x = 1e9;
  for (int r = 0; r < 300; ++r) for (int v = 0; v < 8; ++v) m[v] = std::min(m[v], fs[v](500));
  for (int v = 0; v < 8; ++v) printf("%-18s %5.1f per block\n", nm[v], m[v]);
  _tile_release();
}
