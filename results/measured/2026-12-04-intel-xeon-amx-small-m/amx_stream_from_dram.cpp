#include <immintrin.h>
#include <cstdio>
#include <cstdint>
#include <chrono>
#include <unistd.h>
#include <sys/syscall.h>
#include <sys/mman.h>
#include <cstring>
#include <cstdlib>
#include <thread>
#include <vector>
#include <algorithm>
#include <initializer_list>
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
struct alignas(64) Cfg { uint8_t palette, start_row, r[14]; uint16_t colsb[16]; uint8_t rows[16]; };
alignas(64) static uint16_t X[16*4096*2];
alignas(64) static float ACC[4][32*32*4];
static long D0=1024, D1=4096;
__attribute__((noinline)) void avx1(const char* wb, long kpairs, const uint16_t* x, float* acc) {
  __m512 c0=_mm512_setzero_ps(), c1=c0; const int* xr=(const int*)x;
  for (long kp=0; kp<kpairs; ++kp, wb+=128) {
    _mm_prefetch(wb+D0,_MM_HINT_T0); _mm_prefetch(wb+D0+64,_MM_HINT_T0);
    _mm_prefetch(wb+D1,_MM_HINT_T1); _mm_prefetch(wb+D1+64,_MM_HINT_T1);
    __m512bh w0=(__m512bh)_mm512_load_si512(wb), w1=(__m512bh)_mm512_load_si512(wb+64);
    __m512bh b=(__m512bh)_mm512_set1_epi32(xr[kp]);
    c0=_mm512_dpbf16_ps(c0,w0,b); c1=_mm512_dpbf16_ps(c1,w1,b);
  }
  _mm512_storeu_ps(acc,c0); _mm512_storeu_ps(acc+16,c1);
}
static long XS=64;
template<bool PF, bool ST=false>
__attribute__((noinline)) void amx1(const char* wb, long kpairs, const uint16_t* x, float* acc) {
  _tile_zero(0); _tile_zero(1);
  for (long kp = 0; kp < kpairs; kp += 16) {
    const char* cur = wb + kp*128;
    if (PF) { for (int l=0;l<32;++l) _mm_prefetch(cur+D0+64*l,_MM_HINT_T0); for (int l=0;l<32;++l) _mm_prefetch(cur+D1+64*l,_MM_HINT_T1); }
    _tile_loadd(4, x + (XS==64 ? 32*kp : 2*kp), XS);
    if (ST) { _tile_stream_loadd(6, cur, 128); _tile_stream_loadd(7, cur + 64, 128); }
    else { _tile_loadd(6, cur, 128); _tile_loadd(7, cur + 64, 128); }
    _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7);
  }
  _tile_stored(0, acc, 128); _tile_stored(1, acc+16, 128);
}
// two blocks (consecutive, blk bytes apart) at once
__attribute__((noinline)) void amx2(const char* wb, long kpairs, long blk, const uint16_t* x, float* acc) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  const char* wb2 = wb + blk;
  for (long kp = 0; kp < kpairs; kp += 16) {
    const char* cur = wb + kp*128; const char* cur2 = wb2 + kp*128;
    for (int l=0;l<32;++l) _mm_prefetch(cur+D0+64*l,_MM_HINT_T0); for (int l=0;l<32;++l) _mm_prefetch(cur+D1+64*l,_MM_HINT_T1);
    for (int l=0;l<32;++l) _mm_prefetch(cur2+D0+64*l,_MM_HINT_T0); for (int l=0;l<32;++l) _mm_prefetch(cur2+D1+64*l,_MM_HINT_T1);
    _tile_loadd(4, x + 2*kp, 64);
    _tile_loadd(6, cur, 128); _tile_loadd(7, cur + 64, 128);
    _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7);
    _tile_loadd(6, cur2, 128); _tile_loadd(7, cur2 + 64, 128);
    _tile_dpbf16ps(2,4,6); _tile_dpbf16ps(3,4,7);
  }
  _tile_stored(0, acc, 128); _tile_stored(1, acc+16, 128); _tile_stored(2, acc+1024, 128); _tile_stored(3, acc+1024+16, 128);
}
static long TD=2048;
__attribute__((noinline)) void amxtouch(const char* wb, long kpairs, const uint16_t* x, float* acc) {
  _tile_zero(0); _tile_zero(1);
  __m512i s = _mm512_setzero_si512();
  for (long kp = 0; kp < kpairs; kp += 16) {
    const char* cur = wb + kp*128;
    for (int l=0;l<32;++l) s = _mm512_or_si512(s, _mm512_load_si512(cur+TD+64*l));
    for (int l=0;l<32;++l) _mm_prefetch(cur+D1+64*l,_MM_HINT_T1);
    _tile_loadd(4, x + 32*kp, 64);
    _tile_loadd(6, cur, 128); _tile_loadd(7, cur + 64, 128);
    _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7);
  }
  _tile_stored(0, acc, 128); _tile_stored(1, acc+16, 128);
  _mm512_storeu_si512(acc+2048, s);
}
int main(int argc, char** argv){
  int nthr = argc>1 ? atoi(argv[1]) : 2; XS = argc>2 ? atol(argv[2]) : 64;
  long total = 1L<<30;
  char* W = (char*)aligned_alloc(2<<20, total); madvise(W,total,MADV_HUGEPAGE); memset(W,0x11,total);
  memset(X,0x11,sizeof X);
  long K = 4096, kpairs = K/2, blk = kpairs*128; long nblk = total/blk;
  const char* names[] = {"avx t1", "amx pf", "amx nopf", "amx 2blk", "amx stream", "amx stream nopf", "touch1k", "touch2k","touch4k"};
  std::vector<double> res[9];
  for (int rep=0; rep<5; ++rep) for (int mode=0; mode<9; ++mode) {
    auto t0=std::chrono::steady_clock::now();
    std::vector<std::thread> th;
    for (int t=0;t<nthr;t++) th.emplace_back([&,t]{
      syscall(SYS_arch_prctl, 0x1023, 18);
      Cfg c{}; c.palette=1; for(int i=0;i<8;i++){c.rows[i]=16;c.colsb[i]=64;}
      _tile_loadconfig(&c);
      long b0 = t*nblk/nthr, b1=(t+1)*nblk/nthr;
      for (long b=b0;b<b1;b++) {
        if (mode==0) avx1(W+b*blk, kpairs, X, ACC[t]);
        else if (mode==1) amx1<true>(W+b*blk, kpairs, X, ACC[t]);
        else if (mode==2) amx1<false>(W+b*blk, kpairs, X, ACC[t]);
        else if (mode>=6) { TD = 1024L << (mode-6); amxtouch(W+b*blk, kpairs, X, ACC[t]); }
        else if (mode==4) amx1<true,true>(W+b*blk, kpairs, X, ACC[t]);
        else if (mode==5) amx1<false,true>(W+b*blk, kpairs, X, ACC[t]);
        else { if (b+1<b1) { amx2(W+b*blk, kpairs, blk, X, ACC[t]); ++b; } else amx1<true>(W+b*blk, kpairs, X, ACC[t]); }
      }
      _tile_release();
    });
    for (auto& x: th) x.join();
    res[mode].push_back(double(total)/std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count()/1e9);
  }
  for (int m=0;m<9;m++){ auto v=res[m]; std::sort(v.begin(),v.end()); printf("%-10s best %.1f median %.1f GB/s\n", names[m], v.back(), v[v.size()/2]); }
}
