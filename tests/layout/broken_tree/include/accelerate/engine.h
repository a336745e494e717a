// A public header of the fully sharded engine (defined in src/fsdp/engine.cpp).
#pragma once
