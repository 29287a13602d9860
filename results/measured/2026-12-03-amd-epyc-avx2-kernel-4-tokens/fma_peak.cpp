#include <immintrin.h>
#include <chrono>
#include <cstdio>
int main(){
  __m256 c[12]; for(int i=0;i<12;i++) c[i]=_mm256_set1_ps(i*0.001f);
  __m256 a=_mm256_set1_ps(0.9999f), b=_mm256_set1_ps(0.0001f);
  long n=200000000;
  auto t0=std::chrono::steady_clock::now();
  for(long i=0;i<n;i++){
    #pragma GCC unroll 12
    for(int j=0;j<12;j++) c[j]=_mm256_fmadd_ps(a,c[j],b);

  }
  double s=std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count();
  float r=0; for(int i=0;i<12;i++) r+=c[i][0];
  printf("%.1f GFLOP/s one core (%f)\n", n*12*16/s/1e9, r);
}
