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
// even). Every misuse that hardware would answer with a hang or an undefined value raises
// stemu::Error (surfacing as a Python RuntimeError in the tests): deadlock, divergent barrier,
// exit while others wait at a barrier, a warp collective whose lanes are at different call
// sites, a shuffle that reads an exited lane, mma with a partial warp.
//
// Not covered (see csrc/README.md): performance, the memory model across blocks, async copies.
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

enum class Wait : uint8_t { Run, Block, Warp, Done };

struct Thread {
  Ctx ctx;
  dim3 tid;
  int linear = 0, warp = 0, lane = 0;
  Wait wait = Wait::Run;
  unsigned long wait_gen = 0;
  char* stack = nullptr;  // lowest usable address (a guard page lies below it)
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
      t.wait = Wait::Run;
      g_thread = &t;
      stemu_switch(&g_sched, &t.ctx);
      g_thread = nullptr;
      progressed = true;
      if (!b.error.empty()) throw Error("stemu: " + b.error);
      if (t.wait == Wait::Done) ++done;
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
      for (Thread& t : b.threads) t.wait = Wait::Run;
      b.dyn_bytes = smem;
      b.dyn = pool().dyn_smem(smem);
      std::memset(b.dyn, 0xff, smem);  // poison: reads before writes show up as NaN / -1
      ++st.blocks;
      run_block(b);
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
