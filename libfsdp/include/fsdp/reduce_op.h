// ReduceOp: the reduction of ProcessGroup::reduce_scatter_tensor and
// all_reduce (fsdp/process_group.h).
#pragma once

#include <string>

namespace fsdp {

// SUM: the elementwise sum over the group's ranks; AVG: that sum divided by
// the group size; MAX: the elementwise maximum.
enum class ReduceOp { SUM, AVG, MAX };
// "sum", "avg", "max".
std::string to_string(ReduceOp op);

}  // namespace fsdp
