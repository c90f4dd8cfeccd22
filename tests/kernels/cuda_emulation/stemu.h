// stemu: run Speedtronic's CUDA kernel headers (csrc/kernels/*.cuh) on the CPU, for tests.
//
// One fiber per CUDA thread; the blocks of a launch run one after another on the calling OS
// thread. Fibers switch only at barriers and warp collectives, so a kernel's behaviour is
// deterministic for a given schedule. Three schedules reorder threads (and blocks) to expose
// missing barriers: forward, reverse and random (seeded, reshuffled every round).
//
// Covered: __syncthreads (with divergent-site detection), __syncwarp, __shfl{,_up,_down,_xor}_sync,
// __ballot/__any/__all_sync, atomics, static __shared__ and dynamic shared memory (poisoned with
// 0xFF bytes per block and followed by a guard page), mma.sync.m16n8k16 (f16/bf16 -> f32)
// rebuilt from the PTX ISA fragment tables, __half/__nv_bfloat16 conversions (round to nearest
// even), and the Hopper instructions of csrc/kernels/hopper.cuh (mbarrier, cp.async.bulk.tensor,
// wgmma; see the "Hopper" section). Every misuse that hardware would answer with a hang or an undefined value raises
// stemu::Error (surfacing as a Python RuntimeError in the tests): deadlock, divergent barrier,
// exit while others wait at a barrier, a warp collective whose lanes are at different call
// sites, a shuffle that reads an exited lane, mma with a partial warp.
//
// Not covered (see csrc/README.md): performance, the memory model across blocks, cp.async
// (the pre-Hopper async copy), proxy fences.
// This file is test-only and is compiled into one translation unit (tests/cuda_emulation/binding.cpp).
#pragma once
#define STEMU_ACTIVE 1

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
using uint3 = dim3;
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) float4 { float x, y, z, w; };

// ---------------------------------------------------------------- half types
struct __half { uint16_t x; };
struct __nv_bfloat16 { uint16_t x; };

inline float __half2float(__half h) {
  _Float16 f;
  std::memcpy(&f, &h.x, 2);
  return static_cast<float>(f);
}
inline __half __float2half_rn(float v) {
  _Float16 f = static_cast<_Float16>(v);  // IEEE round-to-nearest-even
  __half h;
  std::memcpy(&h.x, &f, 2);
  return h;
}
inline __half __float2half(float v) { return __float2half_rn(v); }
inline float __bfloat162float(__nv_bfloat16 b) {
  uint32_t u = static_cast<uint32_t>(b.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  __nv_bfloat16 b;
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it a quiet NaN
    b.x = static_cast<uint16_t>((u >> 16) | 0x40u);
    return b;
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  b.x = static_cast<uint16_t>(u >> 16);
  return b;
}
inline __nv_bfloat16 __float2bfloat16(float v) { return __float2bfloat16_rn(v); }

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }

namespace stemu {

enum class Schedule { Forward = 0, Reverse = 1, Random = 2 };

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Settings {
  Schedule schedule = Schedule::Forward;
  uint64_t seed = 0;
  size_t stack_bytes = 256 * 1024;
  long launches = 0;        // statistics, read by tests
  long blocks = 0;
  long collectives = 0;
};
inline Settings& settings() {
  static Settings s;
  return s;
}

// ---------------------------------------------------------------- context switch
// x86-64 SysV: save callee-saved registers, mxcsr and the x87 control word on the old stack,
// swap stack pointers. About 20x cheaper than swapcontext (no signal-mask syscalls).
struct Ctx { void* sp = nullptr; };
}  // namespace stemu

#if defined(__x86_64__)
extern "C" void stemu_switch(stemu::Ctx* from, stemu::Ctx* to);
extern "C" void stemu_trampoline();
__asm__(
    ".text\n"
    ".weak stemu_switch\n"
    ".type stemu_switch,@function\n"
    "stemu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  subq $8, %rsp\n  stmxcsr (%rsp)\n  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n"
    "  movq (%rsi), %rsp\n"
    "  ldmxcsr (%rsp)\n  fldcw 4(%rsp)\n  addq $8, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n"
    "  ret\n"
    ".size stemu_switch, .-stemu_switch\n"
    ".weak stemu_trampoline\n"
    ".type stemu_trampoline,@function\n"
    "stemu_trampoline:\n"
    "  movq %r12, %rdi\n"
    "  callq *%r13\n"
    "  ud2\n"
    ".size stemu_trampoline, .-stemu_trampoline\n");
#else
#error "stemu: only x86-64 is supported (add a context switch for this architecture)"
#endif

namespace stemu {

enum class Wait : uint8_t { Run, Block, Warp, Mbar, Done };

// Hopper state (see the "Hopper" section below for the semantics).
struct WgmmaOp {
  uint64_t desc_a = 0, desc_b = 0;
  int n = 0;              // N of m64nNk16
  bool scale_d = true;    // false: D = A*B, the old accumulator is ignored
  bool bf16 = false;
  float* d = nullptr;     // the issuing thread's accumulator registers (n / 2 floats)
  bool chained = false;   // reads the result of an older pending op on the same registers
  std::vector<float> d_in;
};
struct Mbar {
  uint32_t expected = 0, pending = 0;  // arrival counts
  int64_t tx = 0;                      // pending transaction bytes (may go below zero)
  uint64_t phase = 0;                  // completed phases
};

struct Thread {
  Ctx ctx;
  dim3 tid;
  int linear = 0, warp = 0, lane = 0;
  Wait wait = Wait::Run;
  unsigned long wait_gen = 0;
  uint32_t wait_addr = 0;  // the mbarrier a Wait::Mbar thread waits on
  char* stack = nullptr;  // lowest usable address (a guard page lies below it)
  // wgmma: ops not yet committed, committed groups (oldest first), fence state, issue count
  std::vector<WgmmaOp> wg_open;
  std::vector<std::vector<WgmmaOp>> wg_groups;
  bool wg_fenced = false;
  long wg_issued = 0;
};

struct Site {
  const char* file = nullptr;
  int line = 0;
  bool operator!=(const Site& o) const { return line != o.line || std::strcmp(file, o.file) != 0; }
};
inline std::string where(const Site& s) {
  const char* base = std::strrchr(s.file, '/');
  return std::string(base ? base + 1 : s.file) + ":" + std::to_string(s.line);
}

struct Warp {
  int size = 0;
  uint32_t live = 0;     // lanes that have not exited
  uint32_t arrived = 0;  // lanes waiting at the current collective
  unsigned long gen = 0;
  Site site;
  const char* kind = "";
  uint32_t members[2] = {0, 0};                // lanes that took part, per buffer
  alignas(16) unsigned char slot[2][32][64];  // double-buffered by generation parity
};

// What a finished warp collective hands each lane: every lane's deposit and who took part.
struct Exchange {
  unsigned char (*slots)[64];
  uint32_t members;
};

struct Block {
  dim3 bdim, gdim, bidx;
  int n = 0, live = 0, arrived = 0;
  unsigned long gen = 0;
  Site site;
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  unsigned char* dyn = nullptr;
  size_t dyn_bytes = 0;
  std::function<void()> body;
  std::string error;
  // Hopper: mbarriers by shared-window address, bulk tensor copies in flight, and per warpgroup
  // the wgmma issues not yet matched by all 128 threads (base index, records).
  std::map<uint32_t, Mbar> mbars;
  std::vector<std::function<void()>> copies_land;  // in issue order
  std::vector<uint32_t> copies_bar;
  struct WgRec { uint64_t a, b; int n; bool scale_d; int seen; };
  std::vector<std::pair<long, std::vector<WgRec>>> wglog;
};

inline Block* g_block = nullptr;
inline Thread* g_thread = nullptr;
inline Ctx g_sched;

[[noreturn]] inline void raise_in_fiber(const std::string& msg) {
  Block& b = *g_block;
  if (b.error.empty()) {
    b.error = msg + " (block " + std::to_string(b.bidx.x) + "," + std::to_string(b.bidx.y) + "," +
              std::to_string(b.bidx.z) + ", thread " + std::to_string(g_thread->linear) + ")";
  }
  g_thread->wait = Wait::Done;
  stemu_switch(&g_thread->ctx, &g_sched);
  __builtin_unreachable();
}

inline void yield_to_scheduler() { stemu_switch(&g_thread->ctx, &g_sched); }

// ---------------------------------------------------------------- memory
inline size_t page() { return static_cast<size_t>(sysconf(_SC_PAGESIZE)); }

// A region of `bytes` whose end touches a PROT_NONE page, so overruns fault at once.
struct Guarded {
  void* base = nullptr;
  size_t total = 0;
  unsigned char* user = nullptr;
  void make(size_t bytes, bool guard_below) {
    size_t pg = page();
    size_t body = (bytes + pg - 1) / pg * pg;
    total = body + 2 * pg;
    base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) throw Error("stemu: mmap failed");
    mprotect(base, pg, PROT_NONE);
    mprotect(static_cast<char*>(base) + pg + body, pg, PROT_NONE);
    unsigned char* end = static_cast<unsigned char*>(base) + pg + body;
    user = guard_below ? static_cast<unsigned char*>(base) + pg : end - ((bytes + 15) / 16 * 16);
  }
  void release() {
    if (base) munmap(base, total);
    base = nullptr;
  }
};

struct Pool {
  std::vector<Guarded> stacks;
  Guarded dyn;
  size_t dyn_cap = 0;
  ~Pool() {
    for (auto& s : stacks) s.release();
    dyn.release();
  }
  char* stack(size_t i) {
    while (stacks.size() <= i) {
      stacks.emplace_back();
      stacks.back().make(settings().stack_bytes, /*guard_below=*/true);
    }
    return reinterpret_cast<char*>(stacks[i].user);
  }
  unsigned char* dyn_smem(size_t bytes) {
    if (bytes != dyn_cap) {
      dyn.release();
      dyn.make(bytes ? bytes : 16, false);
      dyn_cap = bytes;
    }
    return dyn.user;
  }
};
inline Pool& pool() {
  static Pool p;
  return p;
}

inline unsigned char* dynamic_smem() { return g_block->dyn; }

// ---------------------------------------------------------------- fibers
inline void fiber_main(Thread* t) {
  g_block->body();
  // Thread exit: drop out of the block and warp barriers, as exited threads do on hardware.
  Block& b = *g_block;
  Warp& w = b.warps[t->warp];
  if ((!t->wg_open.empty() || !t->wg_groups.empty()) && b.error.empty()) {
    b.error = "thread " + std::to_string(t->linear) + " exited with wgmma.mma_async in flight (no wgmma.wait_group)";
  }
  w.live &= ~(1u << t->lane);
  --b.live;
  if (b.arrived > 0 && b.error.empty()) {
    b.error = "thread " + std::to_string(t->linear) + " exited while " + std::to_string(b.arrived) +
              " threads wait at __syncthreads (" + where(b.site) + ")";
  }
  if (w.arrived != 0 && w.arrived == w.live) {  // the exit completes a warp collective
    w.members[w.gen & 1u] = w.arrived;
    w.arrived = 0;
    ++w.gen;
  }
  t->wait = Wait::Done;
  stemu_switch(&t->ctx, &g_sched);
  __builtin_unreachable();
}

inline void init_fiber(Thread& t, char* stack_lo) {
  char* top = stack_lo + settings().stack_bytes;
  top = reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(top) & ~uintptr_t(15));
  auto* slot = reinterpret_cast<uint64_t*>(top);
  slot[-1] = reinterpret_cast<uint64_t>(&stemu_trampoline);  // "return address"
  slot[-2] = 0;                                              // rbp
  slot[-3] = 0;                                              // rbx
  slot[-4] = reinterpret_cast<uint64_t>(&t);                 // r12 -> rdi
  slot[-5] = reinterpret_cast<uint64_t>(&fiber_main);        // r13 -> call target
  slot[-6] = 0;                                              // r14
  slot[-7] = 0;                                              // r15
  uint32_t csr[2];
  __asm__ volatile("stmxcsr %0" : "=m"(csr[0]));
  __asm__ volatile("fnstcw %0" : "=m"(csr[1]));
  std::memcpy(&slot[-8], csr, 8);
  t.ctx.sp = &slot[-8];
}

inline std::mt19937_64& rng() {
  static std::mt19937_64 r;
  return r;
}

inline void order_for(std::vector<int>& order, int n) {
  order.resize(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  switch (settings().schedule) {
    case Schedule::Forward: break;
    case Schedule::Reverse: std::reverse(order.begin(), order.end()); break;
    case Schedule::Random: std::shuffle(order.begin(), order.end(), rng()); break;
  }
}

inline std::string deadlock_report(const Block& b) {
  std::map<std::string, int> sites;
  for (const Thread& t : b.threads) {
    if (t.wait == Wait::Block) sites["__syncthreads at " + where(b.site)]++;
    if (t.wait == Wait::Warp) {
      const Warp& w = b.warps[t.warp];
      sites[std::string(w.kind) + " at " + where(w.site)]++;
    }
    if (t.wait == Wait::Mbar) sites["mbarrier.try_wait on shared address " + std::to_string(t.wait_addr)]++;
  }
  std::string msg = "stemu: deadlock:";
  for (auto& [k, v] : sites) msg += " " + std::to_string(v) + " threads wait in " + k + ";";
  return msg;
}

inline void run_block(Block& b) {
  std::vector<int> order;
  for (int i = 0; i < b.n; ++i) init_fiber(b.threads[i], pool().stack(i));
  int done = 0;
  while (done < b.n) {
    bool progressed = false;
    order_for(order, b.n);
    for (int idx : order) {
      Thread& t = b.threads[idx];
      if (t.wait == Wait::Done) continue;
      if (t.wait == Wait::Block && b.gen == t.wait_gen) continue;
      if (t.wait == Wait::Warp && b.warps[t.warp].gen == t.wait_gen) continue;
      if (t.wait == Wait::Mbar && b.mbars[t.wait_addr].phase == t.wait_gen) continue;
      t.wait = Wait::Run;
      g_thread = &t;
      stemu_switch(&g_sched, &t.ctx);
      g_thread = nullptr;
      progressed = true;
      if (!b.error.empty()) throw Error("stemu: " + b.error);
      if (t.wait == Wait::Done) ++done;
    }
    if (!progressed && !b.copies_land.empty()) {
      // Everyone waits, and copies are still in flight: the copy engine finishes them now.
      auto lands = std::move(b.copies_land);
      b.copies_land.clear();
      b.copies_bar.clear();
      for (auto& land : lands) land();
      if (!b.error.empty()) throw Error("stemu: " + b.error);
      continue;
    }
    if (!progressed) throw Error(deadlock_report(b));
  }
}

// ---------------------------------------------------------------- launch
template <class... P>
struct Launch {
  dim3 grid, block;
  size_t smem;
  void (*kernel)(P...);
  Launch(dim3 g, dim3 b, size_t s, void (*k)(P...)) : grid(g), block(b), smem(s), kernel(k) {}

  template <class... A>
  void operator()(A&&... args) const {
    std::tuple<P...> params(std::forward<A>(args)...);  // by-value kernel parameters, as in CUDA
    const int n = static_cast<int>(block.x * block.y * block.z);
    if (n <= 0 || n > 1024) throw Error("stemu: invalid block size " + std::to_string(n));
    if (grid.x == 0 || grid.y == 0 || grid.z == 0) throw Error("stemu: empty grid");
    if (grid.y > 65535 || grid.z > 65535) throw Error("stemu: grid.y/z above 65535");
    if (smem > 227 * 1024) throw Error("stemu: dynamic shared memory above 227 KiB");
    Settings& st = settings();
    ++st.launches;
    rng().seed(st.seed + static_cast<uint64_t>(st.launches));
    Block b;
    b.bdim = block;
    b.gdim = grid;
    b.n = n;
    b.threads.resize(n);
    const int nwarps = (n + 31) / 32;
    b.warps.resize(nwarps);
    for (int i = 0; i < n; ++i) {
      Thread& t = b.threads[i];
      t.linear = i;
      t.tid = dim3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
      t.warp = i / 32;
      t.lane = i % 32;
    }
    b.body = [&]() {
      std::tuple<P...> copy = params;
      std::apply(kernel, copy);
    };
    std::vector<int> border;
    const int nblocks = static_cast<int>(grid.x * grid.y * grid.z);
    order_for(border, nblocks);
    Block* prev_block = g_block;
    g_block = &b;
    struct Restore {
      Block* prev;
      ~Restore() { g_block = prev; }
    } restore{prev_block};
    for (int lin : border) {
      b.bidx = dim3(lin % grid.x, (lin / grid.x) % grid.y, lin / (grid.x * grid.y));
      b.live = n;
      b.arrived = 0;
      b.gen = 0;
      for (int w = 0; w < nwarps; ++w) {
        Warp& wp = b.warps[w];
        wp.size = std::min(32, n - w * 32);
        wp.live = wp.size == 32 ? 0xffffffffu : ((1u << wp.size) - 1u);
        wp.arrived = 0;
        wp.gen = 0;
      }
      for (Thread& t : b.threads) {
        t.wait = Wait::Run;
        t.wg_open.clear();
        t.wg_groups.clear();
        t.wg_fenced = false;
        t.wg_issued = 0;
      }
      b.mbars.clear();
      b.copies_land.clear();
      b.copies_bar.clear();
      b.wglog.assign((nwarps + 3) / 4, {0L, {}});
      b.dyn_bytes = smem;
      b.dyn = pool().dyn_smem(smem);
      std::memset(b.dyn, 0xff, smem);  // poison: reads before writes show up as NaN / -1
      ++st.blocks;
      run_block(b);
      for (size_t g = 0; g < b.wglog.size(); ++g) {
        if (!b.wglog[g].second.empty()) {
          throw Error("stemu: wgmma.mma_async #" + std::to_string(b.wglog[g].first) + " of warpgroup " +
                      std::to_string(g) + " was not issued by all 128 of its threads");
        }
      }
      if (!b.copies_land.empty()) {
        throw Error("stemu: block exited with " + std::to_string(b.copies_land.size()) +
                    " cp.async.bulk.tensor copies in flight (nobody waited on their mbarrier)");
      }
    }
  }
};

// ---------------------------------------------------------------- barriers
inline void syncthreads(const char* file, int line) {
  Block& b = *g_block;
  Site s{file, line};
  if (b.arrived == 0) {
    b.site = s;
  } else if (b.site != s) {
    raise_in_fiber("divergent __syncthreads: " + where(b.site) + " and " + where(s));
  }
  if (++b.arrived == b.live) {
    b.arrived = 0;
    ++b.gen;
    return;
  }
  g_thread->wait = Wait::Block;
  g_thread->wait_gen = b.gen;
  yield_to_scheduler();
}

// Enter a warp collective: checks the mask and the call site, deposits this lane's bytes, waits
// for every live lane of the warp, and returns all lanes' deposits.
inline Exchange collective(const char* kind, uint32_t mask, const void* data, size_t bytes,
                           const char* file, int line) {
  Block& b = *g_block;
  Thread& t = *g_thread;
  Warp& w = b.warps[t.warp];
  ++settings().collectives;
  const uint32_t exists = w.size == 32 ? 0xffffffffu : ((1u << w.size) - 1u);
  if (!(mask & (1u << t.lane))) raise_in_fiber(std::string(kind) + ": calling lane not in mask");
  if ((mask & exists) != exists) {
    raise_in_fiber(std::string(kind) + ": partial masks are not supported by the emulator");
  }
  Site s{file, line};
  if (w.arrived == 0) {
    w.site = s;
    w.kind = kind;
  } else if (w.site != s) {
    raise_in_fiber(std::string("warp divergence: lanes at ") + w.kind + " " + where(w.site) +
                   " and " + kind + " " + where(s));
  }
  const int buf = static_cast<int>(w.gen & 1u);
  if (bytes) std::memcpy(w.slot[buf][t.lane], data, bytes);
  w.arrived |= 1u << t.lane;
  if (w.arrived != w.live) {
    t.wait = Wait::Warp;
    t.wait_gen = w.gen;
    yield_to_scheduler();
  } else {
    w.members[buf] = w.arrived;
    w.arrived = 0;
    ++w.gen;
  }
  return Exchange{w.slot[buf], w.members[buf]};
}

inline uint32_t live_lanes() { return g_block->warps[g_thread->warp].live; }

inline uint32_t warp_mask(int) { return 0xffffffffu; }
inline uint32_t warp_mask(int, uint32_t m) { return m; }

inline void syncwarp(uint32_t mask, const char* file, int line) {
  collective("__syncwarp", mask, nullptr, 0, file, line);
  if (mask & ~live_lanes() & ((g_block->warps[g_thread->warp].size == 32)
                                  ? 0xffffffffu
                                  : ((1u << g_block->warps[g_thread->warp].size) - 1u))) {
    raise_in_fiber("__syncwarp: mask names an exited lane");
  }
}

template <class T>
inline T read_lane(const Exchange& x, int src, T own, const char* kind) {
  if (src == g_thread->lane) return own;
  if (!(x.members & (1u << src))) {
    raise_in_fiber(std::string(kind) + ": reads lane " + std::to_string(src) +
                   ", which did not take part (exited: undefined value on hardware)");
  }
  T r;
  std::memcpy(&r, x.slots[src], sizeof(T));
  return r;
}

template <class T>
inline T shfl(const char* f, int l, uint32_t mask, T v, int src, int width = 32) {
  static_assert(sizeof(T) <= 64, "shuffle type too large");
  auto slots = collective("__shfl_sync", mask, &v, sizeof(T), f, l);
  const int lane = g_thread->lane;
  const int target = (lane & ~(width - 1)) + (src & (width - 1));
  if (target >= g_block->warps[g_thread->warp].size) raise_in_fiber("__shfl_sync: lane out of range");
  return read_lane(slots, target, v, "__shfl_sync");
}
template <class T>
inline T shfl_up(const char* f, int l, uint32_t mask, T v, unsigned d, int width = 32) {
  auto slots = collective("__shfl_up_sync", mask, &v, sizeof(T), f, l);
  const int lane = g_thread->lane;
  const int target = (lane % width) >= static_cast<int>(d) ? lane - static_cast<int>(d) : lane;
  return read_lane(slots, target, v, "__shfl_up_sync");
}
template <class T>
inline T shfl_down(const char* f, int l, uint32_t mask, T v, unsigned d, int width = 32) {
  auto slots = collective("__shfl_down_sync", mask, &v, sizeof(T), f, l);
  const int lane = g_thread->lane;
  int target = (lane % width) + static_cast<int>(d) < width ? lane + static_cast<int>(d) : lane;
  if (target >= g_block->warps[g_thread->warp].size) target = lane;  // beyond a partial warp
  return read_lane(slots, target, v, "__shfl_down_sync");
}
template <class T>
inline T shfl_xor(const char* f, int l, uint32_t mask, T v, int lane_mask, int width = 32) {
  auto slots = collective("__shfl_xor_sync", mask, &v, sizeof(T), f, l);
  const int lane = g_thread->lane;
  int target = lane ^ lane_mask;
  if (target / width > lane / width) target = lane;  // later segment: own value, as documented
  if (target >= g_block->warps[g_thread->warp].size) target = lane;
  return read_lane(slots, target, v, "__shfl_xor_sync");
}
inline uint32_t ballot(const char* f, int l, uint32_t mask, int pred) {
  uint32_t p = pred ? 1u : 0u;
  auto slots = collective("__ballot_sync", mask, &p, sizeof p, f, l);
  uint32_t out = 0;
  for (int i = 0; i < 32; ++i) {
    if ((mask & slots.members & (1u << i)) == 0) continue;
    uint32_t v = 0;
    std::memcpy(&v, slots.slots[i], sizeof v);
    out |= (v ? 1u : 0u) << i;
  }
  return out;
}

// ---------------------------------------------------------------- mma.sync.m16n8k16
// Fragment layout from the PTX ISA ("Matrix Fragments for mma.m16n8k16", .f16/.bf16):
//   groupID = lane >> 2, tig = lane % 4.
//   A (16x16, row): a_i, i = 0..7 (two per 32-bit register, lower index in the low half):
//       row = groupID + 8 * ((i >> 1) & 1), col = tig * 2 + (i & 1) + 8 * (i >> 2)
//   B (16x8, col): b_i, i = 0..3: row(k) = tig * 2 + (i & 1) + 8 * (i >> 1), col(n) = groupID
//   C/D (16x8, f32): c_i, i = 0..3: row = groupID + 8 * (i >> 1), col = tig * 2 + (i & 1)
struct MmaFrag {
  uint32_t a[4];
  uint32_t b[2];
  float c[4];
};

inline float half_lo_hi(uint32_t r, int hi, bool bf16) {
  uint16_t bits = static_cast<uint16_t>(hi ? (r >> 16) : (r & 0xffffu));
  return bf16 ? __bfloat162float(__nv_bfloat16{bits}) : __half2float(__half{bits});
}

inline void mma_m16n8k16(const char* f, int l, float d[4], const uint32_t a[4], const uint32_t b[2],
                         const float c[4], bool bf16) {
  if (live_lanes() != 0xffffffffu || g_block->warps[g_thread->warp].size != 32) {
    raise_in_fiber("mma.sync needs all 32 lanes of the warp");
  }
  MmaFrag mine;
  std::memcpy(mine.a, a, sizeof mine.a);
  std::memcpy(mine.b, b, sizeof mine.b);
  std::memcpy(mine.c, c, sizeof mine.c);
  auto slots = collective(bf16 ? "mma.sync.bf16" : "mma.sync.f16", 0xffffffffu, &mine, sizeof mine, f, l);
  float A[16][16], B[16][8];
  for (int lane = 0; lane < 32; ++lane) {
    MmaFrag fr;
    std::memcpy(&fr, slots.slots[lane], sizeof fr);
    const int g = lane >> 2, tig = lane & 3;
    for (int i = 0; i < 8; ++i) {
      A[g + 8 * ((i >> 1) & 1)][tig * 2 + (i & 1) + 8 * (i >> 2)] = half_lo_hi(fr.a[i >> 1], i & 1, bf16);
    }
    for (int i = 0; i < 4; ++i) {
      B[tig * 2 + (i & 1) + 8 * (i >> 1)][g] = half_lo_hi(fr.b[i >> 1], i & 1, bf16);
    }
  }
  const int g = g_thread->lane >> 2, tig = g_thread->lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i >> 1), col = tig * 2 + (i & 1);
    float acc = 0.f;
    for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
    d[i] = mine.c[i] + acc;
  }
}

// ---------------------------------------------------------------- Hopper (sm_90a)
// Written from the PTX ISA (sections "mbarrier", "cp.async.bulk.tensor", "Asynchronous
// Warpgroup Level Matrix Multiply-Accumulate") and the driver API's cuTensorMapEncodeTiled.
//
// Shared window. Dynamic shared memory byte 0 sits at window address kSmemBase; shared
// addresses (what __cvta_generic_to_shared returns, what descriptors and mbarrier operands
// hold) are window addresses. kSmemBase is 128- but not 1024-aligned, so a kernel that needs
// 1024-byte alignment for 128B swizzling must align its buffers itself, as on hardware.
//
// mbarrier. State: expected arrival count, pending arrival count, tx-count, phase.
//   init(count): expected = pending = count, tx = 0, phase 0 in progress.
//   expect_tx(b): tx += b.   complete_tx(b): tx -= b (it may run ahead of expect_tx).
//   arrive: pending -= 1.    arrive.expect_tx(b): expect_tx(b), then arrive.
//   The current phase completes when pending == 0 and tx == 0: phase += 1, pending = expected.
//   try_wait.parity(P) / test_wait.parity(P): true iff the phase with parity P has completed,
//   i.e. iff P != (current phase & 1) (a fresh barrier reports parity 1 as complete).
//   try_wait may also return false after a time-out; here it blocks the fiber until the phase
//   changes (a deadlock is reported when no thread can make progress).
//
// cp.async.bulk.tensor (tile mode, global -> shared, mbarrier::complete_tx::bytes). The box at
// coordinates c (innermost first) is written to shared memory packed, innermost dimension
// fastest; elements outside the tensor are filled with zeros; then complete_tx(box bytes) is
// signalled on the mbarrier (the full box counts, zero fill included). Swizzle 32B/64B/128B:
// the 16-byte chunk index (address bits [4, 4 + log2(span / 16))) is XORed with address bits
// [7, 7 + same width); the inner box extent must be exactly the span here (the driver allows
// less; the emulator does not). When the copy lands depends on the schedule: forward, as late
// as possible (when a thread waits on its mbarrier and the phase is still incomplete, or when
// every thread of the block waits), so a
// read of the destination before that wait sees stale or poisoned bytes; reverse, at issue,
// so a stage handed back to the producer while a wgmma still reads it is overwritten first;
// random, either, per copy. A block exiting with copies in flight is an error.
//
// wgmma.mma_async.sync.aligned.m64nNk16.f32.{f16,bf16} with A and B from shared memory.
//   D(64xN, f32) = A(64x16) * B(16xN) + (scale-d ? D : 0); imm-scale-a/b = 1, no transpose:
//   A is K-major (M rows of K), B is K-major (N rows of K: B[k][n] at row n, column k).
//   Matrix descriptor (64 bits): [0,14) start address >> 4; [16,30) leading-dimension byte
//   offset >> 4; [32,46) stride-dimension byte offset >> 4; [49,52) base offset; [62,64)
//   swizzle: 0 none, 1 128B, 2 64B, 3 32B. Element (r, k) of a K-major operand:
//     none:     start + (r / 8) * SBO + (k*2 / 16) * LBO + (r % 8) * 16 + (k*2) % 16
//               (8x16-byte core matrices; LBO steps along K, SBO along M/N);
//     swizzled: logical = start + (r / 8) * SBO + (r % 8) * span + k*2, physical = logical with
//               the swizzle above applied to its address bits (LBO unused: a k16 slice of a
//               16-bit operand never crosses the span). Base offset must be 0 here.
//   Accumulator fragment (per thread, n/2 floats): warp w = warp % 4 of the warpgroup, lane l,
//     d[i]: row = 16 w + l / 4 + 8 ((i >> 1) & 1), col = 8 (i >> 2) + 2 (l % 4) + (i & 1).
//   Asynchrony: the operands are read and D is written when the op completes, at
//   wgmma.wait_group(N) (all but the N most recent committed groups complete, oldest first).
//   At issue, the accumulator registers are poisoned with NaN (reading them before the wait is
//   undefined on hardware); ops on the same registers chain in issue order. Checked: every
//   thread of the warpgroup alive and issuing the same descriptors/shape/scale-d in the same
//   order (by the end of the block); a wgmma.fence since the thread's last wait_group (the ISA requires one before the
//   first wgmma and between other register accesses and wgmma); nothing in flight at exit.
namespace hopper {

constexpr uint32_t kSmemBase = 0x80;

// Multiprocessors the emulated device reports (sm90::sm_count), settable by tests.
inline int& sm_count() {
  static int n = 3;
  return n;
}

inline uint32_t smem_addr(const void* p) {
  Block& b = *g_block;
  auto* c = static_cast<const unsigned char*>(p);
  if (c < b.dyn || c > b.dyn + b.dyn_bytes) {
    raise_in_fiber("shared address of a pointer outside dynamic shared memory");
  }
  return kSmemBase + static_cast<uint32_t>(c - b.dyn);
}

inline unsigned char* smem_at(uint32_t addr, size_t bytes, const char* what) {
  Block& b = *g_block;
  if (addr < kSmemBase || addr - kSmemBase + bytes > b.dyn_bytes) {
    raise_in_fiber(std::string(what) + ": shared address " + std::to_string(addr) + " (+" +
                   std::to_string(bytes) + " bytes) outside dynamic shared memory");
  }
  return b.dyn + (addr - kSmemBase);
}

// ------------------------------------------------ mbarrier
inline Mbar& mbar(uint32_t addr, const char* what) {
  Block& b = *g_block;
  if (addr % 8) raise_in_fiber(std::string(what) + ": mbarrier address not 8-byte aligned");
  auto it = b.mbars.find(addr);
  if (it == b.mbars.end()) raise_in_fiber(std::string(what) + ": mbarrier not initialized");
  return it->second;
}

inline void mbar_maybe_complete(Mbar& m) {
  if (m.pending == 0 && m.tx == 0) {
    ++m.phase;
    m.pending = m.expected;
  }
}

inline void mbar_init(uint32_t addr, uint32_t count) {
  if (addr % 8) raise_in_fiber("mbarrier.init: address not 8-byte aligned");
  if (count == 0 || count >= (1u << 20)) raise_in_fiber("mbarrier.init: count must be in [1, 2^20)");
  smem_at(addr, 8, "mbarrier.init");
  Mbar m;
  m.expected = m.pending = count;
  g_block->mbars[addr] = m;
}

inline void mbar_expect_tx(uint32_t addr, uint32_t bytes) {
  Mbar& m = mbar(addr, "mbarrier.expect_tx");
  m.tx += bytes;
  if (m.tx >= (1 << 20)) raise_in_fiber("mbarrier: tx-count above 2^20 - 1");
}

inline void mbar_complete_tx(uint32_t addr, uint32_t bytes) {
  Mbar& m = mbar(addr, "mbarrier.complete_tx");
  m.tx -= bytes;
  if (m.tx <= -(1 << 20)) raise_in_fiber("mbarrier: tx-count below -(2^20 - 1)");
  mbar_maybe_complete(m);
}

inline void mbar_arrive(uint32_t addr, uint32_t tx_bytes = 0) {
  Mbar& m = mbar(addr, "mbarrier.arrive");
  if (tx_bytes) mbar_expect_tx(addr, tx_bytes);
  if (m.pending == 0) raise_in_fiber("mbarrier.arrive: more arrivals than the expected count");
  --m.pending;
  mbar_maybe_complete(m);
}

inline bool mbar_test_wait(uint32_t addr, uint32_t parity) {
  return (mbar(addr, "mbarrier.test_wait").phase & 1u) != (parity & 1u);
}

inline void land_copies(uint32_t bar);

inline bool mbar_try_wait(uint32_t addr, uint32_t parity) {
  if (mbar_test_wait(addr, parity)) return true;
  land_copies(addr);
  if (mbar_test_wait(addr, parity)) return true;
  Thread& t = *g_thread;
  t.wait = Wait::Mbar;
  t.wait_addr = addr;
  t.wait_gen = mbar(addr, "mbarrier.try_wait").phase;
  yield_to_scheduler();
  return mbar_test_wait(addr, parity);
}

// ------------------------------------------------ tensor map + bulk tensor copy
struct TensorMap {
  const void* base = nullptr;
  int rank = 0, esize = 0, swizzle = 0;  // swizzle span in bytes: 0, 32, 64, 128
  uint64_t dims[5] = {0, 0, 0, 0, 0};
  uint64_t strides[5] = {0, 0, 0, 0, 0};  // bytes; strides[0] = esize
  uint32_t box[5] = {1, 1, 1, 1, 1};
  uint32_t magic = 0;
};
constexpr uint32_t kTensorMapMagic = 0x5417a9u;

// Checks of cuTensorMapEncodeTiled (driver API documentation), with elementStrides all 1.
inline TensorMap encode_tensor_map(const void* base, int rank, int esize, const uint64_t* dims,
                                   const uint64_t* byte_strides /* rank - 1, dims 1.. */,
                                   const uint32_t* box, int swizzle) {
  auto fail = [](const std::string& m) { throw Error("stemu: cuTensorMapEncodeTiled: " + m); };
  if (rank < 1 || rank > 5) fail("rank must be 1..5");
  if (reinterpret_cast<uintptr_t>(base) % 16) fail("global address must be 16-byte aligned");
  if (swizzle != 0 && swizzle != 32 && swizzle != 64 && swizzle != 128) fail("bad swizzle");
  TensorMap t;
  t.base = base;
  t.rank = rank;
  t.esize = esize;
  t.swizzle = swizzle;
  t.strides[0] = static_cast<uint64_t>(esize);
  for (int i = 0; i < rank; ++i) {
    if (dims[i] == 0 || dims[i] > (uint64_t(1) << 32)) fail("globalDim must be in [1, 2^32]");
    if (box[i] == 0 || box[i] > 256) fail("boxDim must be in [1, 256]");
    t.dims[i] = dims[i];
    t.box[i] = box[i];
    if (i > 0) {
      if (byte_strides[i - 1] % 16 || byte_strides[i - 1] >= (uint64_t(1) << 40)) {
        fail("globalStrides must be multiples of 16 and below 2^40");
      }
      t.strides[i] = byte_strides[i - 1];
    }
  }
  if ((static_cast<uint64_t>(box[0]) * esize) % 16) fail("boxDim[0] * element size must be a multiple of 16 bytes");
  if (swizzle && static_cast<uint64_t>(box[0]) * esize > static_cast<uint64_t>(swizzle)) {
    fail("the inner box dimension must not exceed the swizzle span");
  }
  t.magic = kTensorMapMagic;
  return t;
}

inline uint32_t swizzle_addr(uint32_t addr, int span) {
  if (span == 0) return addr;
  const uint32_t mask = static_cast<uint32_t>(span / 16 - 1);
  return addr ^ (((addr >> 7) & mask) << 4);
}

inline void bulk_tensor_load(uint32_t dst, const TensorMap* tm, const int32_t* c, uint32_t bar) {
  if (tm->magic != kTensorMapMagic) raise_in_fiber("cp.async.bulk.tensor: not an encoded tensor map");
  if (dst % 128) raise_in_fiber("cp.async.bulk.tensor: shared destination not 128-byte aligned");
  if (tm->swizzle && static_cast<int>(tm->box[0]) * tm->esize != tm->swizzle) {
    raise_in_fiber("cp.async.bulk.tensor: emulated swizzle needs inner box bytes == swizzle span");
  }
  mbar(bar, "cp.async.bulk.tensor");
  uint64_t n = 1;
  for (int i = 0; i < tm->rank; ++i) n *= tm->box[i];
  const uint32_t bytes = static_cast<uint32_t>(n * tm->esize);
  smem_at(dst, bytes, "cp.async.bulk.tensor");
  TensorMap map = *tm;
  int32_t co[5] = {0, 0, 0, 0, 0};
  for (int i = 0; i < tm->rank; ++i) co[i] = c[i];
  Block& b = *g_block;
  b.copies_bar.push_back(bar);
  // The landing may run from the scheduler (no current fiber): nothing in it may raise; the
  // bounds and the barrier were checked above.
  b.copies_land.push_back([map, co, dst, bar, n, bytes]() {
    Block& blk = *g_block;
    unsigned char* out = blk.dyn + (dst - kSmemBase);
    for (uint64_t e = 0; e < n; ++e) {
      uint64_t rem = e, off = 0;
      bool inside = true;
      for (int i = 0; i < map.rank; ++i) {
        const int64_t g = static_cast<int64_t>(co[i]) + static_cast<int64_t>(rem % map.box[i]);
        rem /= map.box[i];
        if (g < 0 || static_cast<uint64_t>(g) >= map.dims[i]) inside = false;
        else off += static_cast<uint64_t>(g) * map.strides[i];
      }
      const uint32_t at = swizzle_addr(dst + static_cast<uint32_t>(e * map.esize), map.swizzle);
      unsigned char* p = out + (at - dst);
      if (inside) std::memcpy(p, static_cast<const unsigned char*>(map.base) + off, map.esize);
      else std::memset(p, 0, map.esize);
    }
    auto it = blk.mbars.find(bar);
    if (it == blk.mbars.end()) {
      if (blk.error.empty()) blk.error = "cp.async.bulk.tensor: its mbarrier was invalidated in flight";
      return;
    }
    it->second.tx -= bytes;
    mbar_maybe_complete(it->second);
  });
  // When the copy lands depends on the schedule: forward as late as possible (a read of the
  // destination before waiting on the mbarrier sees stale bytes), reverse at once (a stage
  // released while a wgmma still reads it gets overwritten first), random either, per copy.
  const Schedule sc = settings().schedule;
  if (sc == Schedule::Reverse || (sc == Schedule::Random && (rng()() & 1u))) {
    auto land = std::move(b.copies_land.back());
    b.copies_land.pop_back();
    b.copies_bar.pop_back();
    land();
  }
}

inline void land_copies(uint32_t bar) {
  Block& b = *g_block;
  for (size_t i = 0; i < b.copies_land.size();) {
    if (b.copies_bar[i] == bar) {
      auto land = std::move(b.copies_land[i]);
      b.copies_land.erase(b.copies_land.begin() + static_cast<long>(i));
      b.copies_bar.erase(b.copies_bar.begin() + static_cast<long>(i));
      land();
    } else {
      ++i;
    }
  }
}

// ------------------------------------------------ wgmma
inline float load16(const unsigned char* p, bool bf16) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return bf16 ? __bfloat162float(__nv_bfloat16{bits}) : __half2float(__half{bits});
}

inline uint32_t desc_elem(uint64_t desc, int r, int k) {
  const uint32_t start = static_cast<uint32_t>(desc & 0x3fffu) << 4;
  const uint32_t lbo = static_cast<uint32_t>((desc >> 16) & 0x3fffu) << 4;
  const uint32_t sbo = static_cast<uint32_t>((desc >> 32) & 0x3fffu) << 4;
  const int mode = static_cast<int>(desc >> 62);
  const uint32_t kb = static_cast<uint32_t>(k) * 2u, ur = static_cast<uint32_t>(r);
  if (mode == 0) return start + (ur / 8) * sbo + (kb / 16) * lbo + (ur % 8) * 16 + kb % 16;
  const uint32_t span = mode == 1 ? 128u : mode == 2 ? 64u : 32u;
  return swizzle_addr(start + (ur / 8) * sbo + (ur % 8) * span + kb, static_cast<int>(span));
}

inline void check_desc(uint64_t desc, const char* which) {
  if ((desc >> 49) & 7u) raise_in_fiber(std::string("wgmma: ") + which + " descriptor base offset != 0 is not emulated");
  if (desc & (uint64_t(3) << 14 | uint64_t(3) << 30 | uint64_t(7) << 46 | uint64_t(0x3ff) << 52)) {
    raise_in_fiber(std::string("wgmma: ") + which + " descriptor has reserved bits set");
  }
}

inline void wgmma_compute(const Thread& t, WgmmaOp& op, const float* d_in, float* result) {
  const int w = t.warp % 4, l = t.lane;
  float A[2][16];
  for (int h = 0; h < 2; ++h) {
    const int r = 16 * w + l / 4 + 8 * h;
    for (int k = 0; k < 16; ++k) A[h][k] = load16(smem_at(desc_elem(op.desc_a, r, k), 2, "wgmma A"), op.bf16);
  }
  for (int i = 0; i < op.n / 2; ++i) {
    const int h = (i >> 1) & 1, col = 8 * (i >> 2) + 2 * (l % 4) + (i & 1);
    float acc = 0.f;
    for (int k = 0; k < 16; ++k) acc += A[h][k] * load16(smem_at(desc_elem(op.desc_b, col, k), 2, "wgmma B"), op.bf16);
    result[i] = (op.scale_d ? d_in[i] : 0.f) + acc;
  }
}

inline void wgmma_fence() { g_thread->wg_fenced = true; }

inline void wgmma_issue(float* d, int n, uint64_t desc_a, uint64_t desc_b, bool scale_d, bool bf16) {
  Block& b = *g_block;
  Thread& t = *g_thread;
  if (n % 8 || n < 8 || n > 256) raise_in_fiber("wgmma: N must be a multiple of 8 in [8, 256]");
  if (!t.wg_fenced) raise_in_fiber("wgmma.mma_async without a wgmma.fence since the last wait_group");
  const int g = t.warp / 4;
  for (int w = 4 * g; w < 4 * g + 4; ++w) {
    if (w >= static_cast<int>(b.warps.size()) || b.warps[w].size != 32) {
      raise_in_fiber("wgmma.mma_async needs a full warpgroup (4 warps of 32 threads)");
    }
  }
  check_desc(desc_a, "A");
  check_desc(desc_b, "B");
  // .sync.aligned: every thread of the warpgroup issues the same sequence.
  auto& [base, recs] = b.wglog[g];
  const long idx = t.wg_issued++ - base;
  if (idx == static_cast<long>(recs.size())) {
    recs.push_back({desc_a, desc_b, n, scale_d, 0});
  } else {
    const auto& r = recs[idx];
    if (r.a != desc_a || r.b != desc_b || r.n != n || r.scale_d != scale_d) {
      raise_in_fiber("wgmma.mma_async: threads of a warpgroup issued different operands");
    }
  }
  if (++recs[idx].seen == 128) {
    while (!recs.empty() && recs.front().seen == 128) {
      recs.erase(recs.begin());
      ++base;
    }
  }
  WgmmaOp op;
  op.desc_a = desc_a;
  op.desc_b = desc_b;
  op.n = n;
  op.scale_d = scale_d;
  op.bf16 = bf16;
  op.d = d;
  bool pending = false;
  for (auto& grp : t.wg_groups)
    for (auto& o : grp) pending |= o.d == d;
  for (auto& o : t.wg_open) pending |= o.d == d;
  op.chained = pending;
  if (!pending) {
    op.d_in.assign(d, d + n / 2);
    for (int i = 0; i < n / 2; ++i) d[i] = std::numeric_limits<float>::quiet_NaN();
  }
  t.wg_open.push_back(std::move(op));
}

inline void wgmma_commit() {
  Thread& t = *g_thread;
  t.wg_groups.push_back(std::move(t.wg_open));  // may be an empty group, as in the ISA
  t.wg_open.clear();
}

// Completes the due groups of one thread (its registers are written through the recorded
// pointers, which stay valid while the thread waits in wgmma_wait).
inline void wgmma_complete(Thread& t, int keep) {
  while (static_cast<int>(t.wg_groups.size()) > keep) {
    std::vector<WgmmaOp> grp = std::move(t.wg_groups.front());
    t.wg_groups.erase(t.wg_groups.begin());
    for (WgmmaOp& op : grp) {
      std::vector<float> out(op.n / 2);
      wgmma_compute(t, op, op.d_in.data(), out.data());
      WgmmaOp* next = nullptr;  // the next pending op on the same registers takes the result
      for (auto& o : grp) {
        if (!next && &o > &op && o.d == op.d) next = &o;
      }
      for (auto& g2 : t.wg_groups) {
        for (auto& o : g2) {
          if (!next && o.d == op.d) next = &o;
        }
      }
      for (auto& o : t.wg_open) {
        if (!next && o.d == op.d) next = &o;
      }
      if (next) {
        next->d_in = std::move(out);
        next->chained = false;
      } else {
        std::memcpy(op.d, out.data(), sizeof(float) * out.size());
      }
    }
  }
  t.wg_fenced = false;
}

// wgmma.wait_group is .sync.aligned: the lanes of a warp pass it together. So it is a warp
// collective here, and the first lane to leave it completes the due groups of all 32 lanes
// (the warp's share of the operand reads is over before any lane goes on, e.g. to hand the
// stage back). It yields first, letting other threads run (and overwrite a stage released
// too early) before the deferred operand reads.
inline void wgmma_wait(int keep, const char* file, int line) {
  yield_to_scheduler();
  collective("wgmma.wait_group", 0xffffffffu, &keep, sizeof keep, file, line);
  Block& b = *g_block;
  const int w = g_thread->warp;
  for (int l = 0; l < b.warps[w].size; ++l) wgmma_complete(b.threads[w * 32 + l], keep);
}

}  // namespace hopper

// ---------------------------------------------------------------- atomics
// Fibers never interleave inside these, so plain read-modify-write is atomic.
template <class T>
inline T atomic_add(T* p, T v) {
  T old = *p;
  *p = old + v;
  return old;
}

}  // namespace stemu

#define threadIdx (::stemu::g_thread->tid)
#define blockIdx (::stemu::g_block->bidx)
#define blockDim (::stemu::g_block->bdim)
#define gridDim (::stemu::g_block->gdim)
#define warpSize 32
#define __syncthreads() ::stemu::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) ::stemu::syncwarp(::stemu::warp_mask(0 __VA_OPT__(, ) __VA_ARGS__), __FILE__, __LINE__)
#define __shfl_sync(...) ::stemu::shfl(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) ::stemu::shfl_up(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) ::stemu::shfl_down(__FILE__, __LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) ::stemu::shfl_xor(__FILE__, __LINE__, __VA_ARGS__)
#define __ballot_sync(mask, pred) ::stemu::ballot(__FILE__, __LINE__, mask, pred)
#define __any_sync(mask, pred) (::stemu::ballot(__FILE__, __LINE__, mask, pred) != 0u)
#define __all_sync(mask, pred) \
  (::stemu::ballot(__FILE__, __LINE__, mask, pred) == ((mask) & ::stemu::live_lanes()))
#define __threadfence() ((void)0)

inline float atomicAdd(float* p, float v) { return stemu::atomic_add(p, v); }
inline double atomicAdd(double* p, double v) { return stemu::atomic_add(p, v); }
inline int atomicAdd(int* p, int v) { return stemu::atomic_add(p, v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return stemu::atomic_add(p, v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
  return stemu::atomic_add(p, v);
}
inline int atomicMax(int* p, int v) { int o = *p; *p = std::max(o, v); return o; }
inline unsigned atomicMax(unsigned* p, unsigned v) { unsigned o = *p; *p = std::max(o, v); return o; }
inline int atomicCAS(int* p, int cmp, int v) { int o = *p; if (o == cmp) *p = v; return o; }
inline unsigned atomicCAS(unsigned* p, unsigned cmp, unsigned v) {
  unsigned o = *p; if (o == cmp) *p = v; return o;
}
inline int atomicExch(int* p, int v) { int o = *p; *p = v; return o; }
inline float atomicExch(float* p, float v) { float o = *p; *p = v; return o; }

// The hooks csrc/kernels/common.cuh expects from a non-nvcc compiler.
#define ST_LAUNCH(grid, block, smem, stream, ...) ::stemu::Launch(grid, block, smem, __VA_ARGS__)
#define ST_DYNAMIC_SMEM(T, name) T* name = reinterpret_cast<T*>(::stemu::dynamic_smem())
#define ST_MMA_M16N8K16(d, a, b, c, is_bf16) ::stemu::mma_m16n8k16(__FILE__, __LINE__, d, a, b, c, is_bf16)
