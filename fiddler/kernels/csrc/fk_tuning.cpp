// Per-CPU knobs of the weight stream: the software prefetch hint and distance a vector path uses
// when it reads a weight block once from DRAM (1..12 tokens, the decode regime); and the blocking of
// many-token products, sized from this CPU's caches (below).
//
// The default comes from a per-vendor table backed by measurements (below); fiddler.kernels lets an
// environment variable (FIDDLER_KERNEL_STREAM) override it, and can measure the candidates on the
// running machine and keep the fastest (fiddler.kernels.tune_stream). The choice is reported by
// fiddler.kernels.features() and in benchmark records.
#include <atomic>
#include <mutex>
#include <cstring>
#include <string>

#include <unistd.h>

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "fk_internal.h"
#include "fk_quant.h"

namespace fk {

const char* const kHintNames[kNumHints] = {"none", "t0", "t1", "nta"};

namespace {

struct Default {
  const char* vendor;  // CPUID vendor string
  int hint;
  int64_t distance;
  int64_t far;
  const char* why;
};

// Measured with a packed Mixtral-8x7B expert (352 MB bf16) at 1 token, 2 threads, cycling through
// more weight copies than any cache holds (scripts/bench_stream.py):
// - Intel Xeon (Sapphire Rapids, 2-core VM; results/measured/2026-12-01-intel-xeon-stream): of the
//   read limit, T0 at 1 KiB plus a T1 (L2) prefetch 4 KiB ahead reached 0.93-0.95, T0 alone at
//   0.5-2 KiB 0.87-0.91, T0 at 4 KiB 0.70, no prefetch 0.67-0.78, NTA 0.35-0.50 (bench_stream*.txt);
//   at 4 tokens T0 2 KiB alone was slightly ahead (0.80 vs 0.77), but decode streams 1 token a step.
//   An Emerald Rapids VM: T0 30 GB/s, none 19, NTA 11-12 (issue 10).
// - AMD Zen 5 (EPYC, 2-core VM): NTA at 4 KiB was 2-3% faster than T0 at 8 KiB (decode A/B runs,
//   commit 882f944).
// Anything else gets T0, which was within a few percent of the best on both.
constexpr Default kTable[] = {
    {"GenuineIntel", kHintT0, 1024, 4096, "table: Intel (T0 1 KiB + L2 4 KiB; NTA streamed at half the rate)"},
    {"AuthenticAMD", kHintNta, 4096, 0, "table: AMD (NTA 4 KiB; 2-3% over T0 on Zen 5)"},
};
constexpr Default kFallback = {"", kHintT0, 2048, 0, "table: other CPUs (T0 2 KiB)"};

std::string cpu_vendor() {
#if defined(__x86_64__)
  unsigned a, b, c, d;
  if (__get_cpuid(0, &a, &b, &c, &d)) {
    char v[13];
    std::memcpy(v, &b, 4);
    std::memcpy(v + 4, &d, 4);
    std::memcpy(v + 8, &c, 4);
    v[12] = 0;
    return v;
  }
#endif
  return "";
}

// The entry of a per-vendor table for this CPU (each table's rows have a `vendor`), or the fallback.
template <class Row, size_t N>
const Row& vendor_row(const Row (&table)[N], const Row& fallback) {
  const std::string v = cpu_vendor();
  for (const Row& e : table)
    if (v == e.vendor) return e;
  return fallback;
}

const Default& table_default() {
  static const Default& d = vendor_row(kTable, kFallback);
  return d;
}

std::atomic<int> g_hint{-1};  // -1: the table's choice, set on first use
std::atomic<int64_t> g_distance{0};
std::atomic<int64_t> g_far{0};
std::mutex g_source_mu;
std::string g_source;

void ensure_default() {
  if (g_hint.load(std::memory_order_relaxed) >= 0) return;
  const Default& d = table_default();
  std::lock_guard<std::mutex> g(g_source_mu);
  if (g_hint.load() >= 0) return;
  g_source = d.why;
  g_distance.store(d.distance);
  g_far.store(d.far);
  g_hint.store(d.hint);
}

}  // namespace

StreamTuning stream_tuning() {
  if (g_hint.load(std::memory_order_relaxed) < 0) ensure_default();
  return {g_hint.load(std::memory_order_relaxed), g_distance.load(std::memory_order_relaxed),
          g_far.load(std::memory_order_relaxed)};
}

int set_stream_tuning(int hint, int64_t distance, int64_t far, const char* source) {
  if (hint < 0) {  // back to the table
    const Default& d = table_default();
    hint = d.hint;
    distance = d.distance;
    far = d.far;
    source = d.why;
  }
  if (hint >= kNumHints) return fail("unknown prefetch hint code " + std::to_string(hint));
  if (distance < 64 || distance > 65536 || distance % 64)
    return fail("prefetch distance must be a multiple of 64 bytes in [64, 65536], got " +
                std::to_string(distance));
  if (far < 0 || far > 65536 || far % 64)
    return fail("the far (L2) prefetch distance must be 0 or a multiple of 64 bytes up to 65536, got " +
                std::to_string(far));
  std::lock_guard<std::mutex> g(g_source_mu);
  g_source = source ? source : "set";
  g_distance.store(distance);
  g_far.store(far);
  g_hint.store(hint);
  return 0;
}

const char* stream_tuning_source() {
  ensure_default();
  std::lock_guard<std::mutex> g(g_source_mu);
  return g_source.c_str();  // stable until the next set_stream_tuning
}

// Tokens a pass of the AVX-512 VNNI a8 micro-kernel at 9-16 tokens a call (fk_quant_avx512.cpp): every
// pass setting gives the same bits (exact integer sums, the same fp32 steps per token), so this is a speed
// choice only, and the CPU's: one pass of 16 keeps the fp32 sums past 8 in memory (a load and a store per
// block and token) and halves the weight loads and broadcasts of a second pass. Measured one thread, 16
// tokens, Mixtral-8x7B-wide row groups (4096 columns), interleaved rounds, two runs:
// - Intel Xeon (family 6 model 207, 2-vCPU VM without AVX512-BF16, 2026-12-07): one pass 0.90x the time of
//   passes of 8 on Q8_0 in L2 (2.02 vs 2.25 ns a block and token), 0.93x on Q4_0; streamed from DRAM
//   0.93-0.96x for both (results/measured/2026-12-07-intel-xeon-noamx-issue54-quant-pass).
// - AMD EPYC Zen 4: one pass of 16 took 1.15-1.25x the time per block at 16 tokens in L2.
namespace {
struct QPassDefault {
  const char* vendor;
  int tokens;
  const char* why;
};
constexpr QPassDefault kQPassTable[] = {
    {"GenuineIntel", 16, "table: Intel (one pass of 16: 0.90-0.96x the time of two passes of 8)"},
};
constexpr QPassDefault kQPassFallback = {"", 8, "table: other CPUs (passes of 8: one of 16 took 1.15-1.25x on AMD Zen 4)"};

const QPassDefault& qpass_default() {
  static const QPassDefault& d = vendor_row(kQPassTable, kQPassFallback);
  return d;
}

std::atomic<int> g_qpass{0};  // 0: the table's choice, set on first use
std::mutex g_qpass_mu;
std::string g_qpass_source;

}  // namespace

int set_qpass(int tokens, const char* source) {
  if (tokens != 0 && tokens != 8 && tokens != 16)
    return fail("tokens a pass of the quantized kernel must be 8 or 16 (0: the per-CPU table), got " +
                std::to_string(tokens));
  if (tokens == 0) {
    tokens = qpass_default().tokens;
    source = qpass_default().why;
  }
  std::lock_guard<std::mutex> g(g_qpass_mu);
  g_qpass_source = source ? source : "set";
  g_qpass.store(tokens);
  return 0;
}

int qpass() {
  const int p = g_qpass.load(std::memory_order_relaxed);
  if (p != 0) return p;
  set_qpass(0, nullptr);
  return g_qpass.load();
}

const char* qpass_source() {
  qpass();
  std::lock_guard<std::mutex> g(g_qpass_mu);
  return g_qpass_source.c_str();
}

// Many-token blocking (fk_driver.cpp's many_token_region), from the caches of the CPU it runs on:
// - K chunk: the largest power of two (128..2048) whose piece of one 32-row block (32 x kc bf16)
//   fills at most 2/3 of L1d, so it stays there while every token group of the chunk uses it; on a path
//   whose micro-kernel takes two blocks a call (IsaOps::mk2: 4 weight loads per 24 dot products, a rate
//   L2 sustains) the pieces stay in L2 instead: the largest power of two (128..4096) whose two pieces
//   fill at most a quarter of L2 (the rest holds the next pieces and the rows). On an AMD EPYC (family 25
//   model 17, 1 MiB L2: 2048) one expert thread at 16-512 tokens ran 1.03-1.2x faster than with the
//   L1 rule's 256, the longer contiguous streams most at 16 tokens, and within 1% of 4096;
// - token chunk: the largest multiple of 32 (32..512) whose fp32 accumulators for a super-block of the
//   default size (8 x 2 groups x 32 rows) plus its rows' piece (kc bf16 each) fill at most 3/8 of L2,
//   leaving room for the next piece the calls pull in.
// - super-blocks (weight blocks a pool item walks K with): 8 unless set, per range of token counts
//   (set_super_blocks; the engine measures candidates on its own experts, fiddler.kernels.tune_blocking). Fewer blocks per item means
//   fewer weight streams at once per core and less reuse of each rows' piece: which wins is a property of
//   the machine (an Intel Xeon, family 6 model 167, read a Mixtral-8x7B expert at 64 tokens in 25.9 ms
//   with 8 and 19.2 ms with 2).
// Measured on an Intel Xeon (Emerald Rapids, 48 KiB L1d, 2 MiB L2): kc 512 and 256 rows, as derived.
Blocking derive_blocking(int64_t l1d, int64_t l2, int64_t super_blocks, bool two_blocks) {
  Blocking b{};
  b.l1d = l1d > 0 ? l1d : 32 << 10;
  b.l2 = l2 > 0 ? l2 : 1 << 20;
  b.super_blocks = super_blocks > 0 ? super_blocks : kDefaultSuperBlocks;
  b.k_chunk = 128;
  if (two_blocks)
    while (b.k_chunk < 4096 && 2 * (kBlockN * (2 * b.k_chunk) * 2) <= b.l2 / 4) b.k_chunk *= 2;
  else
    while (b.k_chunk < 2048 && kBlockN * (2 * b.k_chunk) * 2 <= b.l1d * 2 / 3) b.k_chunk *= 2;
  // sized for the default super-blocks whatever is set: with 2 super-blocks a 512-row chunk read a
  // Mixtral-8x7B expert at 512 tokens in 116 ms against 97 with 256 rows (Intel Xeon, family 6 model 167)
  const int64_t per_row = kDefaultSuperBlocks * 2 * kBlockN * 4 + b.k_chunk * 2;
  b.token_chunk = std::clamp<int64_t>(b.l2 * 3 / 8 / per_row / 32 * 32, 32, 512);
  return b;
}

namespace {
// The super-blocks by token count: entry i serves calls of up to g_sb_rows[i] rows (the last entry
// also serves more); no entries: the default. Set before the calls it serves (at load), read by them.
std::atomic<int> g_sb_n{0};
int64_t g_sb_rows[kMaxSuperBlockEntries], g_sb_value[kMaxSuperBlockEntries];
std::mutex g_sb_mu;

int64_t cache_size(int name) {
  const long v = sysconf(name);
  return v > 0 ? int64_t(v) : 0;
}
}  // namespace

Blocking blocking(int64_t rows, const IsaOps* ops) {
#if defined(_SC_LEVEL1_DCACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE)
  static const int64_t l1d = cache_size(_SC_LEVEL1_DCACHE_SIZE), l2 = cache_size(_SC_LEVEL2_CACHE_SIZE);
#else
  static const int64_t l1d = 0, l2 = 0;
#endif
  const int n = g_sb_n.load(std::memory_order_acquire);
  int64_t sb = 0;
  for (int i = 0; i < n; ++i) {
    sb = g_sb_value[i];
    if (rows <= g_sb_rows[i]) break;
  }
  if (!ops) ops = amx_mode() != kAmxOff ? nullptr : &vector_ops(current_isa());  // AMX tiles: one block a call
  return derive_blocking(l1d, l2, sb, ops && ops->mk2);
}

int set_super_blocks(const int64_t* rows, const int64_t* values, int n) {
  if (n < 0 || n > kMaxSuperBlockEntries || (n > 0 && (!rows || !values)))
    return fail("super-blocks: at most " + std::to_string(kMaxSuperBlockEntries) + " entries");
  for (int i = 0; i < n; ++i) {
    if (values[i] < 1 || values[i] > kMaxSuperBlocks)
      return fail("super-blocks must be 1.." + std::to_string(kMaxSuperBlocks) + ", got " + std::to_string(values[i]));
    if (rows[i] < 1 || (i > 0 && rows[i] <= rows[i - 1]))
      return fail("super-blocks: token counts must be positive and increasing");
  }
  std::lock_guard<std::mutex> g(g_sb_mu);
  g_sb_n.store(0, std::memory_order_release);
  for (int i = 0; i < n; ++i) {
    g_sb_rows[i] = rows[i];
    g_sb_value[i] = values[i];
  }
  g_sb_n.store(n, std::memory_order_release);
  return 0;
}

}  // namespace fk
