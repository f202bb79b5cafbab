// placeholder: being written
#include "spmd.h"
