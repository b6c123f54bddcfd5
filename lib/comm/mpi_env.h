// MPI start-up and shutdown, and the one way to stop the whole job from any rank.
#pragma once
#include <string>

namespace mfsdp {

class MpiEnv {
 public:
  // Initialises MPI (thread level MULTIPLE: the communication thread and the watchdog call MPI
  // while the main thread computes). Safe to construct once per process.
  MpiEnv(int* argc, char*** argv);
  ~MpiEnv();
  MpiEnv(const MpiEnv&) = delete;
  MpiEnv& operator=(const MpiEnv&) = delete;

  static int world_rank();
  static int world_size();
  // Ends every rank of the job with `code` (MPI_Abort on COMM_WORLD). Never returns.
  [[noreturn]] static void abort_job(int code);
  static bool initialized();
  // This rank's index among the ranks on its node (MPI_Comm_split_type SHARED), for device choice.
  static int local_rank();
  static int local_size();
  // Throws unless `provided` (from MPI_Init_thread) is MPI_THREAD_MULTIPLE: the progress thread,
  // the watchdog and the error path call MPI concurrently with the main thread, which only
  // MULTIPLE allows (SERIALIZED would need every MPI call confined to one thread).
  static void require_thread_multiple(int provided);
};

}  // namespace mfsdp
