// CUDA runtime queries (defined only when built with FSDP_WITH_NCCL).
#pragma once

#include <string>

namespace fsdp::detail {

// The PCI bus id of visible device `index` ("0000:3b:00.0"): the same for
// every process that sees that GPU, whatever CUDA_VISIBLE_DEVICES numbers it.
// StateError if CUDA cannot say.
std::string cuda_pci_bus_id(int index);

}  // namespace fsdp::detail
