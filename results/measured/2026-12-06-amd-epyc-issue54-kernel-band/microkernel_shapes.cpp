#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
#include <string>
template <int M, int NW>
__attribute__((noinline)) void mk(const char* w, int64_t kpairs, const int* x, int64_t ldx, float* acc) {
  __m512 c[M][NW];
  for (int t = 0; t < M; ++t) for (int j = 0; j < NW; ++j) c[t][j] = _mm512_loadu_ps(acc + (t*NW+j)*16);
  const int* xr[M];
  for (int t = 0; t < M; ++t) xr[t] = x + t * ldx;
  for (int64_t kp = 0; kp < kpairs; ++kp, w += 64*NW) {
    __m512bh wr[NW];
    for (int j = 0; j < NW; ++j) wr[j] = (__m512bh)_mm512_load_si512(w + 64*j);
    for (int t = 0; t < M; ++t) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(xr[t][kp]);
      for (int j = 0; j < NW; ++j) c[t][j] = _mm512_dpbf16_ps(c[t][j], wr[j], b);
    }
  }
  for (int t = 0; t < M; ++t) for (int j = 0; j < NW; ++j) _mm512_storeu_ps(acc + (t*NW+j)*16, c[t][j]);
}
// x pre-broadcast: xb[kp][t][16]
template <int M, int NW>
__attribute__((noinline)) void mkb(const char* w, int64_t kpairs, const int* xb, float* acc) {
  __m512 c[M][NW];
  for (int t = 0; t < M; ++t) for (int j = 0; j < NW; ++j) c[t][j] = _mm512_loadu_ps(acc + (t*NW+j)*16);
  for (int64_t kp = 0; kp < kpairs; ++kp, w += 64*NW, xb += 16*M) {
    __m512bh wr[NW];
    for (int j = 0; j < NW; ++j) wr[j] = (__m512bh)_mm512_load_si512(w + 64*j);
    for (int t = 0; t < M; ++t) {
      const __m512bh b = (__m512bh)_mm512_load_si512(xb + 16*t);
      for (int j = 0; j < NW; ++j) c[t][j] = _mm512_dpbf16_ps(c[t][j], wr[j], b);
    }
  }
  for (int t = 0; t < M; ++t) for (int j = 0; j < NW; ++j) _mm512_storeu_ps(acc + (t*NW+j)*16, c[t][j]);
}
// weights broadcast role swapped? no. embedded-broadcast 3x4 via asm
__attribute__((noinline)) void mke34(const char* w, int64_t kpairs, const int* x, int64_t ldx, float* acc) {
  __m512 c0=_mm512_loadu_ps(acc),c1=_mm512_loadu_ps(acc+16),c2=_mm512_loadu_ps(acc+32),c3=_mm512_loadu_ps(acc+48);
  __m512 d0=_mm512_loadu_ps(acc+64),d1=_mm512_loadu_ps(acc+80),d2=_mm512_loadu_ps(acc+96),d3=_mm512_loadu_ps(acc+112);
  __m512 e0=_mm512_loadu_ps(acc+128),e1=_mm512_loadu_ps(acc+144),e2=_mm512_loadu_ps(acc+160),e3=_mm512_loadu_ps(acc+176);
  const int* x0 = x; const int* x1 = x + ldx; const int* x2 = x + 2*ldx;
  for (int64_t kp = 0; kp < kpairs; ++kp, w += 256) {
    __asm__ volatile(
      "vmovaps (%[w]), %%zmm28\n vmovaps 64(%[w]), %%zmm29\n vmovaps 128(%[w]), %%zmm30\n vmovaps 192(%[w]), %%zmm31\n"
      "vdpbf16ps (%[x0],%[kp],4)%{1to16%}, %%zmm28, %[c0]\n vdpbf16ps (%[x0],%[kp],4)%{1to16%}, %%zmm29, %[c1]\n"
      "vdpbf16ps (%[x0],%[kp],4)%{1to16%}, %%zmm30, %[c2]\n vdpbf16ps (%[x0],%[kp],4)%{1to16%}, %%zmm31, %[c3]\n"
      "vdpbf16ps (%[x1],%[kp],4)%{1to16%}, %%zmm28, %[d0]\n vdpbf16ps (%[x1],%[kp],4)%{1to16%}, %%zmm29, %[d1]\n"
      "vdpbf16ps (%[x1],%[kp],4)%{1to16%}, %%zmm30, %[d2]\n vdpbf16ps (%[x1],%[kp],4)%{1to16%}, %%zmm31, %[d3]\n"
      "vdpbf16ps (%[x2],%[kp],4)%{1to16%}, %%zmm28, %[e0]\n vdpbf16ps (%[x2],%[kp],4)%{1to16%}, %%zmm29, %[e1]\n"
      "vdpbf16ps (%[x2],%[kp],4)%{1to16%}, %%zmm30, %[e2]\n vdpbf16ps (%[x2],%[kp],4)%{1to16%}, %%zmm31, %[e3]\n"
      : [c0]"+v"(c0),[c1]"+v"(c1),[c2]"+v"(c2),[c3]"+v"(c3),[d0]"+v"(d0),[d1]"+v"(d1),[d2]"+v"(d2),[d3]"+v"(d3),
        [e0]"+v"(e0),[e1]"+v"(e1),[e2]"+v"(e2),[e3]"+v"(e3)
      : [w]"r"(w),[x0]"r"(x0),[x1]"r"(x1),[x2]"r"(x2),[kp]"r"(kp) : "zmm28","zmm29","zmm30","zmm31","memory");
  }
  _mm512_storeu_ps(acc,c0);_mm512_storeu_ps(acc+16,c1);_mm512_storeu_ps(acc+32,c2);_mm512_storeu_ps(acc+48,c3);
  _mm512_storeu_ps(acc+64,d0);_mm512_storeu_ps(acc+80,d1);_mm512_storeu_ps(acc+96,d2);_mm512_storeu_ps(acc+112,d3);
  _mm512_storeu_ps(acc+128,e0);_mm512_storeu_ps(acc+144,e1);_mm512_storeu_ps(acc+160,e2);_mm512_storeu_ps(acc+176,e3);
}
__attribute__((noinline)) void isa(int64_t n, float* out) {
  __m512 c[12]; for (auto& v: c) v = _mm512_setzero_ps();
  __m512bh a=(__m512bh)_mm512_set1_epi32(0), b=(__m512bh)_mm512_set1_epi32(out[0]);
  for (int64_t i=0;i<n;++i) for (auto& v: c) v=_mm512_dpbf16_ps(v,a,b);
  for (int j=0;j<12;++j) _mm512_storeu_ps(out+16*j,c[j]);
}
int main() {
  const int64_t KP = 128;
  char* w = (char*)aligned_alloc(64, KP * 512);
  for (int i = 0; i < KP * 512 / 2; ++i) ((uint16_t*)w)[i] = 0x3c00;
  int* x = (int*)aligned_alloc(64, 64 * 4096 * 4);
  for (int i = 0; i < 64 * 4096; ++i) x[i] = 0x3c003c00;
  static float acc[24 * 16 * 2] = {};
  const int REP = 5000;
  struct V { std::string name; double fl; std::function<void()> f; double best; };
  std::vector<V> vs;
  #define ADD(name, M, NW, call) vs.push_back({name, 64.0*M*NW*KP*REP, [&]{ for (int r=0;r<REP;++r) call; }, 1e9});
  vs.push_back({"isa", 64.0*12*KP*REP, [&]{ isa(KP*REP, acc); }, 1e9});
  ADD("mk12x2",12,2, (mk<12,2>(w,KP,x,4096,acc)))
  ADD("mk6x4",6,4, (mk<6,4>(w,KP,x,4096,acc)))
  ADD("mk4x6",4,6, (mk<4,6>(w,KP,x,4096,acc)))
  ADD("mk3x8",3,8, (mk<3,8>(w,KP,x,4096,acc)))
  ADD("mk3x4",3,4, (mk<3,4>(w,KP,x,4096,acc)))
  ADD("mke3x4",3,4, (mke34(w,KP,x,4096,acc)))
  ADD("mkb12x2",12,2, (mkb<12,2>(w,KP,x,acc)))
  ADD("mkb6x4",6,4, (mkb<6,4>(w,KP,x,acc)))
  for (int r = 0; r < 200; ++r)
    for (auto& v : vs) {
      auto t0 = std::chrono::steady_clock::now(); v.f();
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (s < v.best) v.best = s;
    }
  for (auto& v : vs) printf("%-10s %.1f GFLOP/s  %.3f of isa\n", v.name.c_str(), v.fl / v.best / 1e9, (v.fl/v.best)/(vs[0].fl/vs[0].best));
  printf("%f\n", acc[5]);
}
