// Non-temporal ("streaming") stores for the outputs of CPU kernels.
//
// A plain store first reads its cache line from memory (a read for ownership), so writing an
// output moves twice its bytes. A non-temporal store writes whole lines without that read and
// leaves them out of the caches. That pays where the output would leave the caches before it is
// read again anyway: where a call moves more bytes than the last-level cache holds. Below that
// the reader would have found the output in the cache (a 4096 x 512 float32 LayerNorm backward
// followed by a read of dx: 10-20% slower streamed on a 2-core AMD EPYC VM, benchmarks/NOTES.md).
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FF_STREAM_STORES 1
#endif

namespace fastformer {

// Whether this build has non-temporal stores (x86-64 with GCC or clang).
#ifdef FF_STREAM_STORES
constexpr bool kHasStreamStores = true;
#else
constexpr bool kHasStreamStores = false;
#endif

// The size of the last-level cache a core shares, in bytes: Linux's entry for cpu0's level-3
// cache, else 32 MiB. (glibc's sysconf(_SC_LEVEL3_CACHE_SIZE) read 320 MiB on a VM whose L3 is
// 32 MiB.)
inline int64_t llc_bytes() {
  static const int64_t bytes = [] {
    int64_t size = int64_t{32} << 20;
    if (FILE* f = std::fopen("/sys/devices/system/cpu/cpu0/cache/index3/size", "r")) {
      long long value = 0;
      char unit = 'K';
      if (std::fscanf(f, "%lld%c", &value, &unit) >= 1 && value > 0) {
        size = unit == 'M' ? value << 20 : unit == 'K' ? value << 10 : value;
      }
      std::fclose(f);
    }
    return size;
  }();
  return bytes;
}

// Writes the 16 bytes at src to dst, which must be 16-byte aligned, with a non-temporal store
// (plainly where the build has none).
inline void stream16(void* dst, const void* src) {
#ifdef FF_STREAM_STORES
  __m128i v;
  std::memcpy(&v, src, sizeof(v));
  _mm_stream_si128(static_cast<__m128i*>(dst), v);
#else
  std::memcpy(dst, src, 16);
#endif
}

// Writes the 16 bytes at src to dst: with stream16 when kStream, else plainly (any alignment).
template <bool kStream>
inline void put16(void* dst, const void* src) {
  if constexpr (kStream) {
    stream16(dst, src);
  } else {
    std::memcpy(dst, src, 16);
  }
}

// Orders this thread's non-temporal stores before its later ones: a task calls it once its
// rows are written, before the parallel loop's join hands them to the caller.
inline void stream_fence() {
#ifdef FF_STREAM_STORES
  _mm_sfence();
#endif
}

}  // namespace fastformer
