// Entry point of the emulator's self-test kernels (selftest.cu).
#pragma once

#include <string>

namespace emu_selftest {

void run(const std::string& name, const float* in, float* out, int blocks, int threads, int smem);

}  // namespace emu_selftest
