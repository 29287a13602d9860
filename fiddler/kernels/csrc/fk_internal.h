// Internal declarations shared by the library's parts (not part of the C API):
//   fk_cpu.cpp     CPU feature detection, the run-time choice of ISA path and AMX, thread defaults
//   fk_tuning.cpp  per-CPU knobs of the weight stream (prefetch hint and distance)
//   fk_pool.cpp    the persistent thread pool (class below) and parallel_for
//   fk_driver.cpp  packing and the blocked drivers (expert FFN, MoE step, linear)
//   fk_probe.cpp   the memory-read bandwidth probe (independent of the kernel's tuning)
//   fk_api.cpp     the C entry points (ctypes)
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <sched.h>

#include "fk.h"

namespace fk {

// Records msg as the calling thread's last error (fk_last_error) and returns -1.
int fail(const std::string& msg);
const char* last_error();

// ---------------------------------------------------------------- CPU features (fk_cpu.cpp)
enum Feature {
  kAvx2, kFma, kAvx512f, kAvx512bw, kAvx512vl, kAvx512dq, kAvx512bf16, kAmxTile, kAmxBf16,
  kOsAvx, kOsAvx512, kOsAmx,
  // not used by the kernel; reported so that other builds (llama.cpp's flags) can be chosen from them
  kAvx, kF16c, kBmi2, kAvx512vbmi, kAvx512vnni, kAmxInt8, kNumFeatures
};
extern const char* const kFeatureNames[kNumFeatures];

struct Cpu {
  bool has[kNumFeatures] = {};
  bool avx2() const { return has[kAvx2] && has[kFma] && has[kOsAvx]; }
  bool avx512() const { return has[kAvx512f] && has[kAvx512bw] && has[kAvx512vl] && has[kAvx512dq] && has[kOsAvx512]; }
  bool avx512_bf16() const { return avx512() && has[kAvx512bf16]; }
  bool amx() const { return avx512_bf16() && has[kAmxTile] && has[kAmxBf16] && has[kOsAmx]; }
};

const Cpu& cpu();
bool request_amx_permission();  // Linux: ask for AMX tile data once per process
int available_cpus();            // CPUs this process may run on

// ---------------------------------------------------------------- configuration (fk_cpu.cpp)
// Vector paths, ordered: each needs what the one below it needs. avx512: AVX-512 F/BW/VL/DQ without BF16
// (Skylake-SP to Ice Lake Xeons, VMs that hide BF16); the quantized kernel's VNNI path has its code.
enum Isa { kIsaGeneric = 0, kIsaAvx2 = 1, kIsaAvx512F = 2, kIsaAvx512Bf16 = 3 };
enum AmxMode { kAmxOff = 0, kAmxHw = 1, kAmxEmulated = 2 };

int best_isa();
const IsaOps& vector_ops(int isa);
int configure(int isa, int amx, int amx_min_tokens);  // -1: auto; 0 or an error (fail)
int current_isa();                                     // configures with auto on first use
int amx_mode();
int amx_min_tokens();
const std::string& amx_status();
void set_default_threads(int n);  // <= 0: all available CPUs
int default_threads();

// ---------------------------------------------------------------- stream tuning (fk_tuning.cpp)
// Sets the weight stream's knobs (hint: StreamHint, distance: bytes, a multiple of 64 in
// [64, 65536]; far: the L2 prefetch's distance, 0 or a multiple of 64 up to 65536); `source` says
// where the choice came from. 0 or an error (fail).
int set_stream_tuning(int hint, int64_t distance, int64_t far, const char* source);
const char* stream_tuning_source();

// Blocking of many-token products: K chunk (columns), token chunk (rows), weight blocks per pool
// item, and the cache sizes (bytes) they were derived from (0 read as unknown: 32 KiB / 1 MiB).
struct Blocking {
  int64_t k_chunk, token_chunk, super_blocks, l1d, l2;
};
constexpr int64_t kDefaultSuperBlocks = 8, kMaxSuperBlocks = 64;
constexpr int kMaxSuperBlockEntries = 8;
// super_blocks 0: the default; two_blocks: for a path whose micro-kernel takes two blocks a call (IsaOps::mk2)
Blocking derive_blocking(int64_t l1d, int64_t l2, int64_t super_blocks = 0, bool two_blocks = false);
// this CPU's caches, with the super-blocks set for calls of `rows` token rows, for the path `ops` (null: the
// one a many-token call takes now)
Blocking blocking(int64_t rows = INT64_MAX, const IsaOps* ops = nullptr);
// n entries: calls of up to rows[i] rows (increasing; the last also serves more) use values[i] super-blocks
// (1..kMaxSuperBlocks); n = 0: the default for all. 0 or an error (fail)
int set_super_blocks(const int64_t* rows, const int64_t* values, int n);

// ---------------------------------------------------------------- thread pool (fk_pool.cpp)
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

  void loop();  // a worker: spin a while after a job, then sleep until the next

  static int spin_us();

  std::mutex call_mu_, mu_;
  std::condition_variable cv_;
  std::vector<std::thread> threads_;
  std::atomic<uint64_t> state_{0};
  std::atomic<int> sleepers_{0};
  Job job_;
};

Pool& pool();
// Threads for a region over `blocks` weight blocks of `weight_bytes` in total, for `tokens` tokens.
int thread_count(int requested, int64_t blocks, int64_t weight_bytes, int64_t tokens);

// ---------------------------------------------------------------- drivers (fk_driver.cpp)
int64_t packed_bytes(int64_t n, int64_t k, int groups);  // -1 for bad arguments
void advise_hugepages(void* p, int64_t nbytes);
int pack(const uint16_t* const* ws, int groups, int64_t n, int64_t k, void* dst, int threads);
int expert_ffn(const void* p13, const void* p2, int64_t hidden, int64_t ffn, const uint16_t* x,
               int64_t tokens, uint16_t* y, int threads);
int moe_ffn(const void* const* p13, const void* const* p2, const uint16_t* w, int n_experts,
            int64_t hidden, int64_t ffn, const uint16_t* x, int64_t tokens, uint16_t* y, int threads);
int linear(const void* packed, int64_t n, int64_t k, const uint16_t* x, int64_t tokens,
           const float* bias, void* y, bool out_f32, int threads);
// y[i] = bf16(sum_e bf16(ye[e][i] * w[e])) over `count` values per expert: the MoE combine as torch's
// `(y * w).sum(dim)` rounds it (both moe_ffn drivers, bf16 and quantized)
void combine_experts(const uint16_t* ye, const uint16_t* w, int n_experts, int64_t count, uint16_t* y);


// ---------------------------------------------------------------- probe (fk_probe.cpp)
double read_bandwidth(const void* buf, int64_t nbytes, int threads, int hint, int64_t dist, int repeats);

// ---------------------------------------------------------------- ISA compute peak (fk_isa_peak.cpp)
double isa_peak(const char* kind, int threads, double ops, int repeats);

}  // namespace fk
