// Probe (issue 21): streaming a packed bf16 weight stream (1 GiB, 2 threads, 32-row blocks of K = 4096, the
// library's packed layout) through AMX tile loads with different software prefetches, against the vector
// loads of the 1-token kernel; rounds interleaved, best and median GB/s of 9.
//   g++ -O2 -march=native -pthread amx_near_prefetch.cpp -o amx_near_prefetch && ./amx_near_prefetch
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
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")
struct alignas(64) Cfg { uint8_t palette, start_row, r[14]; uint16_t colsb[16]; uint8_t rows[16]; };
alignas(64) static uint16_t XT[16*4096];
alignas(64) static uint16_t XR[16*4096];
alignas(64) static float ACC[2][4096];
alignas(64) static thread_local char BUF[2][2048];
__attribute__((noinline)) void avx1(const char* wb, long kpairs, const uint16_t* x, float* acc) {
  __m512 c0=_mm512_setzero_ps(), c1=c0; const int* xr=(const int*)x;
  for (long kp=0; kp<kpairs; ++kp, wb+=128) {
    _mm_prefetch(wb+1024,_MM_HINT_T0); _mm_prefetch(wb+1024+64,_MM_HINT_T0);
    _mm_prefetch(wb+4096,_MM_HINT_T1); _mm_prefetch(wb+4096+64,_MM_HINT_T1);
    __m512bh w0=(__m512bh)_mm512_load_si512(wb), w1=(__m512bh)_mm512_load_si512(wb+64);
    __m512bh b=(__m512bh)_mm512_set1_epi32(xr[kp]);
    c0=_mm512_dpbf16_ps(c0,w0,b); c1=_mm512_dpbf16_ps(c1,w1,b);
  }
  _mm512_storeu_ps(acc,c0); _mm512_storeu_ps(acc+16,c1);
}
template<int D0, int D1, int XS=64>
__attribute__((noinline)) void amx(const char* wb, long kpairs, const uint16_t* x, float* acc) {
  _tile_zero(0); _tile_zero(1);
  for (long kp = 0; kp < kpairs; kp += 16) {
    const char* cur = wb + kp*128;
    if (D0>=0) for (int l=0;l<32;++l) _mm_prefetch(cur+D0+64*l,_MM_HINT_T0);
    if (D1) for (int l=0;l<32;++l) _mm_prefetch(cur+D1+64*l,_MM_HINT_T1);
    _tile_loadd(4, x + (XS==64 ? 32*kp : 2*kp), XS);
    _tile_loadd(6, cur, 128); _tile_loadd(7, cur + 64, 128);
    _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7);
  }
  _tile_stored(0, acc, 128); _tile_stored(1, acc+16, 128);
}
template<int D0, int D1>
__attribute__((noinline)) void amxcopy(const char* wb, long kpairs, const uint16_t* x, float* acc) {
  _tile_zero(0); _tile_zero(1);
  int k = 0;
  for (long kp = 0; kp < kpairs; kp += 16, k ^= 1) {
    const char* cur = wb + kp*128;
    char* buf = BUF[k];
    if (D0) for (int l=0;l<32;++l) _mm_prefetch(cur+D0+64*l,_MM_HINT_T0);
    if (D1) for (int l=0;l<32;++l) _mm_prefetch(cur+D1+64*l,_MM_HINT_T1);
    for (int l=0;l<32;++l) _mm512_store_si512(buf+64*l, _mm512_load_si512(cur+64*l));
    _tile_loadd(4, x + 32*kp, 64);
    _tile_loadd(6, buf, 128); _tile_loadd(7, buf + 64, 128);
    _tile_dpbf16ps(0,4,6); _tile_dpbf16ps(1,4,7);
  }
  _tile_stored(0, acc, 128); _tile_stored(1, acc+16, 128);
}
typedef void (*Fn)(const char*, long, const uint16_t*, float*);
int main(int argc, char** argv){
  int nthr = 2;
  long total = 1L<<30;
  char* W = (char*)aligned_alloc(2<<20, total); madvise(W,total,MADV_HUGEPAGE); memset(W,0x11,total);
  memset(XT,0x11,sizeof XT); memset(XR,0x11,sizeof XR);
  long K = 4096, kpairs = K/2, blk = kpairs*128; long nblk = total/blk;
  struct M { const char* n; Fn f; } ms[] = {
     {"vector loads, 1 token (the decode kernel's loop)", avx1},
     {"AMX, L2 4 KiB ahead (the library before)", amx<-1, 4096>},
     {"AMX, L1 +256 B, L2 2.5 KiB ahead (now)", amx<256, 2560>},
     {"AMX, L1 +0 B, L2 2 KiB ahead", amx<0, 2048>},
     {"AMX, L1 +512 B, L2 3 KiB ahead", amx<512, 3072>},
     {"AMX, L1 +1 KiB, L2 4 KiB ahead (tried in stop 38)", amx<1024, 4096>},
     {"AMX, L1 +256 B, no L2 prefetch", amx<256, 0>},
     {"AMX, L1 +256 B, L2 2.5 KiB, activations 8 KiB stride", amx<256, 2560, 8192>},
     {"AMX, copy to L1 by vector loads, L1 +256 B, L2 2 KiB", amxcopy<256, 2048>}};
  const int NM = sizeof ms / sizeof ms[0];
  std::vector<double> res[NM];
  for (int rep=0; rep<9; ++rep) for (int mode=0; mode<NM; ++mode) {
    auto t0=std::chrono::steady_clock::now();
    std::vector<std::thread> th;
    for (int t=0;t<nthr;t++) th.emplace_back([&,t]{
      syscall(SYS_arch_prctl, 0x1023, 18);
      Cfg c{}; c.palette=1; for(int i=0;i<8;i++){c.rows[i]=16;c.colsb[i]=64;}
      _tile_loadconfig(&c);
      long b0 = t*nblk/nthr, b1=(t+1)*nblk/nthr;
      for (long b=b0;b<b1;b++) ms[mode].f(W+b*blk, kpairs, (mode==0||mode==7)?XR:XT, ACC[t]);
      _tile_release();
    });
    for (auto& x: th) x.join();
    res[mode].push_back(double(total)/std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count()/1e9);
  }
  for (int m=0;m<NM;m++){ auto v=res[m]; std::sort(v.begin(),v.end()); printf("%-58s best %.1f median %.1f GB/s \n", ms[m].n, v.back(), v[v.size()/2]); }
}
