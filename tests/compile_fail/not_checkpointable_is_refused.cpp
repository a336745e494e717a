// Must not compile: the second argument of register_for_checkpointing has no state_dict() and
// load_state_dict(); the error names its position (1).
#include "accelerate/accelerator.h"

struct NoState {
  int value = 0;
};

void f(const accelerate::Accelerator& accelerator) {
  struct WithState {
    nlohmann::json state_dict() const { return {}; }
    void load_state_dict(const nlohmann::json&) {}
  } ok;
  NoState bad;
  accelerator.register_for_checkpointing(ok, bad);
}
