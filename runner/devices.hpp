#pragma once
// How many cells run at once on this machine by default.
//   - cells on the cuda backend (or `auto` with a GPU present): one per visible GPU, each
//     child pinned to its GPU with CUDA_VISIBLE_DEVICES;
//   - otherwise 1: a CPU trainer already uses every core (config `threads: 0`), so running
//     two at once only makes both slower. Override with `lar launch -j N`.
#include <string>
#include <vector>

#include "experiments/cell.hpp"

namespace lar::runner {

// The GPUs this process may use, as the ids to put in a child's CUDA_VISIBLE_DEVICES:
// the entries of CUDA_VISIBLE_DEVICES when it is set (CUDA's rule: the list ends at the
// first invalid entry such as "-1"; an empty value means no GPU), else /dev/nvidia<N>.
std::vector<std::string> visible_gpus();

// True when the cell's trainer will use a GPU: backend cuda, or auto with a GPU present.
bool uses_gpu(const experiments::Cell& cell, bool gpu_present);

// The `-j` default described above.
int default_parallelism(const experiments::Plan& plan);

// GPU ids to hand out to `parallelism` concurrent jobs (round robin over the visible ones;
// empty when there is none).
std::vector<std::string> gpu_slots(int parallelism);

}  // namespace lar::runner
