// Which device a rank computes on, and the one-rank-per-GPU rule of NCCL.
//
// Pure functions of the node's facts (local rank, visible devices, the GPU
// each local rank picked) so the rules are testable without a GPU; the
// Runtime gathers the facts and applies them at start-up.
#pragma once

#include <c10/core/Device.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace fsdp::detail {

enum class DeviceRequest { Auto, Cpu, Cuda };

// "auto", "cpu" or "cuda"; anything else is an ArgumentError naming
// `argument` (the variable or option it came from).
DeviceRequest parse_device_request(const std::string& text, const std::string& argument);

// Cpu -> cpu. Auto -> cpu without visible CUDA devices, else like Cuda.
// Cuda -> cuda:<local_rank % device_count>: with one visible GPU per rank
// (per-task binding, CUDA_VISIBLE_DEVICES set per rank) that is cuda:0.
// Cuda without a visible device is a StateError.
c10::Device choose_device(DeviceRequest request, int local_rank, int device_count);

// ids[r]: the physical GPU (PCI bus id) local rank r chose. NCCL refuses two
// ranks of a communicator on one GPU ("duplicate GPU"), so a shared GPU is
// an error at start-up rather than at the first collective: the message
// names the local ranks, the device count and what to do. Empty if every
// rank has a GPU of its own.
std::string shared_gpu_error(const std::vector<std::string>& ids, int device_count);

// --- Slurm: the task's environment, read as facts --------------------------
//
// The environment as a lookup: the value of a variable, nullptr when unset.
// The Runtime passes std::getenv; tests pass a map.
using EnvLookup = std::function<const char*(const char*)>;

// What the environment says about this task's GPUs (Slurm sets all of it;
// CUDA_VISIBLE_DEVICES may also come from the user).
//
// Malformed values never throw here: they are hints (the device itself comes
// from the MPI local rank and LibTorch's device count), so a value that does
// not parse is unknown (-1), and `malformed` names it, e.g.
// "SLURM_LOCALID='abc'", for the description. CUDA_VISIBLE_DEVICES is read
// as CUDA reads it: a comma list of indices or GPU-/MIG- UUIDs, of which CUDA
// enumerates only the entries before the first invalid one (so ",," and "-1"
// hide every GPU: visible_count 0, and malformed names the value).
struct SlurmGpuFacts {
  bool under_slurm = false;     // SLURM_JOB_ID or SLURM_STEP_ID set (non-empty)
  bool visible_set = false;     // CUDA_VISIBLE_DEVICES set, even if empty
  std::string visible_text;     // its value as given
  int visible_count = -1;       // GPUs CUDA_VISIBLE_DEVICES lets CUDA see; -1 unset (all);
                                // 0 for "", "NoDevFiles", or a malformed first entry
  int local_id = -1;            // SLURM_LOCALID; -1 unset or malformed
  int gpus_per_task = -1;       // SLURM_GPUS_PER_TASK ("[type:]<n>"); -1 unset or malformed
  int gpus_on_node = -1;        // SLURM_GPUS_ON_NODE; -1 unset or malformed
  std::string node_gpus;        // SLURM_STEP_GPUS, else SLURM_JOB_GPUS (node's GPU indices)
  int ntasks_per_node = -1;     // SLURM_NTASKS_PER_NODE (set by --ntasks-per-node); -1 unknown
  std::vector<std::string> malformed;  // "NAME='value'" for each value read as unknown

  // Slurm gave this task no GPU: CUDA_VISIBLE_DEVICES empty or NoDevFiles
  // (or malformed from its first entry).
  bool no_gpu_given() const { return visible_set && visible_count == 0; }
};

SlurmGpuFacts read_slurm_gpu_facts(const EnvLookup& env);
SlurmGpuFacts read_slurm_gpu_facts(const std::map<std::string, std::string>& env);

// The device and why, in one line: device.str() + " (" + reason + ")", e.g.
// "cuda:0 (Slurm per-task binding: CUDA_VISIBLE_DEVICES=2, 1 GPU per task)".
struct DeviceChoice {
  c10::Device device{c10::kCPU};
  std::string description;
};

// choose_device's rule (cpu for Cpu, or Auto without a visible GPU; else
// cuda:<local_rank % device_count>) with the reason, and the Slurm mistakes
// refused before NCCL would:
//  - Cuda under Slurm with no GPU visible (CUDA_VISIBLE_DEVICES empty /
//    NoDevFiles / unset, device_count 0): StateError "Slurm gave this task no
//    GPU", suggesting srun --gpus-per-task=1 or --gres=gpu:<n>. Outside
//    Slurm, choose_device's StateError.
//  - Auto/Cuda under Slurm with local_size > device_count > 1 and no
//    per-task binding (every rank sees the same node-wide list, so ranks
//    would share GPUs): StateError naming both counts, suggesting
//    --gpus-per-task=1 or fewer --ntasks-per-node. Per-task binding is
//    SLURM_GPUS_PER_TASK >= device_count, or fewer GPUs visible than
//    SLURM_GPUS_ON_NODE; with 1 visible GPU the rule never fires (each task
//    may see its own; shared_gpu_error checks the PCI ids).
// SLURM_LOCALID different from local_rank is not an error (the MPI node split
// is authoritative): the description says so, as it names malformed values.
DeviceChoice explain_device_choice(DeviceRequest request, int local_rank, int local_size,
                                   int device_count, const SlurmGpuFacts& facts);

// The description of the device the Runtime bound (empty before a Runtime).
const std::string& bound_device_description();
void set_bound_device_description(std::string description);

}  // namespace fsdp::detail
