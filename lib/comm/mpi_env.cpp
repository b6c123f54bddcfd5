#include "comm/mpi_env.h"

#include <mpi.h>

#include <cstdio>
#include <cstdlib>

#include "comm/flight_recorder.h"
#include "comm/progress_thread.h"
#include "util/error.h"

namespace mfsdp {

MpiEnv::MpiEnv(int* argc, char*** argv) {
  int provided = 0;
  if (MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
    throw std::runtime_error("MPI_Init_thread failed");
  require_thread_multiple(provided);
  // Errors in MPI calls come back as return codes that we turn into exceptions with context.
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

void MpiEnv::require_thread_multiple(int provided) {
  if (provided >= MPI_THREAD_MULTIPLE) return;
  const char* names[] = {"MPI_THREAD_SINGLE", "MPI_THREAD_FUNNELED", "MPI_THREAD_SERIALIZED"};
  throw UserError(std::string("the MPI library provides only ") +
                  (provided >= 0 && provided < 3 ? names[provided] : std::to_string(provided).c_str()) +
                  "; mfsdp needs MPI_THREAD_MULTIPLE (its communication thread and watchdog call MPI while the main "
                  "thread computes): use an MPI built with thread support (Open MPI >= 3 provides it by default)");
}

MpiEnv::~MpiEnv() {
  FlightRecorder::instance().stop_watchdog();
  ProgressThread::shutdown();
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

bool MpiEnv::initialized() {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  return init && !fin;
}

int MpiEnv::world_rank() {
  int r = 0;
  if (initialized()) MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}

int MpiEnv::world_size() {
  int n = 1;
  if (initialized()) MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

namespace {
MPI_Comm node_comm() {
  static MPI_Comm comm = [] {
    MPI_Comm c;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &c);
    return c;
  }();
  return comm;
}
}  // namespace

int MpiEnv::local_rank() {
  int r = 0;
  if (initialized()) MPI_Comm_rank(node_comm(), &r);
  return r;
}

int MpiEnv::local_size() {
  int n = 1;
  if (initialized()) MPI_Comm_size(node_comm(), &n);
  return n;
}

void MpiEnv::abort_job(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  if (initialized()) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

}  // namespace mfsdp
