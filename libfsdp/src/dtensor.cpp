// DTensor (lite): placements, ceil-div shard layout and redistribution.
#include "fsdp/dtensor.h"
