// Control API of the CUDA emulator (tests/cuda_emu/emu.h): plain C++ with no CUDA macros, so
// the torch bindings can include it next to ATen.
#pragma once

#include <cstddef>
#include <cstdint>

namespace emu {

// Order of the blocks of a grid (they run one after another), and in which the fibers (CUDA
// threads) of a block get the CPU whenever several can run: both ascending, both descending,
// or both random.
enum class Order : int { kForward = 0, kReverse = 1, kShuffled = 2 };

struct Config {
  int device = 0;         // what cudaGetDevice reports (keys the launchers' occupancy caches)
  int sms = 132;          // cudaDevAttrMultiProcessorCount
  int blocks_per_sm = 0;  // cudaOccupancyMaxActiveBlocksPerMultiprocessor; 0 = from threads/smem
  Order order = Order::kForward;
  uint64_t shuffle_seed = 0;  // permutation of kShuffled
  size_t smem_optin = 227 * 1024;  // cudaDevAttrMaxSharedMemoryPerBlockOptin (sm_90's)
};

// The emulated device (one per process; the tests set it before each op).
Config& config();

// One line per kernel launch since the last clear: "name grid=(x,y,z) block=(x,y,z) smem=N".
// The name is the kernel's __PRETTY_FUNCTION__ (template arguments included).
const char* launch_log();
void clear_launch_log();

// Throws if the instrumented code (kernels or the launchers' host code) reported undefined
// behaviour (a misaligned access, an index out of bounds, a signed overflow) not yet thrown.
void check_no_pending_error();

}  // namespace emu
