// A launcher header that pulls LibTorch in.
#pragma once
#include <torch/torch.h>
