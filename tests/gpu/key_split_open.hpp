// Shared by the GPU tests of gla's key-block split (test_linear_layer_cuda, test_mamba2_cuda,
// test_mamba3_cuda, test_hedgehog_cuda, test_ssm_decode_cuda): its gate opened for a test's
// scope and restored after, so a failing test leaves the others as they were.
#pragma once

#include "kernels/linear/key_split_gate.hpp"

namespace lar::gpu_test {

struct KeySplitOpen {
  bool was = kernels::cuda::linear::wide_key_split_unverified_allowed();
  KeySplitOpen() { kernels::cuda::linear::wide_key_split_unverified_allowed() = true; }
  ~KeySplitOpen() { kernels::cuda::linear::wide_key_split_unverified_allowed() = was; }
  KeySplitOpen(const KeySplitOpen&) = delete;
  KeySplitOpen& operator=(const KeySplitOpen&) = delete;
};

}  // namespace lar::gpu_test
