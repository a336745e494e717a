// Must not compile: nested data in an unordered map would be visited in a different order on
// each process. The test expects the library's static_assert message.
#include <accelerate/utils/operations.h>

#include <string>
#include <unordered_map>

int main() {
  std::unordered_map<std::string, at::Tensor> data;
  auto gathered = accelerate::gather(data);
  return static_cast<int>(gathered.size());
}
