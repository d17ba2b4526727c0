// The CUDA emulator's scheduler, shared memory, runtime shims and UBSan hooks (see emu.h).
#define EMU_RUNTIME_IMPLEMENTATION
#include "emu.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdio>
#include <deque>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace emu {
namespace detail {

ThreadCtx* g_cur = nullptr;

namespace {

constexpr int kWarp = 32;
constexpr int kMaxThreads = 1024;
constexpr size_t kStaticSmemLimit = 48 * 1024;          // static __shared__ per block
constexpr size_t kDefaultDynamicSmemLimit = 48 * 1024;  // without cudaFuncSetAttribute
constexpr size_t kGuard = 1024;                          // poisoned bytes after shared arrays
constexpr size_t kStackBytes = 128 * 1024;
constexpr unsigned char kPoison = 0xFF;  // NaN in fp32, fp16 and bf16

enum class State : uint8_t { kReady, kSync, kWarp, kDone };

struct Fiber {
  ucontext_t ctx;
  char* stack = nullptr;  // mapping of kStackBytes + one guard page
  ThreadCtx tc{};
  State st = State::kReady;
  // Pending warp collective of this lane.
  const void* in = nullptr;
  void* out = nullptr;
  size_t bytes = 0;
  int src = -1;
  bool vote = false;
  // cp.async copies: started since the last commit, and the committed groups not yet landed
  // (oldest first; they land at a wait).
  struct Copy {
    unsigned char* dst;
    unsigned char bytes[16];
  };
  std::vector<Copy> open_copies;
  std::deque<std::vector<Copy>> copy_groups;
};

struct WarpState {
  unsigned arrived = 0;  // lanes waiting in the current collective
  unsigned mask = 0;
  const char* op = nullptr;
  size_t bytes = 0;
  unsigned exists = 0;  // lanes of this warp that exist in the block
  unsigned exited = 0;
};

struct SharedSlot {
  const void* key;
  size_t offset;
  size_t bytes;
};

struct Block {
  std::vector<Fiber*> fibers;  // by linear thread id
  std::vector<int> order;      // fiber indices in scheduling order
  std::vector<std::vector<Fiber*>> warp_order;  // each warp's fibers, in `order`
  size_t cursor = 0;  // no fiber before this position of `order` can run
  std::vector<WarpState> warps;
  int live = 0;
  int sync_arrived = 0;
  const char* sync_file = nullptr;
  int sync_line = 0;
  std::string error;
  ucontext_t sched;
  void (*thunk)(void*) = nullptr;
  void* ctx = nullptr;
  // Shared memory of the block: static arrays, then the dynamic buffer.
  std::vector<unsigned char> static_smem;
  std::vector<SharedSlot> slots;
  size_t static_used = 0;
  std::vector<unsigned char> dynamic_smem;
  size_t dynamic_bytes = 0;
};

struct LaunchState {
  std::string name;  // the kernel's __PRETTY_FUNCTION__, from its first thread
  bool named = false;
};

Config g_config;
Block* g_block = nullptr;
LaunchState* g_launch = nullptr;
std::vector<Fiber*> g_pool;
std::string g_log;
std::string g_memory_error;
// cudaFuncAttributeMaxDynamicSharedMemorySize, per (device, kernel) as CUDA keeps it: a grant on
// one device must not change another's (the launchers cache their grants per device too).
std::map<std::pair<int, const void*>, int> g_max_dynamic_smem;

std::string dims(const dim3& d) {
  return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

// The running thread, for messages (the launch and block are named by run_block).
std::string where() {
  if (g_cur == nullptr) return "host code";
  return "thread " + dims(dim3(g_cur->tid.x, g_cur->tid.y, g_cur->tid.z));
}

Fiber* fiber_of(const ThreadCtx* tc) {
  return reinterpret_cast<Fiber*>(reinterpret_cast<char*>(const_cast<ThreadCtx*>(tc)) -
                                  offsetof(Fiber, tc));
}

Fiber* new_fiber() {
  auto* f = new Fiber();
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* mem = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (mem == MAP_FAILED) throw std::runtime_error("cuda_emu: cannot map a fiber stack");
  mprotect(mem, page, PROT_NONE);  // a stack overflow faults instead of corrupting memory
  f->stack = static_cast<char*>(mem) + page;
  if (getcontext(&f->ctx) != 0) throw std::runtime_error("cuda_emu: getcontext failed");
  return f;
}

// Scheduling is warp-greedy: the fibers of the running warp keep the CPU (in `order`) until
// all of them wait at __syncthreads or have exited; then the first runnable fiber in `order`
// gets it. After a barrier releases, the first fibers in `order` run first. So in forward order
// warp 0 runs a whole barrier interval before warp 1 starts it, in reverse order the last warp
// does: a read of shared memory another warp writes in the same interval (or the other way
// round) sees the wrong value in one of the two orders, whatever the direction of the hazard.

// The first runnable fiber of `warp` in order, or null.
Fiber* ready_in_warp(int warp) {
  for (Fiber* f : g_block->warp_order[warp]) {
    if (f->st == State::kReady) return f;
  }
  return nullptr;
}

// The first runnable fiber in order, or null.
Fiber* first_ready() {
  Block& b = *g_block;
  for (; b.cursor < b.order.size(); ++b.cursor) {
    Fiber* f = b.fibers[b.order[b.cursor]];
    if (f->st == State::kReady) return f;
  }
  return nullptr;
}

// Releases the threads waiting at __syncthreads.
void release_barrier() {
  Block& b = *g_block;
  for (Fiber* f : b.fibers) {
    if (f->st == State::kSync) f->st = State::kReady;
  }
  b.sync_arrived = 0;
  b.cursor = 0;
}

// Gives the CPU from `me` (blocked, done or still runnable) to `next`, or to the scheduler when
// next is null (it then finds the block finished, deadlocked or failed).
void switch_to(Fiber* me, Fiber* next) {
  Block& b = *g_block;
  if (next == me) return;
  if (next != nullptr && b.error.empty()) {
    g_cur = &next->tc;
    swapcontext(&me->ctx, &next->ctx);
  } else {
    g_cur = nullptr;
    swapcontext(&me->ctx, &b.sched);
  }
  g_cur = &me->tc;
}

// Leaves `me` (blocked or done) for the next fiber of the policy.
void switch_away(Fiber* me) {
  Fiber* next = ready_in_warp(me->tc.warp);
  switch_to(me, next != nullptr ? next : first_ready());
}

Fiber* me() { return fiber_of(&cur()); }

// "{0-4,7}": the lanes of a mask, as ranges.
std::string lanes_of(unsigned mask) {
  std::string s;
  for (int l = 0; l < kWarp;) {
    if (!(mask & (1u << l))) {
      ++l;
      continue;
    }
    int e = l;
    while (e + 1 < kWarp && (mask & (1u << (e + 1)))) ++e;
    s += (s.empty() ? "" : ",") + std::to_string(l) + (e > l ? "-" + std::to_string(e) : "");
    l = e + 1;
  }
  return "{" + s + "}";
}

// Completes the warp collective once every lane of its mask has arrived.
void complete_warp(WarpState& w, int warp) {
  Block& b = *g_block;
  if (w.arrived != w.mask) return;
  const unsigned mask = w.mask;
  if (w.op != nullptr && std::strcmp(w.op, "__vote") == 0) {
    unsigned bits = 0;
    for (int l = 0; l < kWarp; ++l) {
      if (mask & (1u << l)) bits |= b.fibers[warp * kWarp + l]->vote ? (1u << l) : 0u;
    }
    for (int l = 0; l < kWarp; ++l) {
      if (mask & (1u << l)) *static_cast<unsigned*>(b.fibers[warp * kWarp + l]->out) = bits;
    }
  } else {
    for (int l = 0; l < kWarp; ++l) {
      if (!(mask & (1u << l))) continue;
      Fiber* f = b.fibers[warp * kWarp + l];
      const int src = f->src < 0 ? l : f->src;
      if (src >= kWarp || !(mask & (1u << src))) {
        fail((std::string(w.op) + ": lane " + std::to_string(l) + " reads lane " +
              std::to_string(src) + ", which is not in the mask " + lanes_of(mask))
                 .c_str());
      }
      std::memcpy(f->out, b.fibers[warp * kWarp + src]->in, w.bytes);
    }
  }
  for (int l = 0; l < kWarp; ++l) {
    if (mask & (1u << l)) b.fibers[warp * kWarp + l]->st = State::kReady;
  }
  b.cursor = 0;
  w.arrived = 0;
  w.mask = 0;
  w.op = nullptr;
}

void arrive_warp(unsigned mask, const char* op, size_t bytes) {
  Block& b = *g_block;
  Fiber* f = me();
  const int lane = f->tc.lane, warp = f->tc.warp;
  WarpState& w = b.warps[warp];
  const std::string name(op);
  if (!(mask & (1u << lane))) {
    fail((name + ": the calling lane " + std::to_string(lane) + " is not in the mask " +
          lanes_of(mask))
             .c_str());
  }
  if (mask & ~w.exists) {
    fail((name + ": the mask names lanes " + lanes_of(mask & ~w.exists) +
          " that do not exist in this block (partial warp)")
             .c_str());
  }
  if (mask & w.exited) {
    fail((name + ": the mask names lanes " + lanes_of(mask & w.exited) + " that already exited")
             .c_str());
  }
  if (w.arrived == 0) {
    w.mask = mask;
    w.op = op;
    w.bytes = bytes;
  } else if (w.mask != mask || std::strcmp(w.op, op) != 0 || w.bytes != bytes) {
    fail((name + " with mask " + lanes_of(mask) + " meets lanes " + lanes_of(w.arrived) +
          " waiting in " + w.op + " with mask " + lanes_of(w.mask) +
          ": the lanes of a warp run different collectives")
             .c_str());
  }
  w.arrived |= 1u << lane;
  if (w.arrived == w.mask) {
    complete_warp(w, warp);
    switch_to(f, ready_in_warp(warp));  // the lanes go on in order (the last may be first)
    return;
  }
  f->st = State::kWarp;
  switch_away(f);
}

void exit_fiber(Fiber* f) {
  Block& b = *g_block;
  WarpState& w = b.warps[f->tc.warp];
  const unsigned bit = 1u << f->tc.lane;
  f->st = State::kDone;
  --b.live;
  w.exited |= bit;
  if (b.error.empty() && w.arrived != 0 && (w.mask & bit)) {
    b.error = where() + ": exited while lanes " + lanes_of(w.arrived) + " wait for it in " +
              w.op + " (mask " + lanes_of(w.mask) + ")";
  }
  if (b.error.empty() && b.sync_arrived > 0 && b.sync_arrived == b.live) {
    // The rest of the block waits at __syncthreads: exited threads do not hold it up.
    release_barrier();
  }
}

void fiber_main(int index) {
  Block& b = *g_block;
  Fiber* f = b.fibers[index];
  try {
    b.thunk(b.ctx);
  } catch (const std::exception& e) {
    if (b.error.empty()) b.error = where() + ": " + e.what();
  } catch (...) {
    if (b.error.empty()) b.error = where() + ": unknown exception";
  }
  exit_fiber(f);
  switch_away(f);  // never resumed
  std::abort();
}

std::string deadlock_report(const Block& b) {
  int at_sync = 0, at_warp = 0, done = 0;
  std::string warps;
  for (size_t i = 0; i < b.warps.size(); ++i) {
    const WarpState& w = b.warps[i];
    if (w.arrived != 0) {
      warps += " warp " + std::to_string(i) + ": lanes " + lanes_of(w.arrived) + " in " +
               w.op + " waiting for " + lanes_of(w.mask & ~w.arrived) + ";";
    }
  }
  for (const Fiber* f : b.fibers) {
    at_sync += f->st == State::kSync;
    at_warp += f->st == State::kWarp;
    done += f->st == State::kDone;
  }
  std::string s = "deadlock: " + std::to_string(at_sync) + " threads at __syncthreads";
  if (b.sync_file != nullptr) {
    s += " (" + std::string(b.sync_file) + ":" + std::to_string(b.sync_line) + ")";
  }
  s += ", " + std::to_string(at_warp) + " in warp collectives, " + std::to_string(done) +
       " exited;" + warps;
  return s;
}

void run_block(Block& b, const dim3& grid, const dim3& block, const uint3& bid) {
  const int n = static_cast<int>(block.x * block.y * block.z);
  b.live = n;
  b.sync_arrived = 0;
  b.sync_file = nullptr;
  b.error.clear();
  std::fill(b.static_smem.begin(), b.static_smem.end(), kPoison);
  std::fill(b.dynamic_smem.begin(), b.dynamic_smem.end(), kPoison);
  b.slots.clear();
  b.static_used = 0;
  for (WarpState& w : b.warps) {
    w.arrived = w.mask = w.exited = 0;
    w.op = nullptr;
  }
  for (int i = 0; i < n; ++i) {
    Fiber* f = b.fibers[i];
    f->st = State::kReady;
    // What the last block left unwaited (a GPU lets it land unread).
    f->open_copies.clear();
    f->copy_groups.clear();
    f->tc.tid = make_uint3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
    f->tc.bid = bid;
    f->tc.bdim = block;
    f->tc.gdim = grid;
    f->tc.linear = i;
    f->tc.lane = i % kWarp;
    f->tc.warp = i / kWarp;
    f->ctx.uc_stack.ss_sp = f->stack;
    f->ctx.uc_stack.ss_size = kStackBytes;
    f->ctx.uc_link = nullptr;
    makecontext(&f->ctx, reinterpret_cast<void (*)()>(&fiber_main), 1, i);
  }
  b.cursor = 0;
  for (;;) {
    Fiber* first = first_ready();
    if (first == nullptr || !b.error.empty()) break;
    g_cur = &first->tc;
    swapcontext(&b.sched, &first->ctx);
    g_cur = nullptr;
  }
  g_cur = nullptr;
  if (b.error.empty() && b.live > 0) b.error = deadlock_report(b);
  if (b.error.empty()) {
    // The gaps after each static array and the unused tail must still be poison.
    for (size_t k = 0; k < b.slots.size() && b.error.empty(); ++k) {
      const size_t begin = b.slots[k].offset + b.slots[k].bytes;
      const size_t end = k + 1 < b.slots.size() ? b.slots[k + 1].offset : b.static_smem.size();
      for (size_t i = begin; i < end; ++i) {
        if (b.static_smem[i] != kPoison) {
          b.error = "static __shared__ memory written past an array (" + std::to_string(i - begin) +
                    " bytes after one of " + std::to_string(b.slots[k].bytes) + " bytes)";
          break;
        }
      }
    }
  }
  if (b.error.empty()) {
    for (size_t i = b.dynamic_bytes; i < b.dynamic_smem.size(); ++i) {
      if (b.dynamic_smem[i] != kPoison) {
        b.error = "dynamic shared memory written past its " + std::to_string(b.dynamic_bytes) +
                  " bytes (at byte " + std::to_string(i) + ")";
        break;
      }
    }
  }
  if (!b.error.empty()) {
    std::string msg = "cuda_emu: " + (g_launch != nullptr ? g_launch->name : std::string()) +
                      " block " + dims(dim3(bid.x, bid.y, bid.z)) + ": " + b.error;
    throw std::runtime_error(msg);
  }
}

}  // namespace

void fail(const char* what) {
  if (g_block != nullptr && g_cur != nullptr) {
    Block& b = *g_block;
    Fiber* f = me();
    if (b.error.empty()) b.error = where() + ": " + what;
    f->st = State::kDone;  // abandoned: the scheduler stops the block and reports
    g_cur = nullptr;
    swapcontext(&f->ctx, &b.sched);
    std::abort();  // never resumed
  }
  throw std::runtime_error(std::string("cuda_emu: ") + what);
}

void syncthreads(const char* file, int line) {
  Block& b = *g_block;
  Fiber* f = me();
  if (b.sync_arrived == 0) {
    b.sync_file = file;
    b.sync_line = line;
  } else if (b.sync_line != line || std::strcmp(b.sync_file, file) != 0) {
    fail(("__syncthreads at " + std::string(file) + ":" + std::to_string(line) +
          " meets threads waiting at " + b.sync_file + ":" + std::to_string(b.sync_line) +
          ": divergent barriers")
             .c_str());
  }
  const unsigned waiting = b.warps[f->tc.warp].arrived;
  if (waiting != 0 && (b.warps[f->tc.warp].mask & (1u << f->tc.lane))) {
    fail(("__syncthreads while lanes " + lanes_of(waiting) + " of this warp wait for it in " +
          b.warps[f->tc.warp].op)
             .c_str());
  }
  if (++b.sync_arrived == b.live) {
    release_barrier();
    switch_to(f, first_ready());  // the block restarts in order (f may be first)
    return;
  }
  f->st = State::kSync;
  switch_away(f);
}

void warp_exchange(unsigned mask, const void* in, void* out, size_t bytes, int src,
                   const char* op) {
  Fiber* f = me();
  f->in = in;
  f->out = out;
  f->bytes = bytes;
  f->src = src;
  arrive_warp(mask, op, bytes);
}

unsigned warp_vote(unsigned mask, bool pred, const char* op) {
  (void)op;
  Fiber* f = me();
  unsigned result = 0;
  f->vote = pred;
  f->out = &result;
  arrive_warp(mask, "__vote", sizeof(unsigned));
  return result;
}

void* block_shared(const void* key, size_t bytes, size_t align) {
  Block& b = *g_block;
  for (const SharedSlot& s : b.slots) {
    if (s.key == key) return b.static_smem.data() + s.offset;
  }
  const size_t a = std::max<size_t>(align, 16);
  const size_t offset = (b.static_used + a - 1) / a * a;
  if (offset + bytes > kStaticSmemLimit) {
    fail(("static __shared__ memory of the block exceeds " + std::to_string(kStaticSmemLimit) +
          " bytes")
             .c_str());
  }
  b.slots.push_back({key, offset, bytes});
  b.static_used = offset + bytes + 64;  // poisoned gap: writes past an array are caught
  return b.static_smem.data() + offset;
}

// Whether [p, p + bytes) lies in the block's static arrays or its dynamic shared memory.
bool in_shared(const void* p, size_t bytes) {
  const Block& b = *g_block;
  const auto inside = [&](const std::vector<unsigned char>& v, size_t used) {
    const auto* c = static_cast<const unsigned char*>(p);
    return c >= v.data() && c + bytes <= v.data() + used;
  };
  return inside(b.static_smem, b.static_used) || inside(b.dynamic_smem, b.dynamic_bytes);
}

void* dynamic_shared(size_t align) {
  (void)align;  // the buffer is 64-byte aligned
  return g_block->dynamic_smem.data();
}

void kernel_entry(const char* name, int max_threads) {
  if (!g_launch->named) {
    g_launch->named = true;
    g_launch->name = name;
    g_log += name;
  }
  const dim3& d = cur().bdim;
  if (max_threads > 0 && static_cast<int>(d.x * d.y * d.z) > max_threads) {
    fail(("launched with " + std::to_string(d.x * d.y * d.z) +
          " threads a block, over its __launch_bounds__ of " + std::to_string(max_threads))
             .c_str());
  }
}

void run_grid(dim3 grid, dim3 block, size_t smem, const void* kernel, void (*thunk)(void*),
              void* ctx) {
  if (g_block != nullptr) {  // one OS thread runs one launch at a time
    throw std::runtime_error("cuda_emu: a kernel launched while another runs");
  }
  if (g_log.size() > (size_t{1} << 20)) g_log.erase(0, g_log.find('\n', g_log.size() / 2) + 1);
  const std::string shape = " grid=" + dims(grid) + " block=" + dims(block) +
                            " smem=" + std::to_string(smem);
  auto bad = [&](const std::string& why) {
    throw std::runtime_error("cuda_emu: invalid launch" + shape + ": " + why);
  };
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0) bad("an empty dimension");
  if (threads > kMaxThreads || block.x > 1024 || block.y > 1024 || block.z > 64) {
    bad("more than 1024 threads a block (or a block dimension over its limit)");
  }
  if (grid.x > 2147483647u || grid.y > 65535 || grid.z > 65535) bad("grid over its limits");
  const auto it = g_max_dynamic_smem.find({g_config.device, kernel});
  const size_t dyn_limit =
      it != g_max_dynamic_smem.end() ? static_cast<size_t>(it->second) : kDefaultDynamicSmemLimit;
  if (smem > dyn_limit) {
    bad("dynamic shared memory over " + std::to_string(dyn_limit) +
        " bytes (raise it with cudaFuncSetAttribute, up to the device's opt-in limit)");
  }
  if (!g_memory_error.empty()) {
    const std::string e = g_memory_error;
    g_memory_error.clear();
    throw std::runtime_error("cuda_emu: before launch" + shape + ": " + e);
  }
  LaunchState launch;
  Block b;
  b.thunk = thunk;
  b.ctx = ctx;
  b.static_smem.assign(kStaticSmemLimit + kGuard, kPoison);
  b.dynamic_bytes = smem;
  b.dynamic_smem.assign(smem + kGuard, kPoison);
  const int n = static_cast<int>(threads);
  while (static_cast<int>(g_pool.size()) < n) g_pool.push_back(new_fiber());
  b.fibers.assign(g_pool.begin(), g_pool.begin() + n);
  b.order.resize(n);
  for (int i = 0; i < n; ++i) b.order[i] = i;
  if (g_config.order == Order::kReverse) std::reverse(b.order.begin(), b.order.end());
  std::mt19937_64 rng(g_config.shuffle_seed);
  b.warps.assign((n + kWarp - 1) / kWarp, WarpState{});
  b.warp_order.assign(b.warps.size(), {});
  for (int i = 0; i < n; ++i) b.warps[i / kWarp].exists |= 1u << (i % kWarp);
  g_launch = &launch;
  g_block = &b;
  // Blocks run one after another: in order, in reverse (a block that reads what a later
  // block writes is caught by one of the two) or in a random order (up to 2^20 blocks).
  const uint64_t blocks = uint64_t{grid.x} * grid.y * grid.z;
  std::vector<uint64_t> block_order;
  if (g_config.order == Order::kShuffled && blocks <= (uint64_t{1} << 20)) {
    block_order.resize(blocks);
    for (uint64_t i = 0; i < blocks; ++i) block_order[i] = i;
    std::shuffle(block_order.begin(), block_order.end(), rng);
  }
  try {
    for (uint64_t k = 0; k < blocks; ++k) {
      uint64_t i = g_config.order == Order::kReverse ? blocks - 1 - k : k;
      if (!block_order.empty()) i = block_order[k];
      const uint3 bid = make_uint3(static_cast<unsigned>(i % grid.x),
                                   static_cast<unsigned>(i / grid.x % grid.y),
                                   static_cast<unsigned>(i / (uint64_t{grid.x} * grid.y)));
      if (g_config.order == Order::kShuffled || k == 0) {
        if (g_config.order == Order::kShuffled) {
          std::shuffle(b.order.begin(), b.order.end(), rng);
        }
        for (auto& lanes : b.warp_order) lanes.clear();
        for (int t = 0; t < n; ++t) {
          b.warp_order[b.order[t] / kWarp].push_back(b.fibers[b.order[t]]);
        }
      }
      run_block(b, grid, block, bid);
    }
  } catch (...) {
    g_block = nullptr;
    g_launch = nullptr;
    g_cur = nullptr;
    if (!launch.named) g_log += "(unnamed kernel)";
    g_log += shape + " FAILED\n";
    throw;
  }
  g_block = nullptr;
  g_launch = nullptr;
  if (!launch.named) g_log += "(unnamed kernel)";
  g_log += shape + "\n";
}

// Records the first memory error a UBSan hook reports during a kernel: the block then fails.
void memory_error(const std::string& what) {
  // In a kernel the thread stops here, before the access (an aligned SSE load of a misaligned
  // address would crash the process); host code can only be reported afterwards.
  if (g_block != nullptr && g_cur != nullptr) fail(what.c_str());
  if (g_memory_error.empty()) g_memory_error = what + " (host code)";
}

}  // namespace detail

Config& config() { return detail::g_config; }

const char* launch_log() { return detail::g_log.c_str(); }

void clear_launch_log() { detail::g_log.clear(); }

void check_no_pending_error() {
  if (detail::g_memory_error.empty()) return;
  const std::string e = detail::g_memory_error;
  detail::g_memory_error.clear();
  throw std::runtime_error("cuda_emu: " + e);
}

// ------------------------------------------------------------------ cp.async

void copy16_async(void* dst, const void* src) {
  detail::Fiber* f = detail::me();
  if (reinterpret_cast<uintptr_t>(dst) % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0) {
    detail::fail("cp.async of 16 bytes with a misaligned address");
  }
  if (!detail::in_shared(dst, 16)) detail::fail("cp.async to an address outside shared memory");
  detail::Fiber::Copy c{static_cast<unsigned char*>(dst), {}};
  std::memcpy(c.bytes, src, 16);
  f->open_copies.push_back(c);
}

void commit_async_copies() {
  detail::Fiber* f = detail::me();
  f->copy_groups.push_back(std::move(f->open_copies));
  f->open_copies.clear();
}

void wait_async_copies(int pending) {
  detail::Fiber* f = detail::me();
  while (f->copy_groups.size() > static_cast<size_t>(std::max(pending, 0))) {
    for (const detail::Fiber::Copy& c : f->copy_groups.front()) std::memcpy(c.dst, c.bytes, 16);
    f->copy_groups.pop_front();
  }
}

// ------------------------------------------------------------------ runtime API shims

namespace {
cudaError_t g_last_error = cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  *device = detail::g_config.device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  detail::g_config.device = device;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  (void)device;
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *value = detail::g_config.sms;
      return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock:
      *value = 1024;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = static_cast<int>(detail::g_config.smem_optin);
      return cudaSuccess;
    case cudaDevAttrWarpSize:
      *value = 32;
      return cudaSuccess;
    default:
      g_last_error = cudaErrorInvalidValue;
      return cudaErrorInvalidValue;
  }
}

cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, const void* kernel,
                                                          int threads, size_t smem) {
  (void)kernel;
  if (detail::g_config.blocks_per_sm > 0) {
    *blocks = detail::g_config.blocks_per_sm;
    return cudaSuccess;
  }
  // 2048 threads, 32 blocks and 228 KB of shared memory an SM (registers unknown here).
  int by_threads = threads > 0 ? 2048 / threads : 0;
  int by_smem = smem > 0 ? static_cast<int>((228 * 1024) / (smem + 1024)) : 32;
  *blocks = std::max(0, std::min({by_threads, by_smem, 32}));
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute attr, int value) {
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    if (value < 0 || static_cast<size_t>(value) > detail::g_config.smem_optin) {
      g_last_error = cudaErrorInvalidValue;
      return cudaErrorInvalidValue;
    }
    detail::g_max_dynamic_smem[{detail::g_config.device, kernel}] = value;
  }
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  const cudaError_t e = g_last_error;
  g_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError() { return g_last_error; }

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  (void)stream;
  std::memset(ptr, value, bytes);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  (void)kind;
  (void)stream;
  std::memmove(dst, src, bytes);
  return cudaSuccess;
}

}  // namespace emu

// ------------------------------------------------------------------ UBSan hooks
//
// The kernel sources are compiled with -fsanitize=alignment,bounds,... but without the UBSan
// runtime: these hooks (the runtime's ABI) turn a report into a failure of the running block.
// A misaligned 16-byte vector access, which faults on the GPU and passes silently on x86, is
// the main catch.

namespace {

struct UbLoc {
  const char* file;
  uint32_t line;
  uint32_t column;
};
struct UbType {
  uint16_t kind;
  uint16_t info;
  char name[1];
};
struct UbTypeMismatch {
  UbLoc loc;
  const UbType* type;
  unsigned char log_alignment;
  unsigned char check_kind;
};
struct UbOutOfBounds {
  UbLoc loc;
  const UbType* array_type;
  const UbType* index_type;
};
struct UbOverflow {
  UbLoc loc;
  const UbType* type;
};
struct UbShift {
  UbLoc loc;
  const UbType* lhs_type;
  const UbType* rhs_type;
};

std::string at(const UbLoc& l) {
  std::string file = l.file != nullptr ? l.file : "?";
  const size_t slash = file.rfind('/');
  if (slash != std::string::npos) file = file.substr(slash + 1);
  return " at " + file + ":" + std::to_string(l.line) + ":" + std::to_string(l.column);
}

}  // namespace

extern "C" {

void __ubsan_handle_type_mismatch_v1(UbTypeMismatch* d, uintptr_t ptr) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(ptr));
  const uintptr_t align = uintptr_t{1} << d->log_alignment;
  std::string what;
  if (ptr == 0) {
    what = "null pointer access";
  } else if (ptr & (align - 1)) {
    what = "misaligned access to " + std::string(buf) + " of type " + d->type->name +
           " (needs " + std::to_string(align) + "-byte alignment; a fault on the GPU)";
  } else {
    what = "access to " + std::string(buf) + " with insufficient space for " + d->type->name;
  }
  emu::detail::memory_error(what + at(d->loc));
}
void __ubsan_handle_type_mismatch_v1_abort(UbTypeMismatch* d, uintptr_t ptr) {
  __ubsan_handle_type_mismatch_v1(d, ptr);
}

void __ubsan_handle_out_of_bounds(UbOutOfBounds* d, uintptr_t index) {
  emu::detail::memory_error("index " + std::to_string(static_cast<intptr_t>(index)) +
                            " out of bounds of " + d->array_type->name + at(d->loc));
}
void __ubsan_handle_out_of_bounds_abort(UbOutOfBounds* d, uintptr_t index) {
  __ubsan_handle_out_of_bounds(d, index);
}

void __ubsan_handle_add_overflow(UbOverflow* d, uintptr_t, uintptr_t) {
  emu::detail::memory_error(std::string("signed overflow in + of ") + d->type->name + at(d->loc));
}
void __ubsan_handle_sub_overflow(UbOverflow* d, uintptr_t, uintptr_t) {
  emu::detail::memory_error(std::string("signed overflow in - of ") + d->type->name + at(d->loc));
}
void __ubsan_handle_mul_overflow(UbOverflow* d, uintptr_t, uintptr_t) {
  emu::detail::memory_error(std::string("signed overflow in * of ") + d->type->name + at(d->loc));
}
void __ubsan_handle_negate_overflow(UbOverflow* d, uintptr_t) {
  emu::detail::memory_error(std::string("signed overflow in - of ") + d->type->name + at(d->loc));
}
void __ubsan_handle_divrem_overflow(UbOverflow* d, uintptr_t, uintptr_t) {
  emu::detail::memory_error(std::string("division overflow or by zero of ") + d->type->name +
                            at(d->loc));
}
void __ubsan_handle_shift_out_of_bounds(UbShift* d, uintptr_t, uintptr_t) {
  emu::detail::memory_error(std::string("shift out of bounds of ") + d->lhs_type->name +
                            at(d->loc));
}
void __ubsan_handle_add_overflow_abort(UbOverflow* d, uintptr_t a, uintptr_t b) {
  __ubsan_handle_add_overflow(d, a, b);
}
void __ubsan_handle_sub_overflow_abort(UbOverflow* d, uintptr_t a, uintptr_t b) {
  __ubsan_handle_sub_overflow(d, a, b);
}
void __ubsan_handle_mul_overflow_abort(UbOverflow* d, uintptr_t a, uintptr_t b) {
  __ubsan_handle_mul_overflow(d, a, b);
}
void __ubsan_handle_negate_overflow_abort(UbOverflow* d, uintptr_t a) {
  __ubsan_handle_negate_overflow(d, a);
}
void __ubsan_handle_divrem_overflow_abort(UbOverflow* d, uintptr_t a, uintptr_t b) {
  __ubsan_handle_divrem_overflow(d, a, b);
}
void __ubsan_handle_shift_out_of_bounds_abort(UbShift* d, uintptr_t a, uintptr_t b) {
  __ubsan_handle_shift_out_of_bounds(d, a, b);
}

}  // extern "C"
