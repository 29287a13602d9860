// CPU feature detection (CPUID/XGETBV), the run-time choice of ISA path and AMX, and the default
// thread count. Compiled for the baseline ISA.
#include <cstring>

#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "fk_internal.h"

namespace fk {

namespace {
thread_local std::string g_error;
}  // namespace

int fail(const std::string& msg) {
  g_error = msg;
  return -1;
}
const char* last_error() { return g_error.c_str(); }

const char* const kFeatureNames[kNumFeatures] = {
    "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "amx_tile",
    "amx_bf16", "os_avx", "os_avx512", "os_amx", "avx", "f16c", "bmi2", "avx512_vbmi", "avx512_vnni", "amx_int8"};

Cpu detect_cpu() {
  Cpu c;
#if defined(__x86_64__)
  unsigned a, b, cx, d;
  if (!__get_cpuid_count(1, 0, &a, &b, &cx, &d)) return c;
  c.has[kFma] = cx & (1u << 12);
  c.has[kAvx] = cx & (1u << 28);
  c.has[kF16c] = cx & (1u << 29);
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
    c.has[kBmi2] = b & (1u << 8);
    c.has[kAvx512vbmi] = cx & (1u << 1);
    c.has[kAvx512vnni] = cx & (1u << 11);
    c.has[kAvx512f] = b & (1u << 16);
    c.has[kAvx512dq] = b & (1u << 17);
    c.has[kAvx512bw] = b & (1u << 30);
    c.has[kAvx512vl] = b & (1u << 31);
    c.has[kAmxBf16] = d & (1u << 22);
    c.has[kAmxTile] = d & (1u << 24);
    c.has[kAmxInt8] = d & (1u << 25);
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

int available_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

// ---------------------------------------------------------------- configuration
namespace {
std::atomic<int> g_isa{-1};            // -1: not configured yet (auto on first use)
std::atomic<int> g_amx{kAmxOff};
// Below this many tokens the vector path, from it AMX tiles (rows padded to 16). AMX's time is flat up
// to 16 rows (memory-bound); the vector path turns compute-bound at about 1.2 x its GFLOP/s / the read
// GB/s tokens. Since AMX prefetches each step's own lines into L1 (fk_amx_impl.h), tune_amx on a
// Mixtral-8x7B expert (Intel Xeon, family 6 model 167, 2 vCPUs, 3 runs) read AMX 0.88-0.92x the vector
// path's speed at 2 tokens, 1.01-1.05x at 3 and 1.08-1.11x at 4 (it was 8 before: AMX lost at 4-6).
// Measured per machine by fiddler.kernels.tune_amx (the engine runs it on its own experts); this default
// only serves callers that do not.
constexpr int kDefaultAmxMinTokens = 4;
std::atomic<int> g_amx_min_tokens{kDefaultAmxMinTokens};
std::atomic<int> g_threads{0};         // 0: all CPUs this process may run on
std::string g_amx_status = "not checked";
}  // namespace

int best_isa() {
#if defined(__x86_64__)
  if (cpu().avx512_bf16()) return kIsaAvx512Bf16;
  if (cpu().avx512() && cpu().avx2()) return kIsaAvx512F;
  if (cpu().avx2()) return kIsaAvx2;
#endif
  return kIsaGeneric;
}

const IsaOps& vector_ops(int isa) {
#if defined(__x86_64__)
  if (isa == kIsaAvx512Bf16) return kAvx512Ops;
  if (isa == kIsaAvx512F) return kAvx512FOps;
  if (isa == kIsaAvx2) return kAvx2Ops;
#endif
  return kGenericOps;
}

// AMX self-check, run once before the tile path is first enabled: the tile micro-kernel and the
// AVX512-BF16 one compute the same 32 x 64 block from values whose products and sums are exact in
// fp32 (multiples of 1/16 in [-1/2, 1/2], 64 terms), so they must agree bit for bit. A CPU/OS/compiler
// combination on which they do not is reported by fk_amx_status() and AMX stays off.
namespace {
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
    kAmxOps.done();
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
}  // namespace

int configure(int isa, int amx, int amx_min_tokens) {
  if (isa < 0) isa = best_isa();
  if (isa > kIsaAvx512Bf16) return fail("unknown ISA code " + std::to_string(isa));
  if (isa == kIsaAvx512Bf16 && !(isa <= best_isa()))
    return fail("this CPU (or OS) does not support AVX512-BF16 (needs avx512f/bw/vl/dq/bf16)");
  if (isa == kIsaAvx512F && best_isa() < kIsaAvx512F)
    return fail("this CPU (or OS) does not support AVX-512 (needs avx512f/bw/vl/dq)");
  if (isa == kIsaAvx2 && best_isa() < kIsaAvx2) return fail("this CPU (or OS) does not support AVX2+FMA");
  if (amx < 0)
    amx = (isa == kIsaAvx512Bf16 && cpu().amx() && request_amx_permission() && amx_selfcheck()) ? kAmxHw
                                                                                           : kAmxOff;
  if (amx == kAmxHw) {
    if (isa != kIsaAvx512Bf16) return fail("AMX needs the avx512_bf16 path");
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

int amx_mode() {
  current_isa();
  return g_amx.load();
}
int amx_min_tokens() { return g_amx_min_tokens.load(); }
const std::string& amx_status() {
  current_isa();
  return g_amx_status;
}
void set_default_threads(int n) { g_threads = n > 0 ? n : 0; }
int default_threads() { return g_threads.load() > 0 ? g_threads.load() : available_cpus(); }

}  // namespace fk
