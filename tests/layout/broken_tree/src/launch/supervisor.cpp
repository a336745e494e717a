// A launcher source.
#include "launch/supervisor.h"
