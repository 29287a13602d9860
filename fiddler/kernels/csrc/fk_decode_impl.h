// Decode-step attention kernels, compiled once per ISA: fk_decode.cpp includes this file inside
// namespace fk::decode::<isa> under a `#pragma GCC target` (like fk_amx_impl.h). Plain loops over
// fixed 16-lane arrays: the compiler vectorises them for the target, and because the summation order
// is written out (no -ffast-math, fp-contract off under -std=c++17, and products of two bf16 values
// are exact in fp32, so FMA or not changes nothing) every ISA build gives bit-identical results.
// Standard headers must be included before this file; it defines only static functions, so no
// inline function shared with other translation units is emitted with the target's instructions.

static inline float ld(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

static inline uint16_t st(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // NaN stays quiet
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

static inline float rnd(float f) { return ld(st(f)); }

constexpr int kLanes = 16;

// sum_i q[i] * k[i] (q already widened to fp32): 16 lane sums, the tail, then a pairwise tree.
static inline float dot_f32_bf16(const float* q, const uint16_t* k, int64_t d) {
  float acc[kLanes];
  for (int l = 0; l < kLanes; ++l) acc[l] = 0.0f;
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += q[i + l] * ld(k[i + l]);
  for (int l = 0; i < d; ++i, ++l) acc[l] += q[i] * ld(k[i]);
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  return acc[0];
}

// y[i] = bf16(x[i]*cos[i]) + bf16(rotate_half(x)[i]*sin[i]), the sum rounded to fp32 then bf16:
// torch's three bf16 ops (each computes in fp32 and rounds to bf16 once).
static void rope_row(const uint16_t* x, const uint16_t* cs, const uint16_t* sn, int64_t d, uint16_t* y) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float r = i < half ? -ld(x[i + half]) : ld(x[i - half]);
    y[i] = st(rnd(ld(x[i]) * ld(cs[i])) + rnd(r * ld(sn[i])));
  }
}

static inline float bits_f32(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

// ATen's Vectorized<float>::fexp_u20 (vec256_float.h / vec512_float.h: "fast exponential intended for
// cases where outputs will be downcasted to FP16 / BF16"), lane by lane: torch's CPU flash attention
// uses it for the exps of the full 16-key chunks of each key block when the inputs are bf16.
// 2^(x log2 e) from a cubic correction of the fractional part and the float's exponent bits.
static inline float fexp_u20(float x) {
  const float ln_flt_min = bits_f32(0xc2aeac50u), ln_flt_max = bits_f32(0x42b17218u);
  if (x < ln_flt_min) return 0.0f;
  if (x > ln_flt_max) return INFINITY;
  if (x != x) return x;  // NaN (torch's lane gives -0 here; keep the NaN visible)
  const float log2e = bits_f32(0x3fb8aa3bu);
  const float c0 = 0.00010703434948458272f, c1 = 0.30354260500649682f, c2 = float(-0.22433836478672356),
              c3 = float(-0.079204240219773236);
  const float a = 8388608.0f, b = 8388608.0f * 127.0f;
  float src = x * log2e;
  const float fr = src - __builtin_floorf(src);
  float res = __builtin_fmaf(fr, c3, c2);
  res = __builtin_fmaf(fr, res, c1);
  res = __builtin_fmaf(fr, res, c0);
  src = src - res;
  const float t = __builtin_fmaf(a, src, b);
  const int32_t bits = int32_t(t);  // truncation (cvttps)
  return bits_f32(uint32_t(bits));
}

// One query head against keys [j0, L) of one KV head; kc/vc: [max_seq, d] of that head.
// Mirrors torch's CPU flash attention (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) for one
// query row: key blocks of kKvSplit positions (aligned to 0); per block s = (q.k) * scale, the
// block max, p = exp(s - max) (fexp_u20 over the full 16-key chunks of the block, expf on the tail),
// summed in fp32 as 16 lanes reduced like vec_reduce_all, then the tail in order; p rounded to bf16
// for p @ V (torch stores it in the reduced dtype for its gemm); running sum and accumulator
// rescaled by exp(old max - new max); at the end out = bf16(acc * (1 / sum)). Masked keys (before
// j0) are exact zeros in torch and are skipped here. Not reproduced: the summation order of torch's
// two gemms (q.k and p @ V; fp32 accumulation of exact bf16 products in both), so a result can
// differ from torch's by one bf16 rounding step.
constexpr int64_t kKvSplit = 512;

static void attend_one(const float* qf, const uint16_t* kc, const uint16_t* vc, int64_t d, int64_t j0,
                       int64_t L, float scale, float* s, float* acc, uint16_t* out) {
  for (int64_t j = j0; j < L; ++j) s[j] = dot_f32_bf16(qf, kc + j * d, d) * scale;
  float m_run = -INFINITY, sum_run = 0.0f;
  for (int64_t i = 0; i < d; ++i) acc[i] = 0.0f;
  bool first = true;
  for (int64_t b0 = (j0 / kKvSplit) * kKvSplit; b0 < L; b0 += kKvSplit) {
    const int64_t a = b0 > j0 ? b0 : j0, e = b0 + kKvSplit < L ? b0 + kKvSplit : L;
    const int64_t vec_end = b0 + (e - b0) / kLanes * kLanes;  // torch's vector part of the block
    float bmax = -INFINITY;
    for (int64_t j = a; j < e; ++j) bmax = s[j] > bmax ? s[j] : bmax;
    const float tmax = m_run > bmax ? m_run : bmax;
    float lane[kLanes];
    for (int l = 0; l < kLanes; ++l) lane[l] = 0.0f;
    int64_t j = a;
    for (; j < vec_end; ++j) {
      const float p = fexp_u20(s[j] - tmax);
      lane[(j - b0) % kLanes] += p;
      s[j] = rnd(p);  // the bf16 probability used for p @ V
    }
    for (int w = kLanes / 2; w >= 1; w /= 2)
      for (int l = 0; l < w; ++l) lane[l] += lane[l + w];
    float tsum = lane[0];
    for (; j < e; ++j) {
      const float p = __builtin_expf(s[j] - tmax);
      tsum += p;
      s[j] = rnd(p);
    }
    const float exp_tmp = __builtin_expf(m_run - tmax);  // 0 on the first block (m_run = -inf)
    sum_run = tsum + exp_tmp * sum_run;
    m_run = tmax;
    if (!first)
      for (int64_t i = 0; i < d; ++i) acc[i] *= exp_tmp;
    first = false;
    for (int64_t jj = a; jj < e; ++jj) {
      const float p = s[jj];
      const uint16_t* vj = vc + jj * d;
      for (int64_t i = 0; i < d; ++i) acc[i] += p * ld(vj[i]);
    }
  }
  const float inv = 1.0f / sum_run;
  for (int64_t i = 0; i < d; ++i) out[i] = st(acc[i] * inv);
}

// See fk_rope_attn_decode_bf16 in fk_decode.cpp for the arguments. scratch: at least
// (max_seq + 2 * d) floats plus d bf16 (as floats' worth of space).
// Rope for the new keys, written with the values into the cache at `pos` (every row, every KV head).
static void write_kv(const uint16_t* qkv, int64_t B, int64_t nh, int64_t nkv, int64_t d, int64_t pos,
                     const uint16_t* cos_row, const uint16_t* sin_row, uint16_t* kcache, uint16_t* vcache,
                     int64_t max_seq) {
  const int64_t width = (nh + 2 * nkv) * d;
  for (int64_t b = 0; b < B; ++b) {
    const uint16_t* row = qkv + b * width;
    for (int64_t g = 0; g < nkv; ++g) {
      const int64_t head = (b * nkv + g) * max_seq;
      rope_row(row + (nh + g) * d, cos_row, sin_row, d, kcache + (head + pos) * d);
      __builtin_memcpy(vcache + (head + pos) * d, row + (nh + nkv + g) * d, size_t(d) * 2);
    }
  }
}

// Attention of query heads [h0, h1) of the flattened (row, head) range, after write_kv. Each query
// head is independent, so any split over threads gives the same bits.
static void attend_heads(const uint16_t* qkv, int64_t nh, int64_t nkv, int64_t d, int64_t pos,
                         const uint16_t* cos_row, const uint16_t* sin_row, const uint16_t* kcache,
                         const uint16_t* vcache, int64_t max_seq, int64_t j0, float scale, uint16_t* out,
                         int64_t h0, int64_t h1, float* scratch) {
  const int64_t L = pos + 1, group = nh / nkv, width = (nh + 2 * nkv) * d;
  float* s = scratch;            // [max_seq] scores, then bf16-rounded probabilities
  float* qf = s + max_seq;       // [d] roped query, widened
  float* acc = qf + d;           // [d] p @ V accumulator
  uint16_t* qb = reinterpret_cast<uint16_t*>(acc + d);  // [d] roped query, bf16
  for (int64_t bh = h0; bh < h1; ++bh) {
    const int64_t b = bh / nh, h = bh % nh;
    const int64_t head = (b * nkv + h / group) * max_seq;
    rope_row(qkv + b * width + h * d, cos_row, sin_row, d, qb);
    for (int64_t i = 0; i < d; ++i) qf[i] = ld(qb[i]);
    attend_one(qf, kcache + head * d, vcache + head * d, d, j0, L, scale, s, acc, out + bh * d);
  }
}

// ---------------------------------------------------------------- torch's fp32 sum, replayed
// x.pow(2).mean(-1) on the CPU is at::sum then a division by n. The sum is ATen's cascade_sum
// (aten/src/ATen/native/cpu/SumKernel.cpp): an inner contiguous row of n >= 8 floats is summed as
// Vectorized<float> units of 8 lanes (the reduction kernels are compiled for AVX2 even where torch
// reports AVX512: 8 lanes, checked against torch 2.13 on an AVX512 CPU), 4 independent
// accumulators (ilp), a 4-level cascade; then the scalar tail, then the 8 lanes in order. Shorter
// rows use the same cascade on scalars. Replaying it makes rms_norm bit-exact against torch. The lane
// count is a template argument so that the 8-lane units compile to vector adds (same order, same bits).
constexpr int kSumLanes = 8;

static inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  return 64 - __builtin_clzll(uint64_t(x - 1));
}

// ATen multi_row_sum<nrows = 4>: units are `Lanes`-wide; unit u of row r starts at x2 + (4u + r) * Lanes.
template <int Lanes>
static void multi_row_sum(const float* x2, int64_t size, float out[4][Lanes]) {
  constexpr int kLevels = 4;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  float acc[kLevels][4][Lanes] = {};
  int64_t i = 0;
  for (; i + level_step <= size;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < Lanes; ++l) acc[0][k][l] += x2[(i * 4 + k) * Lanes + l];
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < 4; ++k)
        for (int l = 0; l < Lanes; ++l) {
          acc[j][k][l] += acc[j - 1][k][l];
          acc[j - 1][k][l] = 0.0f;
        }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < Lanes; ++l) acc[0][k][l] += x2[(i * 4 + k) * Lanes + l];
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < Lanes; ++l) acc[0][k][l] += acc[j][k][l];
  __builtin_memcpy(out, acc[0], sizeof(acc[0]));
}

// ATen row_sum (ilp 4) over `size` units of `Lanes` floats; result in out[0..Lanes).
template <int Lanes>
static void row_sum(const float* x2, int64_t size, float* out) {
  float p[4][Lanes];
  multi_row_sum<Lanes>(x2, size / 4, p);
  for (int64_t i = size / 4 * 4; i < size; ++i)
    for (int l = 0; l < Lanes; ++l) p[0][l] += x2[i * Lanes + l];
  for (int k = 1; k < 4; ++k)
    for (int l = 0; l < Lanes; ++l) p[0][l] += p[k][l];
  __builtin_memcpy(out, p[0], sizeof(float) * Lanes);
}

static float torch_sum(const float* x2, int64_t n) {
  float v[kSumLanes];
  if (n < kSumLanes) {  // scalar_inner_sum
    row_sum<1>(x2, n, v);
    return v[0];
  }
  const int64_t nv = n / kSumLanes;  // vectorized_inner_sum
  row_sum<kSumLanes>(x2, nv, v);
  float s = 0.0f;
  for (int64_t k = nv * kSumLanes; k < n; ++k) s += x2[k];
  for (int l = 0; l < kSumLanes; ++l) s += v[l];
  return s;
}

// A row's 1/sqrt(mean(h^2) + eps) as torch computes it, h = float(xr[i]) left in hf (h2: scratch), n floats each.
static float rms_inv(const uint16_t* xr, int64_t n, float eps, float* hf, float* h2) {
  for (int64_t i = 0; i < n; ++i) {
    hf[i] = ld(xr[i]);
    h2[i] = hf[i] * hf[i];
  }
  return 1.0f / std::sqrt(torch_sum(h2, n) / float(n) + eps);
}

// out[r] = bf16(w * bf16(h * 1/sqrt(mean(h^2) + eps))), h = float(x[r]), for rows [r0, r1) of [rows, n]
// (fk_rmsnorm_bf16); scratch: 2n floats. A row is read whole before it is written (out may alias x).
static void rmsnorm_rows(const uint16_t* x, const uint16_t* w, int64_t n, float eps, uint16_t* out, int64_t r0,
                         int64_t r1, float* scratch) {
  for (int64_t r = r0; r < r1; ++r) {
    const float inv = rms_inv(x + r * n, n, eps, scratch, scratch + n);
    for (int64_t i = 0; i < n; ++i) out[r * n + i] = st(ld(w[i]) * rnd(scratch[i] * inv));
  }
}

// out[r] = fp32(h * inv) * w in fp32 with w fp32 [n] (fk_rmsnorm_f32: torch's F.rms_norm of x.float() with an
// fp32 weight, fiddler.model.rms_norm_f32), rows [r0, r1); out fp32 [rows, n].
static void rmsnorm_rows_f32(const uint16_t* x, const float* w, int64_t n, float eps, float* out, int64_t r0,
                             int64_t r1, float* scratch) {
  for (int64_t r = r0; r < r1; ++r) {
    const float inv = rms_inv(x + r * n, n, eps, scratch, scratch + n);
    for (int64_t i = 0; i < n; ++i) out[r * n + i] = (scratch[i] * inv) * w[i];
  }
}
