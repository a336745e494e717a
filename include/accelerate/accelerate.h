// accelerate-cpp: Hugging Face Accelerate for LibTorch C++ programs. This umbrella header brings
// in the whole public surface.
#pragma once

#include "accelerate/accelerator.h"
#include "accelerate/checkpointing.h"
#include "accelerate/data_loader.h"
#include "accelerate/distributed.h"
#include "accelerate/grad_scaler.h"
#include "accelerate/local_sgd.h"
#include "accelerate/lr_scheduler.h"
#include "accelerate/optimizer.h"
#include "accelerate/scheduler.h"
#include "accelerate/memory_utils.h"
#include "accelerate/state.h"
#include "accelerate/utils/autocast.h"
#include "accelerate/utils/dataclasses.h"
#include "accelerate/utils/environment.h"
#include "accelerate/utils/modeling.h"
#include "accelerate/utils/operations.h"
#include "accelerate/utils/profiler.h"
#include "accelerate/utils/random.h"
#include "accelerate/utils/safetensors.h"
#include "accelerate/utils/tensor_tree.h"
