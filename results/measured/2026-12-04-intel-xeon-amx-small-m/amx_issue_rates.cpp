#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <chrono>
#include <unistd.h>
#include <sys/syscall.h>
#include <cstring>
#include <cstdlib>
struct alignas(64) Cfg { uint8_t palette, start_row, r[14]; uint16_t colsb[16]; uint8_t rows[16]; };
alignas(64) static uint8_t W[1<<20], X[1<<18], C[1<<14];
__attribute__((target("amx-tile,amx-bf16,avx512f")))
double run(int mode, long iters) {
  Cfg c{}; c.palette=1; for(int t=0;t<8;t++){c.rows[t]=16;c.colsb[t]=64;}
  _tile_loadconfig(&c);
  _tile_zero(0);_tile_zero(1);_tile_zero(2);_tile_zero(3);
  _tile_loadd(4, X, 64); _tile_loadd(5, X, 64); _tile_loadd(6, W, 128); _tile_loadd(7, W+64, 128);
  auto t0=std::chrono::steady_clock::now();
  const long wmask = (1<<20)-1;
  for (long i=0;i<iters;i++){
    const uint8_t* wb = W + ((i*2048)&wmask);
    if (mode==0){ _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7);}            // 2 dp, 2 acc, no loads
    else if (mode==1){ _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7); _tile_dpbf16ps(2,5,6); _tile_dpbf16ps(3,5,7);} // 4 dp 4 acc
    else if (mode==2){ _tile_loadd(6, wb,128); _tile_loadd(7, wb+64,128); _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7);} // B loads
    else if (mode==3){ _tile_loadd(4, X, 64); _tile_loadd(6, wb,128); _tile_loadd(7, wb+64,128); _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7);} // +A
    else if (mode==4){ _tile_loadd(6, wb,128); _tile_loadd(7, wb+64,128);} // loads only
    else if (mode==6){ _tile_release(); _tile_loadconfig(&c); _tile_dpbf16ps(0,4,6);}
    else if (mode==7){ _tile_stored(0, C, 128); _tile_loadd(0, C, 128); _tile_dpbf16ps(0,4,6);}
    else if (mode==8){ _tile_loadd(4, X + (i&15)*64, 8192); _tile_loadd(6, wb,128); _tile_loadd(7, wb+64,128); _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7);} // A stride 8K
    else if (mode==9){ _tile_loadd(4, X + (i&31)*64, 2048); _tile_loadd(6, wb,128); _tile_loadd(7, wb+64,128); _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7);} // A stride 2K
    else if (mode==10){ if ((i&7)==0){ _tile_stored(0, C, 128); _tile_stored(1, C+64, 128); __m512 s=_mm512_setzero_ps(); for(int r=0;r<16;r++) s=_mm512_add_ps(s,_mm512_loadu_ps((float*)(C+r*128))); _mm512_storeu_ps((float*)(C+4096), s); _tile_zero(0); _tile_zero(1);} _tile_loadd(4, X, 64); _tile_loadd(6, wb,128); _tile_loadd(7, wb+64,128); _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7);} // store+vec read every 8 steps
    else if (mode==5){ _tile_loadd(6, wb,128); _tile_dpbf16ps(0,4,6); _tile_loadd(7, wb+64,128); _tile_dpbf16ps(1,4,7); _tile_dpbf16ps(2,5,6); _tile_dpbf16ps(3,5,7);} // m=32
  }
  auto t1=std::chrono::steady_clock::now();
  _tile_stored(0, C, 64);
  _tile_release();
  return std::chrono::duration<double>(t1-t0).count();
}
int main(){
  syscall(SYS_arch_prctl, 0x1023, 18);
  memset(W,1,sizeof W); memset(X,1,sizeof X);
  long it=2000000;
  const char* names[]={"2dp","4dp","2B+2dp","A+2B+2dp","2B only","m32:2B+4dp","rel+cfg+dp","st+ld C+dp","A8K+2B+2dp","A2K+2B+2dp","st+vec/8"};
  for(int m=0;m<11;m++){ run(m,10000); double s=run(m,it); printf("%-12s %.1f ns/iter  %.1f GB/s of W per 2KiB iter\n", names[m], s/it*1e9, 2048.0*it/s/1e9);}
}
