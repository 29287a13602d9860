#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
// per 128-byte row: R rounds of 8 FMAs on 8 accumulators (compute), with prefetch dist ahead
template<int R>
float run(const char* p, long n, long dist){
  __m256 c[8]; for(int i=0;i<8;i++) c[i]=_mm256_setzero_ps();
  const __m256i m=_mm256_set1_epi32(0xffff0000);
  for(long i=0;i<n;i+=128){
    _mm_prefetch(p+i+dist,_MM_HINT_T0); _mm_prefetch(p+i+dist+64,_MM_HINT_T0);
    for(int j=0;j<4;j++){
      __m256i v=_mm256_load_si256((const __m256i*)(p+i+32*j));
      __m256 e=_mm256_castsi256_ps(_mm256_slli_epi32(v,16)), o=_mm256_castsi256_ps(_mm256_and_si256(v,m));
      for(int r=0;r<R;r++){ c[(2*j)%8]=_mm256_fmadd_ps(e,e,c[(2*j)%8]); c[(2*j+1)%8]=_mm256_fmadd_ps(o,o,c[(2*j+1)%8]); }
    }
  }
  float s=0; for(int i=0;i<8;i++) s+=c[i][0]; return s;
}
int main(int argc,char**argv){
  long n=1L<<30; char* p=(char*)aligned_alloc(4096,n+65536); memset(p,1,n+65536);
  int th=argc>1?atoi(argv[1]):2;
  auto bench=[&](auto fn,const char*name){
    double best=1e9;
    for(int rep=0;rep<3;rep++){
      auto t0=std::chrono::steady_clock::now();
      std::vector<std::thread> ts; for(int t=0;t<th;t++) ts.emplace_back([&,t]{ volatile float r=fn(p+t*(n/th),n/th,4096); (void)r;});
      for(auto&t:ts)t.join();
      double s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count(); if(s<best)best=s;
    }
    // same compute from L1 (4 KB buffer reused)
    double bc=1e9;
    for(int rep=0;rep<3;rep++){
      auto t0=std::chrono::steady_clock::now();
      std::vector<std::thread> ts; for(int t=0;t<th;t++) ts.emplace_back([&,t]{ float r=0; for(long k=0;k<n/th;k+=8192) r+=fn(p+t*8192,8192,0); volatile float rr=r; (void)rr;});
      for(auto&t:ts)t.join();
      double s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count(); if(s<bc)bc=s;
    }
    printf("%s: stream %.1f GB/s (%.1f ms)  compute-only %.1f ms\n",name,n/best/1e9,best*1e3,bc*1e3);
  };
  bench(run<1>,"R1"); bench(run<2>,"R2"); bench(run<4>,"R4"); bench(run<6>,"R6"); bench(run<8>,"R8");
}
