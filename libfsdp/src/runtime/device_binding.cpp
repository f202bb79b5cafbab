#include "runtime/device_binding.h"

#include "fsdp/errors.h"

#include <cctype>
#include <climits>
#include <map>
#include <utility>

namespace fsdp::detail {

DeviceRequest parse_device_request(const std::string& text, const std::string& argument) {
  if (text == "auto") return DeviceRequest::Auto;
  if (text == "cpu") return DeviceRequest::Cpu;
  if (text == "cuda") return DeviceRequest::Cuda;
  throw ArgumentError(argument, argument + " = '" + text + "'; accepted: auto, cpu, cuda");
}

c10::Device choose_device(DeviceRequest request, int local_rank, int device_count) {
  if (request == DeviceRequest::Cpu || (request == DeviceRequest::Auto && device_count <= 0)) {
    return c10::Device(c10::kCPU);
  }
  if (device_count <= 0) {
    throw StateError(
        "device cuda was asked for (FSDP_DEVICE / RuntimeOptions::device) but LibTorch sees no "
        "CUDA device on this node (a CPU-only LibTorch, no GPU, or CUDA_VISIBLE_DEVICES empty)");
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank % device_count));
}

std::string shared_gpu_error(const std::vector<std::string>& ids, int device_count) {
  std::map<std::string, int> first_user;
  for (size_t r = 0; r < ids.size(); ++r) {
    const auto [it, fresh] = first_user.emplace(ids[r], static_cast<int>(r));
    if (fresh) continue;
    return "local ranks " + std::to_string(it->second) + " and " + std::to_string(r) +
           " would share GPU " + ids[r] + " (" + std::to_string(ids.size()) +
           " ranks on this node, " + std::to_string(device_count) +
           " visible CUDA device(s) each); NCCL needs one GPU per rank: start at most as many "
           "ranks per node as GPUs (srun --gpus-per-task=1, or mpirun -n <GPUs per node> per "
           "node), or set FSDP_DEVICE=cpu to keep tensors on the CPU (MPI collectives)";
  }
  return "";
}

namespace {

// A non-negative decimal int, or -1 (empty, a sign, other characters, overflow).
int parse_count(const std::string& text) {
  if (text.empty() || text.size() > 9) return -1;
  int value = 0;
  for (const char c : text) {
    if (std::isdigit(static_cast<unsigned char>(c)) == 0) return -1;
    value = value * 10 + (c - '0');
  }
  return value;
}

std::string trimmed(const std::string& text) {
  const auto first = text.find_first_not_of(" \t");
  if (first == std::string::npos) return "";
  return text.substr(first, text.find_last_not_of(" \t") - first + 1);
}

// An entry CUDA accepts in CUDA_VISIBLE_DEVICES: an index or a UUID.
bool visible_entry_valid(const std::string& entry) {
  if (entry.rfind("GPU-", 0) == 0 || entry.rfind("MIG-", 0) == 0) return entry.size() > 4;
  return parse_count(entry) >= 0;
}

std::string plural(int n, const std::string& one) {
  return std::to_string(n) + " " + one + (n == 1 ? "" : "s");
}

std::string visible_text(const SlurmGpuFacts& facts) {
  if (!facts.visible_set) return "CUDA_VISIBLE_DEVICES unset";
  if (facts.visible_text.empty()) return "CUDA_VISIBLE_DEVICES empty";
  return "CUDA_VISIBLE_DEVICES=" + facts.visible_text;
}

std::string& bound_description() {
  static std::string description;
  return description;
}

}  // namespace

SlurmGpuFacts read_slurm_gpu_facts(const EnvLookup& env) {
  SlurmGpuFacts facts;
  const auto get = [&env](const char* name) -> std::pair<bool, std::string> {
    const char* value = env ? env(name) : nullptr;
    if (value == nullptr) return {false, ""};
    return {true, value};
  };
  const auto count = [&](const char* name, bool after_colon) {
    const auto [set, text] = get(name);
    if (!set) return -1;
    std::string number = trimmed(text);
    // SLURM_GPUS_PER_TASK repeats the option, "[type:]<n>".
    if (after_colon && number.find(':') != std::string::npos) {
      number = number.substr(number.rfind(':') + 1);
    }
    const int value = parse_count(number);
    if (value < 0) facts.malformed.push_back(std::string(name) + "='" + text + "'");
    return value;
  };
  facts.under_slurm = !get("SLURM_JOB_ID").second.empty() || !get("SLURM_STEP_ID").second.empty();

  const auto [visible_set, visible] = get("CUDA_VISIBLE_DEVICES");
  facts.visible_set = visible_set;
  facts.visible_text = visible;
  if (visible_set) {
    const std::string list = trimmed(visible);
    facts.visible_count = 0;
    if (!list.empty() && list != "NoDevFiles") {
      // CUDA enumerates the entries before the first invalid one.
      size_t begin = 0;
      bool valid = true;
      while (valid) {
        const size_t comma = list.find(',', begin);
        const std::string entry =
            trimmed(list.substr(begin, comma == std::string::npos ? std::string::npos
                                                                  : comma - begin));
        valid = visible_entry_valid(entry);
        if (valid) ++facts.visible_count;
        if (comma == std::string::npos) break;
        begin = comma + 1;
      }
      if (!valid) facts.malformed.push_back("CUDA_VISIBLE_DEVICES='" + visible + "'");
    }
  }
  facts.local_id = count("SLURM_LOCALID", false);
  facts.gpus_per_task = count("SLURM_GPUS_PER_TASK", true);
  facts.gpus_on_node = count("SLURM_GPUS_ON_NODE", false);
  facts.ntasks_per_node = count("SLURM_NTASKS_PER_NODE", false);
  facts.node_gpus = get("SLURM_STEP_GPUS").second;
  if (facts.node_gpus.empty()) facts.node_gpus = get("SLURM_JOB_GPUS").second;
  return facts;
}

SlurmGpuFacts read_slurm_gpu_facts(const std::map<std::string, std::string>& env) {
  return read_slurm_gpu_facts([&env](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}

DeviceChoice explain_device_choice(DeviceRequest request, int local_rank, int local_size,
                                   int device_count, const SlurmGpuFacts& facts) {
  std::string notes;
  if (facts.local_id >= 0 && facts.local_id != local_rank) {
    notes += "; SLURM_LOCALID=" + std::to_string(facts.local_id) + " differs from MPI local rank " +
             std::to_string(local_rank) + " (the MPI node split is used)";
  }
  for (const auto& value : facts.malformed) notes += "; ignored malformed " + value;
  const auto made = [&notes](c10::Device device, const std::string& why) {
    return DeviceChoice{device, device.str() + " (" + why + notes + ")"};
  };

  if (request == DeviceRequest::Cpu) {
    return made(c10::Device(c10::kCPU), "cpu requested (FSDP_DEVICE / RuntimeOptions::device)");
  }
  if (device_count <= 0) {
    const bool slurm_gave_none = facts.under_slurm && (!facts.visible_set || facts.no_gpu_given());
    if (request == DeviceRequest::Auto) {
      std::string why = slurm_gave_none ? "Slurm gave this task no GPU"
                        : facts.visible_set && !facts.no_gpu_given()
                            ? "no CUDA device visible to LibTorch"
                            : "no CUDA device visible";
      if (facts.under_slurm || facts.visible_set) why += ", " + visible_text(facts);
      return made(c10::Device(c10::kCPU), why);
    }
    if (slurm_gave_none) {
      throw StateError(
          "device cuda was asked for (FSDP_DEVICE / RuntimeOptions::device) but Slurm gave this "
          "task no GPU (" + visible_text(facts) + "); ask Slurm for GPUs: srun --gpus-per-task=1 "
          "(one GPU per rank), or --gres=gpu:<n> / --gpus-per-node=<n> with at most <n> tasks "
          "per node; or set FSDP_DEVICE=cpu");
    }
    if (facts.under_slurm) {
      throw StateError(
          "device cuda was asked for (FSDP_DEVICE / RuntimeOptions::device); Slurm gave this "
          "task GPU(s) (" + visible_text(facts) + ") but LibTorch sees no CUDA device: a "
          "CPU-only LibTorch, or no usable driver in the task (run nvidia-smi under srun)");
    }
    return made(choose_device(request, local_rank, device_count), "no CUDA device visible");
  }

  const c10::Device device = choose_device(request, local_rank, device_count);
  const std::string visible = visible_text(facts);
  const bool per_task =
      facts.under_slurm && ((facts.gpus_per_task > 0 && device_count <= facts.gpus_per_task) ||
                            (facts.gpus_on_node > 0 && device_count < facts.gpus_on_node));
  const std::string pick = local_rank == device.index()
                               ? ""
                               : ", local rank " + std::to_string(local_rank) + " % " +
                                     std::to_string(device_count);
  if (per_task) {
    std::string why = "Slurm per-task binding: " + visible + ", " +
                      plural(device_count, "GPU") + " per task";
    if (facts.gpus_on_node > device_count) {
      why += " of the node's " + std::to_string(facts.gpus_on_node);
    }
    return made(device, why + pick);
  }
  if (facts.under_slurm && device_count > 1 && local_size > device_count) {
    throw StateError(
        std::to_string(local_size) + " ranks on this node but each sees the same " +
        std::to_string(device_count) + " GPUs (" + visible +
        (facts.node_gpus.empty() ? "" : ", node GPUs " + facts.node_gpus) +
        "), so ranks would share GPUs and NCCL needs one GPU per rank: give each task its own "
        "GPU (srun --gpus-per-task=1) or start at most " + std::to_string(device_count) +
        " tasks per node (fewer --ntasks-per-node" +
        (facts.ntasks_per_node > 0 ? ", now " + std::to_string(facts.ntasks_per_node) : "") +
        "); or set FSDP_DEVICE=cpu");
  }
  std::string why;
  if (device_count == 1 && local_size > 1) {
    why = "1 visible GPU, " + std::to_string(local_size) +
          " local ranks (one GPU each only if every rank sees a different one)";
  } else if (device_count == 1) {
    why = "the one visible GPU, 1 local rank";
  } else {
    why = "node's " + std::to_string(device_count) + " GPUs shared by " +
          plural(local_size, "local rank") + ", local rank " + std::to_string(local_rank) +
          (local_rank == device.index() ? "" : " % " + std::to_string(device_count));
  }
  if (facts.under_slurm || facts.visible_set) why += ", " + visible;
  return made(device, why);
}

const std::string& bound_device_description() { return bound_description(); }

void set_bound_device_description(std::string description) {
  bound_description() = std::move(description);
}

}  // namespace fsdp::detail
