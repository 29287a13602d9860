// Portable path: plain C++ compiled for the baseline ISA, runs on any CPU.
#include <cmath>
#include <cstring>

#include "fk.h"

namespace fk {

void mk_generic(const uint16_t* w, int64_t kpairs, const uint16_t* x, int64_t ldx, int m,
                float* acc, bool accumulate, const char*, int64_t) {
  for (int t = 0; t < m; ++t) {
    float a[kBlockN];
    if (accumulate) std::memcpy(a, acc + t * kBlockN, sizeof a);
    else std::memset(a, 0, sizeof a);
    const uint16_t* xr = x + t * ldx;
    const uint16_t* wp = w;
    for (int64_t kp = 0; kp < kpairs; ++kp, wp += 2 * kBlockN) {
      const float x0 = bf16_to_f32(xr[2 * kp]), x1 = bf16_to_f32(xr[2 * kp + 1]);
      for (int n = 0; n < kBlockN; ++n)
        a[n] += bf16_to_f32(wp[2 * n]) * x0 + bf16_to_f32(wp[2 * n + 1]) * x1;
    }
    std::memcpy(acc + t * kBlockN, a, sizeof a);
  }
}

void silu_mul_generic(const float* a, const float* b, int64_t n, uint16_t* h) {
  for (int64_t i = 0; i < n; ++i) h[i] = f32_to_bf16(a[i] / (1.0f + std::exp(-a[i])) * b[i]);
}

void store_generic(const float* acc, const float* bias, int64_t n, void* y, bool out_f32) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = acc[i] + (bias ? bias[i] : 0.0f);
    if (out_f32) static_cast<float*>(y)[i] = v;
    else static_cast<uint16_t*>(y)[i] = f32_to_bf16(v);
  }
}

template <int Hint>
uint64_t read64(const uint64_t* q, int64_t n, int64_t dist) {
  // four independent 64-bit xor chains: enough to keep a baseline core load-bound
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (int64_t i = 0; i < n / 8; i += 4) {
    if ((i & 7) == 0) prefetch<Hint>(reinterpret_cast<const char*>(q + i) + dist);
    s0 ^= q[i];
    s1 ^= q[i + 1];
    s2 ^= q[i + 2];
    s3 ^= q[i + 3];
  }
  return s0 ^ s1 ^ s2 ^ s3;
}

uint64_t read_generic(const void* p, int64_t n, int hint, int64_t dist) {
  const uint64_t* q = static_cast<const uint64_t*>(p);
  switch (hint) {
    case kHintT0: return read64<kHintT0>(q, n, dist);
    case kHintT1: return read64<kHintT1>(q, n, dist);
    case kHintNta: return read64<kHintNta>(q, n, dist);
    default: return read64<kHintNone>(q, n, dist);
  }
}

extern const IsaOps kGenericOps = {"generic", 4, mk_generic, silu_mul_generic, store_generic,
                                   read_generic, nullptr};

}  // namespace fk
