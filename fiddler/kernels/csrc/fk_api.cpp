// C entry points of the Fiddler CPU kernel library (called through ctypes, which releases the GIL):
// CPU feature detection and run-time ISA choice, a small thread pool, weight packing, and the
// blocked drivers for the expert FFN and for a plain linear layer. Compiled for the baseline ISA;
// the ISA-specific inner loops live in fk_<isa>.cpp and are reached only through IsaOps.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <pthread.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "fk.h"

#define FK_API extern "C" __attribute__((visibility("default")))

namespace fk {
namespace {

thread_local std::string g_error;
int fail(const std::string& msg) {
  g_error = msg;
  return -1;
}

// ---------------------------------------------------------------- CPU features
enum Feature {
  kAvx2, kFma, kAvx512f, kAvx512bw, kAvx512vl, kAvx512dq, kAvx512bf16, kAmxTile, kAmxBf16,
  kOsAvx, kOsAvx512, kOsAmx, kNumFeatures
};
const char* const kFeatureNames[kNumFeatures] = {
    "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile",
    "amx_bf16", "os_avx", "os_avx512", "os_amx"};

struct Cpu {
  bool has[kNumFeatures] = {};
  bool avx2() const { return has[kAvx2] && has[kFma] && has[kOsAvx]; }
  bool avx512_bf16() const {
    return has[kAvx512f] && has[kAvx512bw] && has[kAvx512vl] && has[kAvx512dq] &&
           has[kAvx512bf16] && has[kOsAvx512];
  }
  bool amx() const { return avx512_bf16() && has[kAmxTile] && has[kAmxBf16] && has[kOsAmx]; }
};

Cpu detect_cpu() {
  Cpu c;
#if defined(__x86_64__)
  unsigned a, b, cx, d;
  if (!__get_cpuid_count(1, 0, &a, &b, &cx, &d)) return c;
  c.has[kFma] = cx & (1u << 12);
  const bool osxsave = cx & (1u << 27);
  uint64_t xcr0 = 0;
  if (osxsave) {
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (uint64_t(hi) << 32) | lo;
  }
  c.has[kOsAvx] = (xcr0 & 0x6) == 0x6;            // SSE + AVX state saved by the OS
  c.has[kOsAvx512] = (xcr0 & 0xe6) == 0xe6;       // + opmask, ZMM_Hi256, Hi16_ZMM
  c.has[kOsAmx] = (xcr0 & 0x60000) == 0x60000;    // XTILECFG + XTILEDATA
  if (__get_cpuid_count(7, 0, &a, &b, &cx, &d)) {
    c.has[kAvx2] = b & (1u << 5);
    c.has[kAvx512f] = b & (1u << 16);
    c.has[kAvx512dq] = b & (1u << 17);
    c.has[kAvx512bw] = b & (1u << 30);
    c.has[kAvx512vl] = b & (1u << 31);
    c.has[kAmxBf16] = d & (1u << 22);
    c.has[kAmxTile] = d & (1u << 24);
    const unsigned max_sub = a;
    if (max_sub >= 1 && __get_cpuid_count(7, 1, &a, &b, &cx, &d)) c.has[kAvx512bf16] = a & (1u << 5);
  }
#endif
  return c;
}

const Cpu& cpu() {
  static const Cpu c = detect_cpu();
  return c;
}

// Linux refuses AMX tile data (SIGILL on first use) until the process asks for it.
bool request_amx_permission() {
#if defined(__x86_64__) && defined(__linux__)
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// ---------------------------------------------------------------- configuration
enum Isa { kIsaGeneric = 0, kIsaAvx2 = 1, kIsaAvx512 = 2 };
enum AmxMode { kAmxOff = 0, kAmxHw = 1, kAmxEmulated = 2 };

std::atomic<int> g_isa{-1};            // -1: not configured yet (auto on first use)
std::atomic<int> g_amx{kAmxOff};
constexpr int kDefaultAmxMinTokens = 16;  // below this the vector path is memory-bound anyway
std::atomic<int> g_amx_min_tokens{kDefaultAmxMinTokens};
std::atomic<int> g_threads{0};         // 0: all CPUs this process may run on

int best_isa() {
#if defined(__x86_64__)
  if (cpu().avx512_bf16()) return kIsaAvx512;
  if (cpu().avx2()) return kIsaAvx2;
#endif
  return kIsaGeneric;
}

const IsaOps& vector_ops(int isa) {
#if defined(__x86_64__)
  if (isa == kIsaAvx512) return kAvx512Ops;
  if (isa == kIsaAvx2) return kAvx2Ops;
#endif
  return kGenericOps;
}

// AMX self-check, run once before the tile path is first enabled: the tile micro-kernel and the
// AVX512-BF16 one compute the same 32 x 64 block from values whose products and sums are exact in
// fp32 (multiples of 1/16 in [-1/2, 1/2], 64 terms), so they must agree bit for bit. A CPU/OS/compiler
// combination on which they do not is reported by fk_amx_status() and AMX stays off.
std::string g_amx_status = "not checked";
bool amx_selfcheck() {
#if defined(__x86_64__)
  static const bool ok = [] {
    constexpr int64_t kK = 64, kPairs = kK / 2, kM = 32;
    alignas(64) static uint16_t w[kPairs * kBlockN * 2], x[kM * kK];
    alignas(64) static float a[kM * kBlockN], b[kM * kBlockN];
    uint32_t r = 12345;
    auto next = [&r] {
      r = r * 1103515245u + 12345u;
      return f32_to_bf16(float(int((r >> 16) % 17) - 8) / 16.0f);
    };
    for (auto& v : w) v = next();
    for (auto& v : x) v = next();
    for (int64_t t0 = 0; t0 < kM; t0 += kAvx512Ops.mr) {
      const int m = int(std::min<int64_t>(kAvx512Ops.mr, kM - t0));
      kAvx512Ops.mk(w, kPairs, x + t0 * kK, kK, m, a + t0 * kBlockN, false, nullptr, 0);
    }
    kAmxOps.mk(w, kPairs, x, kK, int(kM), b, false, nullptr, 0);
    if (std::memcmp(a, b, sizeof a) != 0) {
      g_amx_status = "disabled: the AMX self-check disagreed with the AVX512-BF16 path";
      return false;
    }
    g_amx_status = "ok";
    return true;
  }();
  return ok;
#else
  return false;
#endif
}

int configure(int isa, int amx, int amx_min_tokens) {
  if (isa < 0) isa = best_isa();
  if (isa > kIsaAvx512) return fail("unknown ISA code " + std::to_string(isa));
  if (isa == kIsaAvx512 && !(isa <= best_isa()))
    return fail("this CPU (or OS) does not support AVX512-BF16 (needs avx512f/bw/vl/dq/bf16)");
  if (isa == kIsaAvx2 && best_isa() < kIsaAvx2) return fail("this CPU (or OS) does not support AVX2+FMA");
  if (amx < 0)
    amx = (isa == kIsaAvx512 && cpu().amx() && request_amx_permission() && amx_selfcheck()) ? kAmxHw
                                                                                           : kAmxOff;
  if (amx == kAmxHw) {
    if (isa != kIsaAvx512) return fail("AMX needs the avx512_bf16 path");
    if (!cpu().amx()) return fail("this CPU (or OS) does not support AMX-BF16");
    if (!request_amx_permission())
      return fail("the kernel refused AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM failed)");
    if (!amx_selfcheck()) return fail("AMX " + g_amx_status);
  }
  if (amx < kAmxOff || amx > kAmxEmulated) return fail("unknown AMX mode " + std::to_string(amx));
  g_isa = isa;
  g_amx = amx;
  g_amx_min_tokens = amx_min_tokens > 0 ? amx_min_tokens : kDefaultAmxMinTokens;
  return 0;
}

int current_isa() {
  if (g_isa.load() < 0) configure(-1, -1, 0);
  return g_isa.load();
}

int available_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// ---------------------------------------------------------------- thread pool
// Persistent workers plus the calling thread share a job's items (weight blocks) dynamically:
// each participant repeatedly claims the next contiguous range (guided sizes: large first, small at
// the end), so a worker that the OS has not scheduled yet delays nothing -- the others take its
// share. Workers spin a short while after a job (back-to-back kernel calls are common in decode),
// yielding the core to other runnable threads now and then, and then sleep on a condition variable.
//
// Joining protocol: `state_` packs (generation << 32) | closed bit | active count. A worker joins a
// job only by a CAS from "this generation, open" to active + 1; the caller closes the job when all
// items are claimed and then waits for active == 0, so no worker can touch a job (whose closure lives
// on the caller's stack) after run() returned. One pooled region at a time; a second concurrent caller
// does not wait for the first: it runs its call on its own thread.
class Pool {
 public:
  // fn(begin, end) is called for disjoint ranges covering [0, items); up to `threads` threads.
  template <class F>
  void run(int threads, int64_t items, int64_t grain, const F& fn) {
    if (items <= 0) return;
    std::unique_lock<std::mutex> call(call_mu_, std::defer_lock);
    if (threads <= 1 || items == 1 || !call.try_lock()) {
      fn(int64_t(0), items);
      return;
    }
    grow(threads - 1);
    Job& j = job_;
    j.call = [](const void* f, int64_t b, int64_t e) { (*static_cast<const F*>(f))(b, e); };
    j.arg = &fn;
    j.items = items;
    j.grain = std::max<int64_t>(1, grain);
    j.threads = threads;
    j.next.store(0, std::memory_order_relaxed);
    const uint64_t gen = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    state_.store(gen << 32, std::memory_order_seq_cst);  // open, nobody joined
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> g(mu_);
      cv_.notify_all();
    }
    work(j);
    state_.fetch_or(kClosed, std::memory_order_acq_rel);
    for (int spin = 0; (state_.load(std::memory_order_acquire) & kActiveMask) != 0; ++spin) {
      if (spin < 4096) cpu_relax();
      else std::this_thread::yield();
    }
  }

 private:
  static constexpr uint64_t kClosed = uint64_t(1) << 31;
  static constexpr uint64_t kActiveMask = kClosed - 1;

  struct Job {
    void (*call)(const void*, int64_t, int64_t) = nullptr;
    const void* arg = nullptr;
    int64_t items = 0, grain = 1;
    int threads = 1;
    std::atomic<int64_t> next{0};
  };

  static void cpu_relax() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  static void work(Job& j) {
    int64_t cur = j.next.load(std::memory_order_relaxed);
    for (;;) {
      if (cur >= j.items) return;
      const int64_t rest = j.items - cur;
      const int64_t n = std::min(rest, std::max(j.grain, rest / (2 * int64_t(j.threads))));
      if (j.next.compare_exchange_weak(cur, cur + n, std::memory_order_relaxed)) {
        j.call(j.arg, cur, cur + n);
        cur = j.next.load(std::memory_order_relaxed);
      }
    }
  }

  void grow(int workers) {
    while (int(threads_.size()) < workers) threads_.emplace_back([this] { loop(); });
  }

  // try to become a participant of generation `gen`
  bool join(uint64_t gen) {
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      if ((s >> 32) != gen || (s & kClosed) || int64_t(s & kActiveMask) + 1 >= job_.threads) return false;
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) return true;
    }
  }

  void loop() {
    uint64_t seen = state_.load(std::memory_order_acquire) >> 32;
    for (;;) {
      // spin for g_spin_us, yielding to other runnable threads every few microseconds
      auto changed = [&] { return (state_.load(std::memory_order_acquire) >> 32) != seen; };
      if (!changed()) {
        const auto t0 = std::chrono::steady_clock::now();
        const auto spin = std::chrono::microseconds(spin_us());
        for (int i = 1; !changed(); ++i) {
          cpu_relax();
          if ((i & 255) == 0) {
            const auto dt = std::chrono::steady_clock::now() - t0;
            if (dt > spin) break;
            if ((i & 4095) == 0) sched_yield();
          }
        }
      }
      if (!changed()) {
        std::unique_lock<std::mutex> lk(mu_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lk, changed);
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      seen = state_.load(std::memory_order_acquire) >> 32;
      if (join(seen)) {
        work(job_);
        state_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  static int spin_us() {
    static const int us = [] {
      const char* e = getenv("FIDDLER_KERNEL_SPIN_US");
      return e ? std::max(0, atoi(e)) : 100;
    }();
    return us;
  }

  std::mutex call_mu_, mu_;
  std::condition_variable cv_;
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> state_{0};
  std::atomic<int> sleepers_{0};
  Job job_;
};

// Never destroyed: workers block forever, so there is no join at exit. A forked child has none of
// the parent's workers, and the parent's mutexes and condition variable may have been caught in
// use (a sleeping worker makes notify_all wait for it forever), so the child starts a fresh pool
// and leaks the old one.
Pool* g_pool = nullptr;
Pool& pool() {
  static const bool once = [] {
    g_pool = new Pool;
    pthread_atfork(nullptr, nullptr, [] { g_pool = new Pool; });
    return true;
  }();
  (void)once;
  return *g_pool;
}

// Threads for a region over `blocks` weight blocks of `weight_bytes` in total, for `tokens` tokens.
int thread_count(int requested, int64_t blocks, int64_t weight_bytes, int64_t tokens) {
  int n = requested > 0 ? requested : (g_threads.load() > 0 ? g_threads.load() : available_cpus());
  // below ~64 KiB of weights per thread (~8 tokens' worth of work per byte counted once per 8
  // tokens) the wake-up costs more than the split saves
  const int64_t work = weight_bytes * std::max<int64_t>(1, tokens / 8);
  n = int(std::min<int64_t>({int64_t(n), blocks, std::max<int64_t>(1, work >> 16)}));
  return std::max(1, n);
}

// ---------------------------------------------------------------- scratch buffers
template <class T>
T* scratch(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}
thread_local std::vector<float> t_acc;      // per thread: [groups][rows][kBlockN] fp32 accumulators
thread_local std::vector<uint16_t> t_x;     // per caller: padded copy of x
thread_local std::vector<uint16_t> t_h;     // per caller: expert hidden activations
thread_local std::vector<uint16_t> t_y;     // per caller: per-expert outputs (fk_moe_ffn)

// ---------------------------------------------------------------- blocked driver
struct Plan {
  const IsaOps* ops;
  bool amx;
  int64_t rows;  // token rows computed (T, or T rounded up to 16 for AMX)
};

Plan make_plan(int64_t tokens) {
  Plan p{&vector_ops(current_isa()), false, tokens};
  const int amx = g_amx.load();
  if (amx != kAmxOff && tokens >= g_amx_min_tokens.load()) {
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

// acc[g][rows][kBlockN] = x[rows][:] . W_g[block nb]^T for each of the `groups` interleaved matrices.
void block_product(const Plan& p, const uint8_t* packed, int groups, int64_t k_pad, int64_t nb,
                   const uint16_t* x, int64_t ldx, float* acc) {
  const int64_t bb = block_bytes(k_pad);
  const int mr = p.ops->mr;
  const int64_t n_groups_t = (p.rows + mr - 1) / mr;
  for (int g = 0; g < groups; ++g) {
    const uint8_t* blk = packed + (nb * groups + g) * bb;
    float* ag = acc + g * p.rows * kBlockN;
    for (int64_t k0 = 0; k0 < k_pad; k0 += kChunkK) {
      const int64_t kpairs = std::min(kChunkK, k_pad - k0) / 2;
      const char* wk = reinterpret_cast<const char*>(blk + k0 / 2 * kBlockN * 4);
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

template <class Epilogue>
void run_blocks(const Plan& p, const uint8_t* packed, int groups, int64_t n_blocks,
                int64_t k_pad, const uint16_t* x, int64_t ldx, int threads,
                const Epilogue& epi) {
  pool().run(threads, n_blocks, 1, [&](int64_t b0, int64_t b1) {
    float* acc = scratch(t_acc, size_t(groups * p.rows * kBlockN));
    for (int64_t nb = b0; nb < b1; ++nb) {
      block_product(p, packed, groups, k_pad, nb, x, ldx, acc);
      epi(nb, acc);
    }
  });
}

}  // namespace

void parallel_for(int threads, int64_t items, void (*fn)(const void*, int64_t, int64_t), const void* ctx) {
  const int n = threads > 0 ? threads : (g_threads.load() > 0 ? g_threads.load() : available_cpus());
  pool().run(int(std::min<int64_t>(n, items)), items, 1, [&](int64_t b, int64_t e) { fn(ctx, b, e); });
}

}  // namespace fk

using namespace fk;

// ---------------------------------------------------------------- C API
FK_API const char* fk_last_error() { return g_error.c_str(); }

FK_API int fk_configure(int isa, int amx, int amx_min_tokens) { return configure(isa, amx, amx_min_tokens); }
FK_API int fk_isa() { return current_isa(); }
FK_API int fk_amx_mode() {
  current_isa();
  return g_amx.load();
}
FK_API int fk_amx_min_tokens() { return g_amx_min_tokens.load(); }
// "ok", "not checked" (no AMX, or never requested) or why the AMX path was disabled.
FK_API const char* fk_amx_status() {
  current_isa();
  return g_amx_status.c_str();
}

// Feature i (0 <= i < fk_num_features()): name and whether this CPU/OS has it.
FK_API int fk_num_features() { return kNumFeatures; }
FK_API const char* fk_feature_name(int i) { return i >= 0 && i < kNumFeatures ? kFeatureNames[i] : ""; }
FK_API int fk_feature(int i) { return i >= 0 && i < kNumFeatures ? cpu().has[i] : 0; }
FK_API int fk_best_isa() { return best_isa(); }
FK_API int fk_amx_supported() { return cpu().amx(); }
FK_API int fk_compiled_x86() {
#if defined(__x86_64__)
  return 1;
#else
  return 0;
#endif
}

FK_API void fk_set_num_threads(int n) { g_threads = n > 0 ? n : 0; }
FK_API int fk_get_num_threads() { return g_threads.load() > 0 ? g_threads.load() : available_cpus(); }

FK_API int64_t fk_packed_bytes(int64_t n, int64_t k, int groups) {
  if (n <= 0 || k <= 0 || groups <= 0) return -1;
  return round_up(n, kBlockN) / kBlockN * groups * block_bytes(round_up(k, kAlignK));
}

// Best-effort: back a large buffer (before it is first written) with transparent huge pages,
// which removes most TLB misses from a weight stream of hundreds of MB.
FK_API void fk_advise_hugepages(void* p, int64_t nbytes) {
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
FK_API int fk_pack(const uint16_t* const* ws, int groups, int64_t n, int64_t k, void* dst, int threads) {
  const int64_t bytes = fk_packed_bytes(n, k, groups);
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
FK_API int fk_expert_ffn(const void* p13, const void* p2, int64_t hidden, int64_t ffn,
                         const uint16_t* x, int64_t tokens, uint16_t* y, int threads) {
  if (!p13 || !p2 || !x || !y || hidden <= 0 || ffn <= 0 || tokens <= 0)
    return fail("fk_expert_ffn: bad arguments");
  const Plan p = make_plan(tokens);
  const int64_t kp_h = round_up(hidden, kAlignK), kp_f = round_up(ffn, kAlignK);
  const int64_t nb_f = round_up(ffn, kBlockN) / kBlockN, nb_h = round_up(hidden, kBlockN) / kBlockN;
  const int64_t ldh = nb_f * kBlockN;  // >= kp_f; padded columns come out as silu(0) * 0 = 0
  int64_t ldx;
  const uint16_t* xp = prepare_x(x, tokens, hidden, p.rows, kp_h, &ldx);
  uint16_t* h = scratch(t_h, size_t(p.rows * ldh));
  const auto* w13 = static_cast<const uint8_t*>(p13);
  const auto* w2 = static_cast<const uint8_t*>(p2);

  run_blocks(p, w13, 2, nb_f, kp_h, xp, ldx, thread_count(threads, nb_f, 2 * nb_f * block_bytes(kp_h), tokens),
             [&](int64_t nb, const float* acc) {
               const float* a1 = acc;
               const float* a3 = acc + p.rows * kBlockN;
               for (int64_t t = 0; t < p.rows; ++t)
                 p.ops->silu_mul(a1 + t * kBlockN, a3 + t * kBlockN, kBlockN, h + t * ldh + nb * kBlockN);
             });
  run_blocks(p, w2, 1, nb_h, kp_f, h, ldh, thread_count(threads, nb_h, nb_h * block_bytes(kp_f), tokens),
             [&](int64_t nb, const float* acc) {
               const int64_t n = std::min<int64_t>(kBlockN, hidden - nb * kBlockN);
               for (int64_t t = 0; t < tokens; ++t)
                 p.ops->store(acc + t * kBlockN, nullptr, n, y + t * hidden + nb * kBlockN, false);
             });
  return 0;
}

// The MoE block of one decode step on the CPU: y = sum_e bf16(bf16(FFN_e(x)) * w_e) over n_experts
// experts that all see the same rows x[tokens][hidden] (fp32 sum, rounded to bf16 once) -- the
// roundings of the executor's torch combine (slots = y * w; slots.sum(1)), so results are unchanged.
// One call instead of one per expert: the gate/up pass of every expert is one pooled region and
// the down pass of every expert another, so a layer has 2 barriers instead of 2 per expert and no
// Python between experts. p13[e], p2[e]: packed weights as for fk_expert_ffn; w: bf16 [n_experts].
FK_API int fk_moe_ffn(const void* const* p13, const void* const* p2, const uint16_t* w, int n_experts,
                      int64_t hidden, int64_t ffn, const uint16_t* x, int64_t tokens, uint16_t* y,
                      int threads) {
  if (!p13 || !p2 || !w || !x || !y || n_experts <= 0 || hidden <= 0 || ffn <= 0 || tokens <= 0)
    return fail("fk_moe_ffn: bad arguments");
  for (int e = 0; e < n_experts; ++e)
    if (!p13[e] || !p2[e]) return fail("fk_moe_ffn: null expert weights");
  const Plan p = make_plan(tokens);
  const int64_t kp_h = round_up(hidden, kAlignK), kp_f = round_up(ffn, kAlignK);
  const int64_t nb_f = round_up(ffn, kBlockN) / kBlockN, nb_h = round_up(hidden, kBlockN) / kBlockN;
  const int64_t ldh = nb_f * kBlockN, h_stride = p.rows * ldh;
  int64_t ldx;
  const uint16_t* xp = prepare_x(x, tokens, hidden, p.rows, kp_h, &ldx);
  uint16_t* h = scratch(t_h, size_t(n_experts * h_stride));
  const int64_t items1 = n_experts * nb_f;
  pool().run(thread_count(threads, items1, 2 * items1 * block_bytes(kp_h), tokens), items1, 1,
             [&](int64_t i0, int64_t i1) {
               float* acc = scratch(t_acc, size_t(2 * p.rows * kBlockN));
               for (int64_t i = i0; i < i1; ++i) {
                 const int64_t e = i / nb_f, nb = i % nb_f;
                 block_product(p, static_cast<const uint8_t*>(p13[e]), 2, kp_h, nb, xp, ldx, acc);
                 uint16_t* he = h + e * h_stride;
                 for (int64_t t = 0; t < p.rows; ++t)
                   p.ops->silu_mul(acc + t * kBlockN, acc + (p.rows + t) * kBlockN, kBlockN,
                                   he + t * ldh + nb * kBlockN);
               }
             });
  // Down passes: items are (expert, block) in expert-major order, so each thread streams contiguous
  // weight ranges and the last item of the region is one 32-row block of one expert (a short tail).
  // Each expert's output is rounded to bf16 as it is stored; the weighted sum follows the region.
  uint16_t* ye = scratch(t_y, size_t(n_experts * tokens * hidden));
  const int64_t items2 = n_experts * nb_h;
  pool().run(thread_count(threads, items2, items2 * block_bytes(kp_f), tokens), items2, 1,
             [&](int64_t i0, int64_t i1) {
               float* acc = scratch(t_acc, size_t(p.rows * kBlockN));
               for (int64_t i = i0; i < i1; ++i) {
                 const int64_t e = i / nb_h, nb = i % nb_h;
                 block_product(p, static_cast<const uint8_t*>(p2[e]), 1, kp_f, nb, h + e * h_stride, ldh, acc);
                 const int64_t n = std::min<int64_t>(kBlockN, hidden - nb * kBlockN);
                 for (int64_t t = 0; t < tokens; ++t)
                   p.ops->store(acc + t * kBlockN, nullptr, n, ye + (e * tokens + t) * hidden + nb * kBlockN, false);
               }
             });
  for (int64_t i = 0; i < tokens * hidden; ++i) {
    float sum = 0.0f;
    for (int e = 0; e < n_experts; ++e)
      sum += bf16_to_f32(f32_to_bf16(bf16_to_f32(ye[e * tokens * hidden + i]) * bf16_to_f32(w[e])));
    y[i] = f32_to_bf16(sum);
  }
  return 0;
}

// y[tokens][n] = x[tokens][k] . W^T (+ bias), W packed with groups = 1; y bf16 or fp32.
FK_API int fk_linear(const void* packed, int64_t n, int64_t k, const uint16_t* x, int64_t tokens,
                     const float* bias, void* y, int out_f32, int threads) {
  if (!packed || !x || !y || n <= 0 || k <= 0 || tokens <= 0) return fail("fk_linear: bad arguments");
  const Plan p = make_plan(tokens);
  const int64_t kp = round_up(k, kAlignK), n_blocks = round_up(n, kBlockN) / kBlockN;
  const size_t es = out_f32 ? 4 : 2;
  int64_t ldx;
  const uint16_t* xp = prepare_x(x, tokens, k, p.rows, kp, &ldx);
  run_blocks(p, static_cast<const uint8_t*>(packed), 1, n_blocks, kp, xp, ldx,
             thread_count(threads, n_blocks, n_blocks * block_bytes(kp), tokens),
             [&](int64_t nb, const float* acc) {
               const int64_t nv = std::min<int64_t>(kBlockN, n - nb * kBlockN);
               for (int64_t t = 0; t < tokens; ++t)
                 p.ops->store(acc + t * kBlockN, bias ? bias + nb * kBlockN : nullptr, nv,
                              static_cast<char*>(y) + (t * n + nb * kBlockN) * es, out_f32 != 0);
             });
  return 0;
}

// Multithreaded streaming read of an nbytes buffer (larger than the LLC) with the widest loads this
// CPU has; returns the best of `repeats` in GB/s, or a negative value on error.
FK_API double fk_bandwidth_probe(int64_t nbytes, int threads, int repeats) {
  const int n = threads > 0 ? threads : fk_get_num_threads();
  const int64_t slice = round_up(std::max<int64_t>(nbytes, 1 << 20) / n, 16 * 4096);
  void* buf = nullptr;
  if (posix_memalign(&buf, 2u << 20, size_t(slice * n)) != 0) return fail("probe: out of memory");
  fk_advise_hugepages(buf, slice * n);
  std::memset(buf, 1, size_t(slice * n));
  const IsaOps& ops = vector_ops(best_isa());
  std::atomic<uint64_t> sink{0};
  double best = 0;
  for (int r = 0; r < std::max(1, repeats); ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    // 16 pieces per thread, claimed dynamically (a piece is a multiple of 4 KiB)
    pool().run(n, int64_t(n) * 16, 1, [&](int64_t b, int64_t e) {
      sink.fetch_xor(ops.read(static_cast<char*>(buf) + b * (slice / 16), (e - b) * (slice / 16)),
                     std::memory_order_relaxed);
    });
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, double(slice * n) / dt / 1e9);
  }
  free(buf);
  return best + 0.0 * double(sink.load() & 1);
}
