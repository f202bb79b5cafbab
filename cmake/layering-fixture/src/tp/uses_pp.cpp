#include "fsdp/pipeline.h"
#include "fsdp/mesh.h"
