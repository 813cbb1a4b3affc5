/* The one MPI constant bindgen cannot translate: mpi.h defines MPI_IN_PLACE as a cast, and
   Open MPI and MPICH cast different values. Compiled by build.rs with the `mpi` feature. */
#include <mpi.h>

void *accelerate_mpi_in_place(void) { return MPI_IN_PLACE; }
