// The main() of the multi-rank Catch2 tests (include once, in place of catch.h's own main): MPI is
// initialised around the Catch session, and any rank's failure fails the test on every rank
// (mpirun reports the first non-zero status). Also a communicator over all ranks for the tests.
#pragma once
#define CATCH_CONFIG_RUNNER
#include <memory>

#include "catch.h"
#include "comm/communicator.h"
#include "comm/mpi_env.h"

namespace mfsdp::test {

// A communicator over MPI_COMM_WORLD (a duplicate, so that tests cannot interfere with MpiEnv's).
inline std::unique_ptr<Communicator> world(const char* name = "world") {
  MPI_Comm dup;
  MPI_Comm_dup(MPI_COMM_WORLD, &dup);
  return make_communicator(Backend::kMpi, dup, name);
}

}  // namespace mfsdp::test

int main(int argc, char** argv) {
  mfsdp::MpiEnv env(&argc, &argv);
  int rc = Catch::Session().run(argc, argv);
  MPI_Allreduce(MPI_IN_PLACE, &rc, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return rc;
}
