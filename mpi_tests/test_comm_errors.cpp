// placeholder
#include "spmd.h"
