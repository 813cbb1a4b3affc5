/* Open MPI's all-reduce timed exactly as benches/benches/collectives.rs times ours: f32 sum in
 * place, sizes 4 KiB x 4 up to a maximum, a few warm-up calls, then `iters` timed calls
 * (256 MiB / size, clamped to 5..500); the median call, algbw = size / time and
 * busbw = algbw x 2(n-1)/n. Each call is timed on rank 0 after a barrier-free loop, as ours.
 *
 *   mpicc -O2 -o /tmp/mpi_all_reduce benches/mpi/all_reduce.c
 *   mpirun --allow-run-as-root -np 2 --mca btl self,tcp /tmp/mpi_all_reduce 268435456
 *
 * (`--mca btl self,tcp` forces the TCP transport even on one host; see benches/mpi/run.sh.) */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    size_t max = argc > 1 ? strtoull(argv[1], NULL, 10) : (64u << 20);
    float *buf = calloc(max / 4 + 1, 4);
    double *times = malloc(500 * sizeof(double));
    if (rank == 0) {
        printf("# Open MPI all_reduce (f32, sum, in place), world size %d\n", n);
        printf("#    size(B)      count  type redop   time(us) algbw(GB/s) busbw(GB/s)\n");
    }
    for (size_t size = 4096; size <= max; size *= 4) {
        int count = (int)(size / 4);
        size_t iters = (256u << 20) / size;
        iters = iters < 5 ? 5 : iters > 500 ? 500 : iters;
        size_t warm = (iters < 20 ? iters : 20) / 4 + 1;
        for (size_t i = 0; i < warm; i++)
            MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        for (size_t i = 0; i < iters; i++) {
            double t0 = MPI_Wtime();
            MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            times[i] = MPI_Wtime() - t0;
        }
        qsort(times, iters, sizeof(double), cmp);
        double median = times[iters / 2];
        double algbw = (double)size / median / 1e9;
        if (rank == 0)
            printf("%12zu %10d   f32   sum %10.2f %11.3f %11.3f\n", size, count, median * 1e6, algbw,
                   algbw * 2.0 * (n - 1) / n);
    }
    free(buf);
    free(times);
    MPI_Finalize();
    return 0;
}
