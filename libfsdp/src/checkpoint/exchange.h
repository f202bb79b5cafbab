// The few collectives a checkpoint needs, over a CPU process group (watched
// like every libfsdp collective): texts gathered and broadcast, and one
// verdict agreed by every rank.
#pragma once

#include "fsdp/process_group.h"

#include <exception>
#include <string>
#include <vector>

namespace fsdp::dcp::detail {

// Every rank's text, in group-rank order, on every rank.
std::vector<std::string> all_gather_text(const ProcessGroupPtr& group, const std::string& mine);
// root's text on every rank.
std::string broadcast_text(const ProcessGroupPtr& group, const std::string& text, int root);
// Collective: returns when no rank failed; otherwise every rank throws the
// error of the lowest failing rank (same type -- CheckpointError,
// ShapeError, DTypeError, ArgumentError, StateError or Error -- same fields,
// same message).
void agree(const ProcessGroupPtr& group, const std::exception_ptr& mine);

}  // namespace fsdp::dcp::detail
