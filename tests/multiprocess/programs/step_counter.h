// The optimizer steps a test program has taken, registered for checkpointing so that a resumed run
// goes on counting where the saved one stopped (tests/multiprocess/programs/preemption.cpp,
// elastic.cpp).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>

namespace accelerate::testing {

struct StepCounter {
  int64_t step = 0;
  nlohmann::json state_dict() const { return {{"step", step}}; }
  void load_state_dict(const nlohmann::json& state) { step = state.at("step").get<int64_t>(); }
};

}  // namespace accelerate::testing
