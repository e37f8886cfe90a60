/* An MPI profiling (PMPI) library for tests: counts each rank's point-to-point sends and
 * their bytes between MPI_Pcontrol(1) and MPI_Pcontrol(0), by tag, and writes them to
 * $PMPI_COUNT_DIR/sends-<rank>.txt at MPI_Pcontrol(0) ("tag messages bytes" a line).
 *
 * Built by tests/test_scale.py with the C compiler and the MPI headers of the virtualenv,
 * preloaded into every rank (LD_PRELOAD); it checks the engine's own counts. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

#define TAGS 64
static volatile int counting = 0;
static int tags[TAGS];
static long long messages[TAGS];
static long long bytes[TAGS];
static int used = 0;

static void count(MPI_Count n, MPI_Datatype type, int tag) {
    if (!counting) return;
    int size = 0;
    PMPI_Type_size(type, &size);
    int i;
    for (i = 0; i < used && tags[i] != tag; i++) {}
    if (i == used) {
        if (used == TAGS) return;
        tags[used++] = tag;
        messages[i] = 0; /* a slot of an earlier window starts again from nothing */
        bytes[i] = 0;
    }
    messages[i] += 1;
    bytes[i] += (long long)n * size;
}

int MPI_Isend(const void *buf, int n, MPI_Datatype type, int dest, int tag, MPI_Comm comm,
              MPI_Request *request) {
    count(n, type, tag);
    return PMPI_Isend(buf, n, type, dest, tag, comm, request);
}

int MPI_Isend_c(const void *buf, MPI_Count n, MPI_Datatype type, int dest, int tag,
                MPI_Comm comm, MPI_Request *request) {
    count(n, type, tag);
    return PMPI_Isend_c(buf, n, type, dest, tag, comm, request);
}

int MPI_Send(const void *buf, int n, MPI_Datatype type, int dest, int tag, MPI_Comm comm) {
    count(n, type, tag);
    return PMPI_Send(buf, n, type, dest, tag, comm);
}

int MPI_Send_c(const void *buf, MPI_Count n, MPI_Datatype type, int dest, int tag,
               MPI_Comm comm) {
    count(n, type, tag);
    return PMPI_Send_c(buf, n, type, dest, tag, comm);
}

int MPI_Pcontrol(const int level, ...) {
    if (level == 1) {
        used = 0;
        counting = 1;
    } else if (level == 0 && counting) {
        counting = 0;
        int rank = 0;
        PMPI_Comm_rank(MPI_COMM_WORLD, &rank);
        const char *dir = getenv("PMPI_COUNT_DIR");
        if (dir == NULL) return MPI_SUCCESS;
        char path[4096];
        snprintf(path, sizeof path, "%s/sends-%d.txt", dir, rank);
        FILE *out = fopen(path, "w");
        if (out == NULL) return MPI_SUCCESS;
        for (int i = 0; i < used; i++) fprintf(out, "%d %lld %lld\n", tags[i], messages[i], bytes[i]);
        fclose(out);
    }
    return MPI_SUCCESS;
}
