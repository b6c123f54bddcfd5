// `mfsdp train`: the training loop. Collective over MPI_COMM_WORLD.
#pragma once
#include <optional>

#include "config/config.h"

namespace mfsdp {

struct TrainResult {
  int64_t steps = 0;
  double last_loss = 0;
  std::optional<double> last_val_loss;
};

TrainResult train(const Config& cfg);

}  // namespace mfsdp
