// A detail file that calls up into a feature.
#include "fsdp/engine.h"
