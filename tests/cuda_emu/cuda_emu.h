// CUDA execution model for g++ (test code only): lets flatopt/kernels/*.cu compile UNCHANGED as C++ and run on the
// CPU with CUDA's semantics, one fibre per CUDA thread of a block (a hand-rolled
// x86-64 context switch; see emu_fibre_switch).  Included first (-include) into a
// generated translation unit that #includes one .cu file and exports every template instantiation with
// CUDA_EMU_EXPORT(kernel, float|double).  Driven by tests/cuda_emu/emu.py.
//
// Checked at run time (each reported as an error of the launch, never silently):
//   * __syncthreads(): a block-wide rendezvous; threads waiting at different barriers (divergence), a barrier
//     reached after some threads of the block exited, and a deadlock are errors;
//   * __shfl_{sync,up,down,xor}_sync: a per-warp rendezvous with CUDA's lane / width / mask rules: the caller
//     must be in the mask, every lane of the mask must exist, be alive and reach the same shuffle, a source lane
//     outside the mask is an error, width must be a power of two <= 32;
//   * __shared__ memory (every local static of the .cu's functions, registered by emu.py) is filled with 0xff bytes (NaN as float and double) before
//     every block, so a read before write poisons the result;
//   * blocks and, inside every phase between two rendezvous, threads run forward, reverse or in a seeded random
//     order, to expose races;
//   * a SIGSEGV / SIGBUS during the launch (the guard pages emu.py puts around every array argument, or a fibre's
//     stack guard) ends the launch with an "invalid memory access" error and the faulting address;
//   * __builtin_assume_aligned(p, n) (the generated kernels' 16-byte vector loads and stores of float4 / double2)
//     is an error when p is not n-byte aligned (on a GPU: a misaligned address).
// Arguments: args[i] points to the bytes emu.py packed for parameter i (CuPy's packing); every CUDA thread gets its
// own copy of each parameter, read as sizeof(param) bytes.  The parameter types are exported by *_sig(), deduced
// from the instantiated function's type, so emu.py checks each argument's kind and width against them.
#pragma once

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>
#include <stdio.h>
#include <stdlib.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __launch_bounds__(...)  // checked at launch by emu.py (Kernel.max_threads)
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static  // found by emu.py in the symbol table (local statics of the .cu's functions)
#define __restrict__ __restrict

using std::max;
using std::min;

struct uint3 { unsigned int x, y, z; };
struct dim3 { unsigned int x = 1, y = 1, z = 1; };
struct alignas(16) float4 { float x, y, z, w; };  // CUDA's vector types (their size and alignment)
struct alignas(16) double2 { double x, y; };

static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }


// The fibre switch (x86-64 System V): saves the callee-saved registers, MXCSR and the x87 control word on the
// current stack, stores the stack pointer in *save_sp and resumes the fibre whose stack pointer is new_sp.  The
// same as swapcontext without its two rt_sigprocmask system calls per switch (much faster; fibres never change the
// signal mask).  ucontext's makecontext is replaced by fibre_init below.
extern "C" void emu_fibre_switch(void** save_sp, void* new_sp);
extern "C" void emu_fibre_trampoline();
__asm__(R"(
  .text
  .p2align 4
  .type emu_fibre_switch,@function
emu_fibre_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_fibre_switch, .-emu_fibre_switch
  .type emu_fibre_trampoline,@function
emu_fibre_trampoline:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size emu_fibre_trampoline, .-emu_fibre_trampoline
)");

namespace emu {

struct Launch {  // filled by emu.py (ctypes mirror: emu.py LAUNCH)
  unsigned int grid[3];
  unsigned int block[3];
  int block_order;    // 0 forward, 1 reverse, 2 seeded random
  int thread_order;   // same, for the fibres of each phase
  unsigned long long seed;
  long long switches;  // out: context switches performed
  void* fault_addr;    // out: address of an invalid access
  char error[1024];    // out: the first error ("" when none)
};

enum State { READY, AT_BARRIER, AT_SHFL, EXITED };
enum ShflKind { SHFL_IDX, SHFL_UP, SHFL_DOWN, SHFL_XOR };

struct Fibre {
  void* sp;  // saved stack pointer (the callee-saved registers are on the fibre's stack)
  uint3 tid;
  int state;
  int line;  // barrier / shuffle line
  // shuffle request
  int shfl_kind, shfl_width, shfl_arg, shfl_size;
  unsigned int shfl_mask;
  unsigned char shfl_val[8], shfl_out[8];
};

inline Launch* L = nullptr;
inline dim3 gridDim_, blockDim_;
inline uint3 blockIdx_;
inline Fibre* cur = nullptr;
inline std::vector<Fibre> fib;
inline void* main_sp = nullptr;
inline char* stacks = nullptr;
inline size_t stacks_n = 0;
constexpr size_t STACK = 64 * 1024, PAGE = 4096;
inline void (*body)(void*) = nullptr;
inline void* body_arg = nullptr;
inline sigjmp_buf fault_jmp;
inline volatile sig_atomic_t in_launch = 0;
inline uint64_t rng_state = 0;
inline std::vector<std::pair<char*, size_t>> shared_regions;  // every __shared__ variable of the library

inline uint64_t rnd() {  // splitmix64
  uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline void order(std::vector<int>& v, int how) {
  if (how == 1) std::reverse(v.begin(), v.end());
  if (how == 2)
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[rnd() % i]);
}

inline void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline void fail(const char* fmt, ...) {
  if (L->error[0]) return;  // keep the first error
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(L->error, sizeof L->error, fmt, ap);
  va_end(ap);
}

// __builtin_assume_aligned (redefined below): the address must be n-byte aligned, as a vector access needs on a GPU
inline void* assume_aligned(const void* p, size_t n) {
  if ((uintptr_t)p % n)
    fail("misaligned %zu-byte vector access at %p (block %u, thread %u)", n, p, blockIdx_.x, cur ? cur->tid.x : 0u);
  return (void*)p;
}

inline void yield_to_scheduler() {
  ++L->switches;
  emu_fibre_switch(&cur->sp, main_sp);
}

inline void fibre_entry(void* arg) {
  Fibre* f = (Fibre*)arg;
  body(body_arg);
  f->state = EXITED;
  ++L->switches;
  void* dead;
  emu_fibre_switch(&dead, main_sp);
  __builtin_trap();
}

// A new fibre's stack, laid out as emu_fibre_switch leaves a suspended one: MXCSR/x87 control word, r15, r14,
// r13 = entry, r12 = argument, rbx, rbp, return address = emu_fibre_trampoline (which calls entry(argument)).
inline void* fibre_init(char* stack_top, void (*entry)(void*), void* arg) {
  uint64_t* sp = (uint64_t*)(((uintptr_t)stack_top & ~(uintptr_t)15) - 16);  // 16-aligned after the `ret`
  sp -= 8;
  uint32_t csr[2];
  __asm__ volatile("stmxcsr %0" : "=m"(csr[0]));
  __asm__ volatile("fnstcw %0" : "=m"(csr[1]));
  memcpy(&sp[0], csr, 8);
  sp[1] = 0;                         // r15
  sp[2] = 0;                         // r14
  sp[3] = (uint64_t)(uintptr_t)entry;  // r13
  sp[4] = (uint64_t)(uintptr_t)arg;    // r12
  sp[5] = 0;                         // rbx
  sp[6] = 0;                         // rbp
  sp[7] = (uint64_t)(uintptr_t)&emu_fibre_trampoline;
  return sp;
}

inline void syncthreads(int line) {
  cur->state = AT_BARRIER;
  cur->line = line;
  yield_to_scheduler();
}

template <typename T>
T shfl(int line, ShflKind kind, unsigned int mask, T var, int arg, int width = 32) {
  static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
  cur->state = AT_SHFL;
  cur->line = line;
  cur->shfl_kind = kind;
  cur->shfl_mask = mask;
  cur->shfl_arg = arg;
  cur->shfl_width = width;
  cur->shfl_size = sizeof(T);
  memcpy(cur->shfl_val, &var, sizeof(T));
  yield_to_scheduler();
  T out;
  memcpy(&out, cur->shfl_out, sizeof(T));
  return out;
}

// Resolve the shuffles of warp w (lanes [w*32, w*32+32) of the linear thread index); returns true when done.
inline bool resolve_warp(int nthreads, int w) {
  const int lo = w * 32, hi = std::min(nthreads, lo + 32);
  int first = -1;
  for (int t = lo; t < hi; ++t)
    if (fib[t].state == AT_SHFL) { first = t; break; }
  if (first < 0) return false;
  // Every waiting lane must be in its own mask and wait at the same shuffle with the same mask (flatopt's kernels
  // shuffle whole warps; sub-warp partitions with different masks are reported as divergence), and every lane the
  // mask names must exist, be alive and wait there too.
  const Fibre& f0 = fib[first];
  const unsigned int mask = f0.shfl_mask;
  const int w2 = f0.shfl_width;
  if (w2 < 1 || w2 > 32 || (w2 & (w2 - 1))) {
    fail("__shfl_*_sync at line %d: width %d is not a power of two <= 32", f0.line, w2);
    return false;
  }
  for (int t = lo; t < hi; ++t) {
    const Fibre& f = fib[t];
    if (f.state != AT_SHFL) continue;
    const int lane = t - lo;
    if (!(f.shfl_mask >> lane & 1u)) {
      fail("__shfl_*_sync at line %d: lane %d is not in its own mask 0x%08x", f.line, lane, f.shfl_mask);
      return false;
    }
    if (f.line != f0.line || f.shfl_mask != mask || f.shfl_width != w2) {
      fail("__shfl_*_sync divergence in warp %d: lane %d at line %d (mask 0x%08x), lane %d at line %d "
           "(mask 0x%08x)", w, first - lo, f0.line, mask, lane, f.line, f.shfl_mask);
      return false;
    }
  }
  for (int l = 0; l < 32; ++l) {
    if (!(mask >> l & 1u)) continue;
    if (lo + l >= hi) {
      fail("__shfl_*_sync at line %d (block %u): mask 0x%08x names lane %d, which does not exist "
           "(blockDim.x = %u)", f0.line, blockIdx_.x, mask, l, blockDim_.x);
      return false;
    }
    const Fibre& o = fib[lo + l];
    if (o.state == EXITED) {
      fail("__shfl_*_sync at line %d: mask 0x%08x names lane %d, which has exited", f0.line, mask, l);
      return false;
    }
    if (o.state != AT_SHFL) return false;  // not there yet (a deadlock if it never comes)
  }
  // All present: compute every waiting lane's result from the values at the time of the shuffle.
  for (int t = lo; t < hi; ++t) {
    Fibre& f = fib[t];
    if (f.state != AT_SHFL) continue;
    const int lane = t - lo, width = f.shfl_width, base = lane & ~(width - 1);
    int src = lane;
    switch (f.shfl_kind) {
      case SHFL_IDX: src = base + (f.shfl_arg & (width - 1)); break;
      case SHFL_UP: src = (lane - base) >= f.shfl_arg ? lane - f.shfl_arg : lane; break;
      case SHFL_DOWN: src = (lane - base) + f.shfl_arg < width ? lane + f.shfl_arg : lane; break;
      case SHFL_XOR: src = lane ^ f.shfl_arg; if (src >= base + width) src = lane; break;
    }
    if (src < 0 || src > 31 || lo + src >= hi || !(f.shfl_mask >> src & 1u)) {
      fail("__shfl_*_sync at line %d: lane %d reads lane %d, outside the mask 0x%08x", f.line, lane, src,
           f.shfl_mask);
      return false;
    }
    memcpy(f.shfl_out, fib[lo + src].shfl_val, 8);
  }
  for (int t = lo; t < hi; ++t)
    if (fib[t].state == AT_SHFL) fib[t].state = READY;
  return true;
}

inline void on_fault(int sig, siginfo_t* si, void*) {
  if (in_launch) {
    L->fault_addr = si->si_addr;
    siglongjmp(fault_jmp, sig);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

inline char* fibre_stacks(size_t n) {
  if (n <= stacks_n) return stacks;
  if (stacks) munmap(stacks, stacks_n * (STACK + PAGE));
  stacks = (char*)mmap(nullptr, n * (STACK + PAGE), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (stacks == MAP_FAILED) { stacks = nullptr; stacks_n = 0; return nullptr; }
  for (size_t i = 0; i < n; ++i) mprotect(stacks + i * (STACK + PAGE), PAGE, PROT_NONE);  // overflow guard
  stacks_n = n;
  return stacks;
}

// Run body(arg) as every CUDA thread of every block of the launch; 0 on success, -1 with L->error set.
inline int run_grid(Launch* launch, void (*fn)(void*), void* arg) {
  L = launch;
  L->error[0] = 0;
  L->switches = 0;
  L->fault_addr = nullptr;
  rng_state = L->seed;
  gridDim_ = dim3{L->grid[0], L->grid[1], L->grid[2]};
  blockDim_ = dim3{L->block[0], L->block[1], L->block[2]};
  const long long nblocks = (long long)gridDim_.x * gridDim_.y * gridDim_.z;
  const int nthreads = (int)(blockDim_.x * blockDim_.y * blockDim_.z);
  if (nblocks <= 0 || nthreads <= 0 || nthreads > 1024 || blockDim_.z > 64 || gridDim_.y > 65535 ||
      gridDim_.z > 65535 || gridDim_.x > 2147483647u) {
    fail("invalid launch configuration: grid (%u, %u, %u), block (%u, %u, %u)", gridDim_.x, gridDim_.y, gridDim_.z,
         blockDim_.x, blockDim_.y, blockDim_.z);
    return -1;
  }
  char* st = fibre_stacks(nthreads);
  if (!st) { fail("cannot allocate fibre stacks"); return -1; }
  body = fn;
  body_arg = arg;
  fib.assign(nthreads, Fibre{});
  std::vector<long long> blocks(nblocks);
  for (long long b = 0; b < nblocks; ++b) blocks[b] = b;
  if (L->block_order == 1) std::reverse(blocks.begin(), blocks.end());
  if (L->block_order == 2)
    for (size_t i = blocks.size(); i > 1; --i) std::swap(blocks[i - 1], blocks[rnd() % i]);

  struct sigaction sa, old_segv, old_bus;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  static char altstack[64 * 1024];
  stack_t ss, old_ss;
  ss.ss_sp = altstack;
  ss.ss_size = sizeof altstack;
  ss.ss_flags = 0;
  sigaltstack(&ss, &old_ss);
  sigaction(SIGSEGV, &sa, &old_segv);
  sigaction(SIGBUS, &sa, &old_bus);
  int rc = 0;
  long long bi = 0;
  if (sigsetjmp(fault_jmp, 1)) {
    in_launch = 0;
    fail("invalid memory access at %p (block %u, thread %u)", L->fault_addr, blockIdx_.x, cur ? cur->tid.x : 0u);
    rc = -1;
    goto done;
  }
  in_launch = 1;
  for (; bi < nblocks; ++bi) {
    const long long b = blocks[bi];
    blockIdx_ = uint3{(unsigned)(b % gridDim_.x), (unsigned)(b / gridDim_.x % gridDim_.y),
                      (unsigned)(b / ((long long)gridDim_.x * gridDim_.y))};
    for (auto& r : shared_regions) memset(r.first, 0xff, r.second);
    for (int t = 0; t < nthreads; ++t) {
      Fibre& f = fib[t];
      f.tid = uint3{(unsigned)(t % blockDim_.x), (unsigned)(t / blockDim_.x % blockDim_.y),
                    (unsigned)(t / (blockDim_.x * blockDim_.y))};
      f.state = READY;
      f.sp = fibre_init(st + (size_t)(t + 1) * (STACK + PAGE), fibre_entry, &f);
    }
    std::vector<int> ready;
    for (;;) {
      ready.clear();
      for (int t = 0; t < nthreads; ++t)
        if (fib[t].state == READY) ready.push_back(t);
      order(ready, L->thread_order);
      for (int t : ready) {
        cur = &fib[t];
        ++L->switches;
        emu_fibre_switch(&main_sp, cur->sp);
        if (L->error[0]) { rc = -1; goto done; }
      }
      cur = nullptr;
      int exited = 0, at_bar = 0, at_shfl = 0;
      for (int t = 0; t < nthreads; ++t) {
        exited += fib[t].state == EXITED;
        at_bar += fib[t].state == AT_BARRIER;
        at_shfl += fib[t].state == AT_SHFL;
      }
      if (exited == nthreads) break;
      if (at_shfl) {
        bool progress = false;
        for (int w = 0; w * 32 < nthreads; ++w) progress |= resolve_warp(nthreads, w);
        if (L->error[0]) { rc = -1; goto done; }
        if (progress) continue;
      }
      if (at_bar && !at_shfl) {
        int line = -1;
        for (int t = 0; t < nthreads; ++t) {
          if (fib[t].state != AT_BARRIER) continue;
          if (line < 0) line = fib[t].line;
          else if (fib[t].line != line) {
            fail("__syncthreads divergence in block %u: threads wait at line %d and at line %d", blockIdx_.x, line,
                 fib[t].line);
            rc = -1;
            goto done;
          }
        }
        if (exited) {
          fail("__syncthreads at line %d in block %u reached after %d of %d threads exited", line, blockIdx_.x,
               exited, nthreads);
          rc = -1;
          goto done;
        }
        for (int t = 0; t < nthreads; ++t) fib[t].state = READY;
        continue;
      }
      // Nothing can proceed: threads wait at barriers and shuffles that can never complete.
      int bl = -1, sl = -1;
      for (int t = 0; t < nthreads; ++t) {
        if (fib[t].state == AT_BARRIER) bl = fib[t].line;
        if (fib[t].state == AT_SHFL) sl = fib[t].line;
      }
      fail("deadlock in block %u: %d threads at __syncthreads (line %d), %d at a shuffle (line %d), %d exited",
           blockIdx_.x, at_bar, bl, at_shfl, sl, exited);
      rc = -1;
      goto done;
    }
  }
done:
  in_launch = 0;
  cur = nullptr;
  sigaction(SIGSEGV, &old_segv, nullptr);
  sigaction(SIGBUS, &old_bus, nullptr);
  sigaltstack(&old_ss, nullptr);
  return rc;
}

// ---- parameter types (exported as "kind+size" codes: f4 f8 i4 i8 u1 b1, pointers p<pointee> with pv = void*)
template <typename A>
std::string code_of() {
  using T = std::remove_cv_t<A>;
  if constexpr (std::is_pointer_v<T>) {
    using P = std::remove_cv_t<std::remove_pointer_t<T>>;
    if constexpr (std::is_void_v<P>) return "pv";
    else return "p" + code_of<P>();
  } else if constexpr (std::is_same_v<T, bool>) {
    return "b1";
  } else if constexpr (std::is_floating_point_v<T>) {
    return "f" + std::to_string(sizeof(T));
  } else if constexpr (std::is_integral_v<T>) {
    return (std::is_signed_v<T> ? "i" : "u") + std::to_string(sizeof(T));
  } else {
    return "?" + std::to_string(sizeof(T));
  }
}

template <typename... A>
const char* sig_of(void (*)(A...)) {
  static const std::string s = [] {
    std::string out;
    ((out += (out.empty() ? "" : ",") + code_of<A>()), ...);
    return out;
  }();
  return s.c_str();
}

// "1" for a pointer to const (read by the kernel), "0" for any other parameter: the stand-in's race detector
// records a launch's reads and writes from it (fakecupy.py)
template <typename A>
const char* ro_code() {
  if constexpr (std::is_pointer_v<A>) return std::is_const_v<std::remove_pointer_t<A>> ? "1" : "0";
  else return "0";
}

template <typename... A>
const char* ro_of(void (*)(A...)) {
  static const std::string s = [] {
    std::string out;
    ((out += (out.empty() ? "" : ",") + std::string(ro_code<A>())), ...);
    return out;
  }();
  return s.c_str();
}

template <typename A>
A load_param(void* p) {  // this thread's own copy of the parameter, sizeof(A) bytes of the packed argument
  std::remove_cv_t<A> v;
  memcpy((void*)&v, p, sizeof(v));
  return v;
}

template <typename... A, size_t... I>
void call_kernel(void (*k)(A...), void** args, std::index_sequence<I...>) {
  k(load_param<A>(args[I])...);
}

template <typename... A>
int run(Launch* launch, void (*k)(A...), void** args) {
  struct Ctx { void (*k)(A...); void** args; } ctx{k, args};
  return run_grid(launch, [](void* c) {
    Ctx* x = (Ctx*)c;
    call_kernel(x->k, x->args, std::index_sequence_for<A...>{});
  }, &ctx);
}

}  // namespace emu

#define gridDim (::emu::gridDim_)
#define blockDim (::emu::blockDim_)
#define blockIdx (::emu::blockIdx_)
#define threadIdx (::emu::cur->tid)
#define warpSize 32
#define __builtin_assume_aligned(p, n) ::emu::assume_aligned((p), (n))
#define __syncthreads() ::emu::syncthreads(__LINE__)
#define __shfl_sync(mask, var, lane, ...) ::emu::shfl(__LINE__, ::emu::SHFL_IDX, mask, var, lane __VA_OPT__(,) __VA_ARGS__)
#define __shfl_up_sync(mask, var, d, ...) ::emu::shfl(__LINE__, ::emu::SHFL_UP, mask, var, d __VA_OPT__(,) __VA_ARGS__)
#define __shfl_down_sync(mask, var, d, ...) ::emu::shfl(__LINE__, ::emu::SHFL_DOWN, mask, var, d __VA_OPT__(,) __VA_ARGS__)
#define __shfl_xor_sync(mask, var, d, ...) ::emu::shfl(__LINE__, ::emu::SHFL_XOR, mask, var, d __VA_OPT__(,) __VA_ARGS__)

#define CUDA_EMU_API extern "C" __attribute__((visibility("default")))
// emu.py registers each __shared__ static (address, size), found in the library's symbol table, once after loading
CUDA_EMU_API void emu_shared_region(void* p, size_t n) { ::emu::shared_regions.emplace_back((char*)p, n); }
// The device math library the stand-in's CuPy ufuncs share with the kernels (here the C library's; on a GPU, CuPy's
// ufuncs and the kernels compile the same CUDA functions): fn 0 CuPy's float32 exp2, pow(2.0f, x) (cupy/_math/
// explog.py), 1 its double exp2, pow(2.0, x), 2 log2f, 3 log2.
CUDA_EMU_API void emu_devmath(int fn, const void* x, void* out, long long n) {
  for (long long i = 0; i < n; ++i) {
    switch (fn) {
      case 0: ((float*)out)[i] = powf(2.0f, ((const float*)x)[i]); break;
      case 1: ((double*)out)[i] = pow(2.0, ((const double*)x)[i]); break;
      case 2: ((float*)out)[i] = log2f(((const float*)x)[i]); break;
      case 3: ((double*)out)[i] = log2(((const double*)x)[i]); break;
      case 4: ((float*)out)[i] = logf(((const float*)x)[i]); break;
      case 5: ((double*)out)[i] = log(((const double*)x)[i]); break;
      case 6: ((float*)out)[i] = cosf(((const float*)x)[i]); break;
      case 7: ((double*)out)[i] = cos(((const double*)x)[i]); break;
      case 8: ((float*)out)[i] = sinf(((const float*)x)[i]); break;
      case 9: ((double*)out)[i] = sin(((const double*)x)[i]); break;
    }
  }
}

#define CUDA_EMU_EXPORT(K, T)                                                                                \
  CUDA_EMU_API int emu_##K##__##T(::emu::Launch* launch, void** args) { return ::emu::run(launch, &K<T>, args); } \
  CUDA_EMU_API const char* emu_##K##__##T##_sig() { return ::emu::sig_of(&K<T>); }                         \
  CUDA_EMU_API const char* emu_##K##__##T##_ro() { return ::emu::ro_of(&K<T>); }
