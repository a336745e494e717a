// A public header of the lowest layer that reaches up through another public header.
#pragma once
#include "accelerate/engine.h"
