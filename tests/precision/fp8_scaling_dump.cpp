// Reads requests from stdin, one per line, and prints accel::fp8's answers as hexadecimal floats (exact), one
// line each, for tests/python/fp8_scaling_check.py to compare with torchao's functions:
//   rows  E4M3|E5M2 ROUND ROWS COLS V...  -> the row-wise scales (ROWS 1: the tensor-wise scale)
//   cast  E4M3|E5M2 V...                  -> round_to_fp8 of each value
#include "accel/precision/fp8_scaling.hpp"

#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

accel::fp8::Dtype dtype_of(const std::string& name) {
  return name == "E4M3" ? accel::fp8::Dtype::E4M3 : accel::fp8::Dtype::E5M2;
}

void print(const std::vector<float>& values) {
  for (std::size_t i = 0; i < values.size(); ++i)
    std::printf(i ? " %a" : "%a", static_cast<double>(values[i]));
  std::printf("\n");
}

}  // namespace

int main() {
  std::string line;
  while (std::getline(std::cin, line)) {
    std::istringstream in(line);
    std::string kind, dtype;
    in >> kind >> dtype;
    if (kind == "rows") {
      int round = 0;
      std::size_t rows = 0, cols = 0;
      in >> round >> rows >> cols;
      std::vector<float> values(rows * cols);
      for (float& v : values)
        in >> v;
      print(accel::fp8::rowwise_scales(values.data(), rows, cols, dtype_of(dtype), round != 0));
    } else if (kind == "cast") {
      std::vector<float> out;
      float v = 0;
      while (in >> v)
        out.push_back(accel::fp8::round_to_fp8(v, dtype_of(dtype)));
      print(out);
    } else {
      std::fprintf(stderr, "unknown request '%s'\n", kind.c_str());
      return 2;
    }
  }
  return 0;
}
