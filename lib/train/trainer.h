// `mfsdp train`: the training loop. Collective over MPI_COMM_WORLD.
#pragma once
#include <optional>
#include <string>

#include "config/config.h"

namespace mfsdp {

struct TrainResult {
  int64_t steps = 0;
  int64_t resumed_from = 0;        // step of the checkpoint the run started from (0: fresh)
  bool preempted = false;          // stopped by SIGTERM/SIGUSR1 after saving
  int stop_signal = 0;             // which (the largest number any rank received: TERM over USR1)
  std::string last_checkpoint;
  double last_loss = 0;
  std::optional<double> last_val_loss;
};

TrainResult train(const Config& cfg);

// SIGUSR1 / SIGTERM set a flag that the ranks agree on after every step (then save and stop).
// `mfsdp train` installs the handlers first thing: SLURM may send its time-limit warning while the
// ranks are still starting, and the default action would kill them.
void install_stop_signal_handlers();

}  // namespace mfsdp
