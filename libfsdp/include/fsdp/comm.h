// Communication: every public header of the comm layer, for code that wants
// them all. Each declares one concept:
//   fsdp/process_group.h        ProcessGroup, P2POp: collectives over a group
//                               of ranks (backends, issue order, errors, dtypes)
//   fsdp/work.h                 Work: the handle of an issued collective
//   fsdp/reduce_op.h            ReduceOp
//   fsdp/cpu_collectives.h      CpuAlgorithm, CpuCollectives: the algorithms of
//                               CPU tensors' collectives (set_cpu_collectives)
//   fsdp/shared_memory.h        SharedMemoryStats: the collectives' shared-memory
//                               arenas
//   fsdp/collective_counters.h  CollectiveCounters: what was issued and ran
//   fsdp/comm_diagnostics.h     group_summaries, describe_groups,
//                               describe_pending_collectives
#pragma once

#include "fsdp/collective_counters.h"
#include "fsdp/comm_diagnostics.h"
#include "fsdp/cpu_collectives.h"
#include "fsdp/process_group.h"
#include "fsdp/reduce_op.h"
#include "fsdp/shared_memory.h"
#include "fsdp/work.h"
