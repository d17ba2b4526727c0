// Attention's dropout keep-mask on the CPU, row by row (the scheme of
// fastformer.ops.attention.dropout_keep_mask): shared by rng.cpp's attention_keep_mask and the
// torch backend's fused softmax (attention/attention_softmax.cpp).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

namespace fastformer {

// words[4 * i + k] = word k of the Philox call at counter first + i, for i < calls: the calls
// computed many at once in vector registers (rng.cpp, built per instruction set).
void philox_words_cpu(uint64_t seed, uint64_t first, int64_t calls, uint32_t* words);

// Philox calls a row of attention's dropout scheme draws: 4 per 32 key columns, at consecutive
// counters (fastformer.ops.attention.dropout_calls).
inline int64_t dropout_calls(int64_t seq_k) { return 4 * ((seq_k + 31) / 32); }

// The first Philox counter of row r of a (B, H, Lq, Lk) tensor's rows: row i of head bh draws
// at (bh << 32) + i * dropout_calls(Lk).
inline uint64_t attention_row_counter(int64_t r, int64_t seq_q, int64_t calls) {
  const auto head = static_cast<uint64_t>(r / seq_q);
  return (head << 32) + static_cast<uint64_t>(r % seq_q) * static_cast<uint64_t>(calls);
}

inline void check_threshold(int64_t threshold, const char* op) {
  TORCH_CHECK(threshold >= 0 && threshold <= 65536, op, ": threshold must be in [0, 65536], got ",
              threshold);
}

// The 16-bit draws of a row's key columns in column order, halves[j] for j < 32 * groups, from
// the row's Philox words: column 32 g + 8 w + 2 c + l takes half l of word w of call 4 g + c,
// so word w of call c, moved to place 4 w + c of its group, holds columns 8 w + 2 c and
// 8 w + 2 c + 1 as its low and high halves. A row is then compared column by column in loops
// that vectorize (a select an element at scattered columns took ~1.5x softmax's own time).
inline void column_halves(const uint32_t* words, int64_t groups, uint16_t* halves) {
  static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "halves are read little-endian");
  for (int64_t g = 0; g < groups; ++g) {
    uint32_t moved[16];
    for (int w = 0; w < 4; ++w) {
      for (int c = 0; c < 4; ++c) moved[4 * w + c] = words[16 * g + 4 * c + w];
    }
    std::memcpy(halves + 32 * g, moved, sizeof(moved));
  }
}

// Calls row_fn(r, halves, scratch) for each row r < rows, in parallel: halves, the 16-bit draws of
// row r's key columns (column_halves) from the Philox calls at counters offset(r),
// offset(r) + 1, ... (none when `draw` is false); scratch, kScratch rows of seq_k values of type
// S the call may use.
template <typename S, int kScratch, typename Offset, typename RowFn>
void for_each_keep_row(uint64_t seed, int64_t rows, int64_t seq_k, Offset offset, RowFn row_fn,
                       bool draw = true) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(seq_k, 1));
  const int64_t calls = draw ? dropout_calls(seq_k) : 0;
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> words(4 * calls);
    std::vector<uint16_t> halves(8 * calls);
    const auto scratch = std::make_unique<S[]>(kScratch * std::max<int64_t>(seq_k, 1));
    for (int64_t r = begin; r < end; ++r) {
      if (draw) {
        philox_words_cpu(seed, offset(r), calls, words.data());
        column_halves(words.data(), calls / 4, halves.data());
      }
      row_fn(r, halves.data(), scratch.get());
    }
  });
}

}  // namespace fastformer
