#include <immintrin.h>
#include <cstdint>
#include <cstdio>
#include <chrono>
#include <sys/syscall.h>
#include <unistd.h>
struct alignas(64) Cfg { uint8_t palette, start; uint8_t res[14]; uint16_t colsb[16]; uint8_t rows[16]; };
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  syscall(SYS_arch_prctl, 0x1023, 18);
  Cfg c = {}; c.palette = 1; for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
  alignas(64) static uint16_t buf[8192]; for (auto& v : buf) v = 0x3f80;
  alignas(64) static float out[4096];
  for (int t = 4; t < 8; ++t) {}
  _tile_loadd(4, buf, 64); _tile_loadd(5, buf, 64); _tile_loadd(6, buf, 64); _tile_loadd(7, buf, 64);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int rep = 0; rep < 8; ++rep) {
    const long N = 2000000; double t0 = now();
    for (long i = 0; i < N; ++i) { _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
    double dt = now() - t0;
    double t1 = now();
    for (long i = 0; i < N / 4; ++i) {
      _tile_loadd(4, buf, 64); _tile_loadd(6, buf + 512, 64); _tile_loadd(7, buf + 1024, 64); _tile_loadd(5, buf + 1536, 64);
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7); }
    double dt2 = now() - t1;
    printf("DP only %.0f GFLOP/s (%.2f ns/DP)   with 4 L1 loads per 4 DP %.0f GFLOP/s\n", N * 4 * 16384.0 / dt / 1e9, dt / (N * 4) * 1e9, N * 16384.0 / dt2 / 1e9);
  }
  _tile_stored(0, out, 64);
  _tile_release();
}
