// Collective counting: the internal side of fsdp::collective_counters()
// (counters.cpp).
#pragma once

#include <cstdint>
#include <string>

namespace fsdp::detail {

void count_collective(const std::string& op, const std::string& group, int64_t bytes);

}  // namespace fsdp::detail
