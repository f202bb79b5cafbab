#pragma once
#include "fsdp/comm.h"
#include "fsdp/fully_shard.h"
