// A feature that reaches into the launcher, and a header that is not there.
#include "fsdp/engine.h"
#include "launch/supervisor.h"
#include "detail/missing.h"
