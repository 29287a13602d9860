#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <chrono>
#include <unistd.h>
#include <sys/syscall.h>
#include <cstring>
#include <initializer_list>
#pragma GCC target("amx-tile,amx-bf16,avx512f")
struct alignas(64) Cfg { uint8_t palette, start_row, r[14]; uint16_t colsb[16]; uint8_t rows[16]; };
alignas(64) static uint8_t W[1<<19];
static int NS=16;
alignas(64) static uint16_t X[64*4096];
alignas(64) static float C[4096];
// 16 steps of m32 x n32 over a 512-k chunk: B from W (32 KiB, L1), A from X with row stride xs
__attribute__((noinline)) void piece(const uint16_t* x, long xs, long xoff_step, bool reload) {
  if (reload) { _tile_loadd(0,C,128); _tile_loadd(1,C+16,128); _tile_loadd(2,C+512,128); _tile_loadd(3,C+528,128);}
  for (int s=0;s<NS;s++) {
    _tile_loadd(4, x + s*xoff_step, xs);
    _tile_loadd(6, W + s*2048, 128); _tile_loadd(7, W + s*2048 + 64, 128);
    _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7);
    _tile_loadd(5, x + s*xoff_step + 16*xs/2, xs);
    _tile_dpbf16ps(2,5,6); _tile_dpbf16ps(3,5,7);
  }
  if (reload) { _tile_stored(0,C,128); _tile_stored(1,C+16,128); _tile_stored(2,C+512,128); _tile_stored(3,C+528,128);}
}
int main(){
  syscall(SYS_arch_prctl, 0x1023, 18);
  memset(W,1,sizeof W); memset(X,1,sizeof X);
  Cfg c{}; c.palette=1; for(int t=0;t<8;t++){c.rows[t]=16;c.colsb[t]=64;}
  _tile_loadconfig(&c); _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
  for (int ns : {16, 32, 64, 128}) for (int mode=1; mode<4; mode+=2) { NS=ns;
    long xs = (mode&1) ? 64 : 8192; long step = (mode&1) ? 512 : 32; bool rl = mode&2;
    long it=3200000/NS; auto t0=std::chrono::steady_clock::now();
    for (long i=0;i<it;i++) piece(X + (i&7)*16384*((mode&1)?1:0) , xs, step, rl);
    double s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count();
    printf("steps %3d A stride %5ld reloadC %d: %.1f ns/step  %.0f GFLOP/s\n", NS, xs, rl, s/it/NS*1e9, it*double(NS)*32*32*32*2/s/1e9);
  }
  _tile_release();
}
