// A routing layer's (row, slot) pairs grouped by expert, as both builds run their
// experts (ref_ops.cpp moe_layer, cpu_ops.cpp experts_combined): a counting sort, so
// each expert's pairs keep their row order, and the copies of its rows in and out.
// A header of the kernels' folder: cpp_build's digest hashes it with each source.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace gateeng {

struct ExpertGroups {
  int64_t k;                    // slots per row: pair p is row p / k's slot p % k
  std::vector<int64_t> start;   // expert e's pairs are order[start[e] .. start[e + 1])
  std::vector<int64_t> order;   // the pairs, grouped by expert
  std::vector<int64_t> active;  // the experts with a pair, ascending
  // ids [rows * k]: each pair's expert.
  ExpertGroups(const int64_t* ids, int64_t rows, int64_t k, int64_t experts)
      : k(k), start(experts + 1, 0), order(rows * k) {
    const int64_t pairs = rows * k;
    for (int64_t p = 0; p < pairs; ++p) {
      TORCH_CHECK(ids[p] >= 0 && ids[p] < experts, "expert id out of range");
      ++start[ids[p] + 1];
    }
    for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
    std::vector<int64_t> at(start.begin(), start.end() - 1);
    for (int64_t p = 0; p < pairs; ++p) order[at[ids[p]]++] = p;
    for (int64_t e = 0; e < experts; ++e)
      if (start[e + 1] > start[e]) active.push_back(e);
  }
  int64_t rows(int64_t e) const { return start[e + 1] - start[e]; }
  // Expert e's input: the row of x [rows][h] (bf16 bits) of each of its pairs, in order.
  void gather(int64_t e, const uint16_t* x, int64_t h, uint16_t* out) const {
    for (int64_t i = 0; i < rows(e); ++i) std::memcpy(out + i * h, x + order[start[e] + i] / k * h, h * sizeof(uint16_t));
  }
  // Expert e's output rows (in its pairs' order) to their pairs' places in y [rows * k][h].
  void scatter(int64_t e, const uint16_t* out, int64_t h, uint16_t* y) const {
    for (int64_t i = 0; i < rows(e); ++i) std::memcpy(y + order[start[e] + i] * h, out + i * h, h * sizeof(uint16_t));
  }
};

}  // namespace gateeng
