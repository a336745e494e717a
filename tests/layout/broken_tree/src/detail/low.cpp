// A detail file that calls up into a feature, directly and through its public header.
#include "fsdp/engine.h"
#include "accelerate/engine.h"
