// Weight packing and the blocked drivers: the expert FFN, a decode step's MoE block and a plain
// linear layer. They cut the work into 32-row weight blocks, share the blocks over the thread pool
// and call the active ISA path's micro-kernel (IsaOps) for each block and token group.
#include <cstring>

#include <sys/mman.h>

#include "fk_internal.h"

namespace fk {
namespace {

template <class T>
T* scratch(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}
thread_local std::vector<float> t_acc;      // per thread: [groups][rows][kBlockN] fp32 accumulators
thread_local std::vector<uint16_t> t_x;     // per caller: padded copy of x
thread_local std::vector<uint16_t> t_h;     // per caller: expert hidden activations
thread_local std::vector<uint16_t> t_y;     // per caller: per-expert outputs (fk_moe_ffn)


struct Plan {
  const IsaOps* ops;
  bool amx;
  int64_t rows;  // token rows computed (T, or T rounded up to 16 for AMX)
};

Plan make_plan(int64_t tokens) {
  Plan p{&vector_ops(current_isa()), false, tokens};
  const int amx = amx_mode();
  if (amx != kAmxOff && tokens >= amx_min_tokens()) {
#if defined(__x86_64__)
    p.ops = amx == kAmxHw ? &kAmxOps : &kAmxEmuOps;
#else
    p.ops = &kAmxEmuOps;
#endif
    p.amx = true;
    p.rows = round_up(tokens, 16);
  }
  return p;
}

// x as the micro-kernels need it: K padded to Kp with zeros, rows padded for AMX. Copies only when
// needed (a Mixtral-shaped call uses the caller's tensor as is).
const uint16_t* prepare_x(const uint16_t* x, int64_t tokens, int64_t k, int64_t rows, int64_t kp,
                          int64_t* ldx) {
  if (k == kp && rows == tokens) {
    *ldx = k;
    return x;
  }
  uint16_t* buf = scratch(t_x, size_t(rows * kp));
  std::memset(buf, 0, size_t(rows * kp) * 2);
  for (int64_t t = 0; t < tokens; ++t) std::memcpy(buf + t * kp, x + t * k, size_t(k) * 2);
  *ldx = kp;
  return buf;
}

// acc[g][rows][kBlockN] = x[rows][:] . W_g^T for the `groups` interleaved matrices of one packed block
// (all its groups, from `blk`): the path for rows that one or a few micro-kernel calls cover.
void block_product(const Plan& p, const uint8_t* blk, int groups, int64_t k_pad, const uint16_t* x,
                   int64_t ldx, float* acc) {
  const int64_t bb = block_bytes(k_pad);
  const int mr = p.ops->mr;
  const int64_t n_groups_t = (p.rows + mr - 1) / mr;
  for (int g = 0; g < groups; ++g) {
    const uint8_t* bg = blk + g * bb;
    float* ag = acc + g * p.rows * kBlockN;
    for (int64_t k0 = 0; k0 < k_pad; k0 += kChunkK) {
      const int64_t kpairs = std::min(kChunkK, k_pad - k0) / 2;
      const char* wk = reinterpret_cast<const char*>(bg + k0 / 2 * kBlockN * 4);
      // With several token groups the chunk is reused from L2 and the work is compute-bound, so
      // each group also pulls its share of the next chunk (the following bytes of the stream) into
      // cache: DRAM time hides under compute. Token groups have near-equal sizes (AMX: 32/16 rows,
      // rows a multiple of 16).
      const int64_t chunk_lines = kpairs * kBlockN * 4 / 64;
      const int64_t pf_lines = n_groups_t > 1 ? (chunk_lines + n_groups_t - 1) / n_groups_t : 0;
      for (int64_t gi = 0, t0 = 0; t0 < p.rows; ++gi) {
        int64_t m;
        if (p.amx) m = std::min<int64_t>(32, p.rows - t0);
        else m = (p.rows - t0 + (n_groups_t - gi) - 1) / (n_groups_t - gi);
        p.ops->mk(reinterpret_cast<const uint16_t*>(wk), kpairs, x + t0 * ldx + k0, ldx, int(m),
                  ag + t0 * kBlockN, k0 > 0, wk + 64 * (chunk_lines + gi * pf_lines), pf_lines);
        t0 += m;
      }
    }
  }
}

// What a pooled product region computes for item i: `block`, one packed block with all its groups,
// times the rows `x` (row stride ldx).
struct Piece {
  const uint8_t* block;
  const uint16_t* x;
  int64_t ldx;
};

// One block's piece of a K chunk in many_token_region: its weights, the next piece it pulls into cache
// (null: none), its rows (from the chunk's first column) and its accumulators.
struct ChunkPiece {
  const uint16_t* w;
  const char* pf;
  const uint16_t* x;
  int64_t ldx;
  float* acc;
};
thread_local std::vector<ChunkPiece> t_pieces;

// Blocking for many token rows, GEMM-style, so that the weights still stream from DRAM once (up to
// kTokenChunk rows) while both operands are reused from cache instead of re-read from L3:
//  - a pool item is a super-block of `super_blocks` consecutive items (8: 256 weight rows);
//  - token rows go `token_chunk` at a time; their fp32 accumulators for the super-block stay in L2;
//  - K goes `k_chunk` columns at a time: one block's piece (32 x 512 bf16, 32 KiB, on a 48 KiB L1d)
//    stays in L1 while every token group uses it (where the path takes two blocks a call, IsaOps::mk2,
//    the two pieces stay in L2), and the rows' piece in L2 while every block does.
//  The sizes come from this CPU's caches and the super-blocks set for this many rows (blocking(), fk_tuning.cpp).
//  Along the way each piece's calls pull the piece this thread reads after it into L2 (the same
//  block's next K chunk, else the next token chunk's or the next super-block's first), so the DRAM
//  stream runs under the compute.
// The sum over K runs in the same order as block_product's (fp32 accumulators stored and reloaded
// exactly), so results are the same bits whichever blocking runs.
template <class Src, class Epi>
void many_token_region(const Plan& p, int groups, int64_t k_pad, int64_t n_items, int threads,
                       const Src& src, const Epi& epi) {
  const Blocking bk = blocking(p.rows, p.ops);
  const int64_t kSuperBlocks = bk.super_blocks, kTokenChunk = bk.token_chunk, kManyChunkK = bk.k_chunk;
  const int64_t bb = block_bytes(k_pad);
  const int mr = p.ops->mr;
  const int64_t mc_max = std::min<int64_t>(kTokenChunk, p.rows);
  const int64_t n_super = (n_items + kSuperBlocks - 1) / kSuperBlocks;
  pool().run(std::min<int64_t>(threads, n_super), n_super, 1, [&](int64_t s0, int64_t s1) {
    float* acc = scratch(t_acc, size_t(kSuperBlocks * groups * mc_max * kBlockN));
    std::vector<ChunkPiece>& pieces = t_pieces;
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t i0 = s * kSuperBlocks, i1 = std::min(n_items, i0 + kSuperBlocks);
      for (int64_t m0 = 0; m0 < p.rows; m0 += mc_max) {
        const int64_t mc = std::min(mc_max, p.rows - m0);
        for (int64_t k0 = 0; k0 < k_pad; k0 += kManyChunkK) {
          const int64_t kk = std::min(kManyChunkK, k_pad - k0);
          // the chunk this thread reads after this one: the next K chunk, else K chunk 0 of the
          // next token chunk (the same blocks) or of the next super-block in this thread's range
          int64_t nk0 = k0 + kManyChunkK, ni0 = i0;
          if (nk0 >= k_pad) {
            nk0 = 0;
            if (m0 + mc >= p.rows) ni0 = s + 1 < s1 ? i0 + kSuperBlocks : -1;
          }
          const int64_t next_lines = ni0 >= 0 && ni0 < n_items ? std::min(kManyChunkK, k_pad - nk0) : 0;
          // this K chunk's pieces (item-major, then group) and the next pieces they pull in
          pieces.clear();
          for (int64_t i = i0; i < i1; ++i) {
            const Piece pc = src(i);
            const int64_t ni = ni0 + (i - i0);
            const uint8_t* nblk = next_lines && ni < n_items ? src(ni).block : nullptr;
            for (int g = 0; g < groups; ++g)
              pieces.push_back({reinterpret_cast<const uint16_t*>(pc.block + g * bb + k0 / 2 * kBlockN * 4),
                                nblk ? reinterpret_cast<const char*>(nblk + g * bb + nk0 / 2 * kBlockN * 4) : nullptr,
                                pc.x + k0, pc.ldx, acc + ((i - i0) * groups + g) * mc * kBlockN});
          }
          // two pieces with the same rows (an item's groups; with one group, consecutive items' blocks)
          // go through mk2 together where the path has it; a piece left over through mk
          for (size_t j = 0; j < pieces.size();) {
            const ChunkPiece& a = pieces[j];
            const bool two = p.ops->mk2 && j + 1 < pieces.size() && pieces[j + 1].x == a.x;
            const int step = two ? p.ops->mr2 : mr;
            const int64_t n_calls = (mc + step - 1) / step;
            const int64_t pf_per_call = (next_lines + n_calls - 1) / n_calls;
            const char* pfa = a.pf;
            const char* pfb = two ? pieces[j + 1].pf : nullptr;
            int64_t left = pfa || pfb ? next_lines : 0;  // 64-byte lines of the next piece (kk_next lines)
            for (int64_t t0 = m0; t0 < m0 + mc; t0 += step) {
              const int m = int(std::min<int64_t>(step, m0 + mc - t0));
              const int64_t n = std::min(left, pf_per_call);
              const uint16_t* xt = a.x + t0 * a.ldx;
              if (two)
                p.ops->mk2(a.w, pieces[j + 1].w, kk / 2, xt, a.ldx, m, a.acc + (t0 - m0) * kBlockN,
                           pieces[j + 1].acc + (t0 - m0) * kBlockN, k0 > 0, pfa, pfb, n);
              else
                p.ops->mk(a.w, kk / 2, xt, a.ldx, m, a.acc + (t0 - m0) * kBlockN, k0 > 0, pfa, n);
              if (pfa) pfa += 64 * n;
              if (pfb) pfb += 64 * n;
              left -= n;
            }
            j += two ? 2 : 1;
          }
        }
        for (int64_t i = i0; i < i1; ++i) epi(i, acc + (i - i0) * groups * mc * kBlockN, m0, mc);
      }
    }
    if (p.ops->done) p.ops->done();
  });
}

// AMX rows up to this many take block_product's single pass (each block's K chunk streamed once and
// reused from L2 by every 32-row token group, accumulators kept in tiles along a chunk) rather than the
// GEMM-style blocking: on a Mixtral-8x7B expert streamed from DRAM (Intel Xeon family 6 model 207, 2
// threads, in-process against the build before, same bits) 1.11-1.16x at 33-64 tokens, 1.05x at 96 and
// even at 128, where the blocking's L1-sized pieces start to pay.
constexpr int64_t kAmxSinglePassRows = 96;

// One pooled region over n_items items (src(i): the item's Piece): acc[g][rows][32] of each item, then
// epi(i, acc, t0, m) for its token rows [t0, t0 + m) (acc row t - t0, group stride m x 32). Rows that
// one micro-kernel call covers (AMX: up to kAmxSinglePassRows) stream each block once (block_product);
// more rows are blocked.
template <class Src, class Epi>
void product_region(const Plan& p, int groups, int64_t k_pad, int64_t n_items, int threads, const Src& src,
                    const Epi& epi) {
  if (p.rows > (p.amx ? kAmxSinglePassRows : p.ops->mr)) {
    many_token_region(p, groups, k_pad, n_items, threads, src, epi);
    return;
  }
  pool().run(threads, n_items, 1, [&](int64_t b0, int64_t b1) {
    float* acc = scratch(t_acc, size_t(groups * p.rows * kBlockN));
    for (int64_t i = b0; i < b1; ++i) {
      const Piece pc = src(i);
      block_product(p, pc.block, groups, k_pad, pc.x, pc.ldx, acc);
      epi(i, acc, int64_t(0), p.rows);
    }
    if (p.ops->done) p.ops->done();
  });
}

}  // namespace

int64_t packed_bytes(int64_t n, int64_t k, int groups) {
  if (n <= 0 || k <= 0 || groups <= 0) return -1;
  return round_up(n, kBlockN) / kBlockN * groups * block_bytes(round_up(k, kAlignK));
}

// Best-effort: back a large buffer (before it is first written) with transparent huge pages,
// which removes most TLB misses from a weight stream of hundreds of MB.
void advise_hugepages(void* p, int64_t nbytes) {
#if defined(MADV_HUGEPAGE)
  const uintptr_t huge = 2u << 20, a = (reinterpret_cast<uintptr_t>(p) + huge - 1) & ~(huge - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + uintptr_t(nbytes)) & ~(huge - 1);
  if (e > a) madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);
#else
  (void)p;
  (void)nbytes;
#endif
}

// Packs `groups` row-major bf16 matrices ws[g][n][k] into dst (fk_packed_bytes bytes, 64-byte aligned).
int pack(const uint16_t* const* ws, int groups, int64_t n, int64_t k, void* dst, int threads) {
  const int64_t bytes = packed_bytes(n, k, groups);
  if (bytes < 0 || !dst || !ws) return fail("fk_pack: bad arguments");
  if (reinterpret_cast<uintptr_t>(dst) % 64) return fail("fk_pack: destination is not 64-byte aligned");
  const int64_t k_pad = round_up(k, kAlignK), n_blocks = round_up(n, kBlockN) / kBlockN;
  const int64_t bb = block_bytes(k_pad);
  const int nt = thread_count(threads, n_blocks, bytes, 1);
  pool().run(nt, n_blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int g = 0; g < groups; ++g) {
        uint16_t* blk = reinterpret_cast<uint16_t*>(static_cast<uint8_t*>(dst) + (nb * groups + g) * bb);
        std::memset(blk, 0, size_t(bb));
        for (int r = 0; r < kBlockN; ++r) {
          const int64_t row = nb * kBlockN + r;
          if (row >= n) break;
          const uint16_t* src = ws[g] + row * k;
          uint16_t* d = blk + 2 * r;
          int64_t c = 0;
          for (; c + 1 < k; c += 2, d += 2 * kBlockN) std::memcpy(d, src + c, 4);  // one column pair
          if (c < k) *d = src[c];
        }
      }
  });
  return 0;
}

// y[tokens][hidden] = W2 (silu(W1 x) * (W3 x)); p13 packs {W1, W3} (groups = 2, [ffn][hidden]),
// p2 packs W2 ([hidden][ffn]). Inputs/outputs bf16, fp32 accumulation, h rounded to bf16 once.
int expert_ffn(const void* p13, const void* p2, int64_t hidden, int64_t ffn,
                         const uint16_t* x, int64_t tokens, uint16_t* y, int threads) {
  if (!p13 || !p2 || !x || !y || hidden <= 0 || ffn <= 0 || tokens <= 0)
    return fail("expert_ffn: bad arguments");
  const Plan p = make_plan(tokens);
  const int64_t kp_h = round_up(hidden, kAlignK), kp_f = round_up(ffn, kAlignK);
  const int64_t nb_f = round_up(ffn, kBlockN) / kBlockN, nb_h = round_up(hidden, kBlockN) / kBlockN;
  const int64_t ldh = nb_f * kBlockN;  // >= kp_f; padded columns come out as silu(0) * 0 = 0
  int64_t ldx;
  const uint16_t* xp = prepare_x(x, tokens, hidden, p.rows, kp_h, &ldx);
  uint16_t* h = scratch(t_h, size_t(p.rows * ldh));
  const auto* w13 = static_cast<const uint8_t*>(p13);
  const auto* w2 = static_cast<const uint8_t*>(p2);

  const int64_t bb_h = block_bytes(kp_h), bb_f = block_bytes(kp_f);
  product_region(p, 2, kp_h, nb_f, thread_count(threads, nb_f, 2 * nb_f * bb_h, tokens),
                 [&](int64_t nb) { return Piece{w13 + nb * 2 * bb_h, xp, ldx}; },
                 [&](int64_t nb, const float* acc, int64_t t0, int64_t m) {
                   for (int64_t t = 0; t < m; ++t)
                     p.ops->silu_mul(acc + t * kBlockN, acc + (m + t) * kBlockN, kBlockN,
                                     h + (t0 + t) * ldh + nb * kBlockN);
                 });
  product_region(p, 1, kp_f, nb_h, thread_count(threads, nb_h, nb_h * bb_f, tokens),
                 [&](int64_t nb) { return Piece{w2 + nb * bb_f, h, ldh}; },
                 [&](int64_t nb, const float* acc, int64_t t0, int64_t m) {
                   const int64_t n = std::min<int64_t>(kBlockN, hidden - nb * kBlockN);
                   for (int64_t t = t0; t < std::min(tokens, t0 + m); ++t)
                     p.ops->store(acc + (t - t0) * kBlockN, nullptr, n, y + t * hidden + nb * kBlockN, false);
                 });
  return 0;
}

// The MoE block of one decode step on the CPU: y = sum_e bf16(bf16(FFN_e(x)) * w_e) over n_experts
// experts that all see the same rows x[tokens][hidden] (fp32 sum, rounded to bf16 once) -- the
// roundings of the executor's torch combine (slots = y * w; slots.sum(1)), so results are unchanged.
// One call instead of one per expert: the gate/up pass of every expert is one pooled region and
// the down pass of every expert another, so a layer has 2 barriers instead of 2 per expert and no
// Python between experts. p13[e], p2[e]: packed weights as for fk_expert_ffn; w: bf16 [n_experts].
int moe_ffn(const void* const* p13, const void* const* p2, const uint16_t* w, int n_experts,
                      int64_t hidden, int64_t ffn, const uint16_t* x, int64_t tokens, uint16_t* y,
                      int threads) {
  if (!p13 || !p2 || !w || !x || !y || n_experts <= 0 || hidden <= 0 || ffn <= 0 || tokens <= 0)
    return fail("moe_ffn: bad arguments");
  for (int e = 0; e < n_experts; ++e)
    if (!p13[e] || !p2[e]) return fail("moe_ffn: null expert weights");
  const Plan p = make_plan(tokens);
  const int64_t kp_h = round_up(hidden, kAlignK), kp_f = round_up(ffn, kAlignK);
  const int64_t nb_f = round_up(ffn, kBlockN) / kBlockN, nb_h = round_up(hidden, kBlockN) / kBlockN;
  const int64_t ldh = nb_f * kBlockN, h_stride = p.rows * ldh;
  int64_t ldx;
  const uint16_t* xp = prepare_x(x, tokens, hidden, p.rows, kp_h, &ldx);
  uint16_t* h = scratch(t_h, size_t(n_experts * h_stride));
  const int64_t items1 = n_experts * nb_f, bb_h = block_bytes(kp_h), bb_f = block_bytes(kp_f);
  product_region(p, 2, kp_h, items1, thread_count(threads, items1, 2 * items1 * bb_h, tokens),
                 [&](int64_t i) {
                   return Piece{static_cast<const uint8_t*>(p13[i / nb_f]) + i % nb_f * 2 * bb_h, xp, ldx};
                 },
                 [&](int64_t i, const float* acc, int64_t t0, int64_t m) {
                   const int64_t e = i / nb_f, nb = i % nb_f;
                   uint16_t* he = h + e * h_stride;
                   for (int64_t t = 0; t < m; ++t)
                     p.ops->silu_mul(acc + t * kBlockN, acc + (m + t) * kBlockN, kBlockN,
                                     he + (t0 + t) * ldh + nb * kBlockN);
                 });
  // Down passes: items are (expert, block) in expert-major order, so each thread streams contiguous
  // weight ranges and the last item of the region is one 32-row block of one expert (a short tail).
  // Each expert's output is rounded to bf16 as it is stored; the weighted sum follows the region.
  uint16_t* ye = scratch(t_y, size_t(n_experts * tokens * hidden));
  const int64_t items2 = n_experts * nb_h;
  product_region(p, 1, kp_f, items2, thread_count(threads, items2, items2 * bb_f, tokens),
                 [&](int64_t i) {
                   const int64_t e = i / nb_h;
                   return Piece{static_cast<const uint8_t*>(p2[e]) + i % nb_h * bb_f, h + e * h_stride, ldh};
                 },
                 [&](int64_t i, const float* acc, int64_t t0, int64_t m) {
                   const int64_t e = i / nb_h, nb = i % nb_h;
                   const int64_t n = std::min<int64_t>(kBlockN, hidden - nb * kBlockN);
                   for (int64_t t = t0; t < std::min(tokens, t0 + m); ++t)
                     p.ops->store(acc + (t - t0) * kBlockN, nullptr, n, ye + (e * tokens + t) * hidden + nb * kBlockN,
                                  false);
                 });
  combine_experts(ye, w, n_experts, tokens * hidden, y);
  return 0;
}

void combine_experts(const uint16_t* ye, const uint16_t* w, int n_experts, int64_t count, uint16_t* y) {
  if (n_experts == 1 && w[0] == 0x3f80) {  // one expert at weight 1.0: the products and the sum are exact
    std::memcpy(y, ye, size_t(count) * 2);
    return;
  }
  for (int64_t i = 0; i < count; ++i) {
    float sum = 0.0f;
    for (int e = 0; e < n_experts; ++e)
      sum += bf16_to_f32(f32_to_bf16(bf16_to_f32(ye[e * count + i]) * bf16_to_f32(w[e])));
    y[i] = f32_to_bf16(sum);
  }
}

// y[tokens][n] = x[tokens][k] . W^T (+ bias), W packed with groups = 1; y bf16 or fp32.
int linear(const void* packed, int64_t n, int64_t k, const uint16_t* x, int64_t tokens,
                     const float* bias, void* y, bool out_f32, int threads) {
  if (!packed || !x || !y || n <= 0 || k <= 0 || tokens <= 0) return fail("linear: bad arguments");
  const Plan p = make_plan(tokens);
  const int64_t kp = round_up(k, kAlignK), n_blocks = round_up(n, kBlockN) / kBlockN;
  const size_t es = out_f32 ? 4 : 2;
  int64_t ldx;
  const uint16_t* xp = prepare_x(x, tokens, k, p.rows, kp, &ldx);
  const int64_t bb = block_bytes(kp);
  const auto* w = static_cast<const uint8_t*>(packed);
  product_region(p, 1, kp, n_blocks, thread_count(threads, n_blocks, n_blocks * bb, tokens),
                 [&](int64_t nb) { return Piece{w + nb * bb, xp, ldx}; },
                 [&](int64_t nb, const float* acc, int64_t t0, int64_t m) {
                   const int64_t nv = std::min<int64_t>(kBlockN, n - nb * kBlockN);
                   for (int64_t t = t0; t < std::min(tokens, t0 + m); ++t)
                     p.ops->store(acc + (t - t0) * kBlockN, bias ? bias + nb * kBlockN : nullptr, nv,
                                  static_cast<char*>(y) + (t * n + nb * kBlockN) * es, out_f32);
                 });
  return 0;
}

}  // namespace fk
