#include "base/ok.h"
#include "sharding/state.h"
