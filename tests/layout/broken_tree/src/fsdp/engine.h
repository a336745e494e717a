// An engine header that declares a function its source file does not define.
#pragma once

void shard(int units);
