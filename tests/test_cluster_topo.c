/* test_cluster_topo: checks that an MPI job sees the node layout scripts/cluster.sh promises,
 * and measures the links. Run as
 *   scripts/cluster.sh run --ranks-per-node K build/tests/test_cluster_topo --ranks-per-node K
 *
 * Checks (exit 1 with a message on rank 0 when one fails):
 *   - ranks r and s report the same MPI_Get_processor_name exactly when r/K == s/K (consecutive
 *     blocks of K ranks per node, as cluster.sh run places them), so W/K distinct names;
 *   - MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) groups the same ranks, K per group;
 *   - /dev/shm is private to a node: a file each rank creates there is seen by the ranks of its
 *     own node only.
 * With --bandwidth MB (K >= 2 and at least two nodes): rank 0 streams MB MiB to rank 1 (same node)
 * and to rank K (next node), one way, 1 MiB messages, and prints Gbit/s for each. A measurement,
 * not a check: the numbers depend on the machine's load. */
#define _POSIX_C_SOURCE 200809L /* clock_gettime */
#include <dirent.h>
#include <errno.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

enum { MSG = 1 << 20 };

static int rank, world;

static int fail(const char *what) {
  fprintf(stderr, "test_cluster_topo: rank %d: %s\n", rank, what);
  return 1;
}

/* Same processor name exactly for ranks of one block of k. */
static int check_names(int k) {
  char name[MPI_MAX_PROCESSOR_NAME] = {0};
  int len = 0;
  MPI_Get_processor_name(name, &len);
  char *all = calloc((size_t)world, MPI_MAX_PROCESSOR_NAME);
  if (!all) return fail("out of memory");
  MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, all, MPI_MAX_PROCESSOR_NAME, MPI_CHAR,
                MPI_COMM_WORLD);
  int bad = 0;
  for (int s = 0; s < world && !bad; s++) {
    const int same = !strcmp(name, all + (size_t)s * MPI_MAX_PROCESSOR_NAME);
    if (same != (rank / k == s / k)) {
      fprintf(stderr,
              "test_cluster_topo: rank %d on '%s', rank %d on '%s': expected %s host names "
              "(%d ranks per node)\n",
              rank, name, s, all + (size_t)s * MPI_MAX_PROCESSOR_NAME,
              rank / k == s / k ? "equal" : "different", k);
      bad = 1;
    }
  }
  if (rank == 0) printf("rank 0 runs on '%s'; %d nodes of %d ranks\n", name, world / k, k);
  free(all);
  return bad;
}

/* The shared-memory split groups the same blocks. */
static int check_shared_split(int k) {
  MPI_Comm node;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  int nsize = 0, lowest = 0;
  MPI_Comm_size(node, &nsize);
  MPI_Allreduce(&rank, &lowest, 1, MPI_INT, MPI_MIN, node);
  MPI_Comm_free(&node);
  if (nsize != k || lowest != rank / k * k) {
    fprintf(stderr,
            "test_cluster_topo: rank %d: MPI_COMM_TYPE_SHARED gave %d ranks starting at %d, "
            "expected %d starting at %d\n",
            rank, nsize, lowest, k, rank / k * k);
    return 1;
  }
  return 0;
}

/* Every rank creates /dev/shm/sg_topo_<job>_<rank>; each must see exactly its node's files. */
static int check_private_shm(int k) {
  char path[256], prefix[64];
  int job = (int)getpid(); /* rank 0's pid names this job's files on every rank */
  MPI_Bcast(&job, 1, MPI_INT, 0, MPI_COMM_WORLD);
  snprintf(prefix, sizeof prefix, "sg_topo_%d_", job);
  snprintf(path, sizeof path, "/dev/shm/%s%d", prefix, rank);
  FILE *f = fopen(path, "w");
  if (!f) return fail("cannot create a file in /dev/shm");
  fclose(f);
  MPI_Barrier(MPI_COMM_WORLD);
  int bad = 0, seen = 0;
  DIR *d = opendir("/dev/shm");
  if (!d) bad = fail("cannot list /dev/shm");
  for (struct dirent *de; d && (de = readdir(d)) != NULL;) {
    if (strncmp(de->d_name, prefix, strlen(prefix)) != 0) continue;
    const int s = atoi(de->d_name + strlen(prefix));
    seen++;
    if (s / k != rank / k) {
      fprintf(stderr, "test_cluster_topo: rank %d sees rank %d's /dev/shm file: not private\n",
              rank, s);
      bad = 1;
    }
  }
  if (d) closedir(d);
  if (!bad && seen != k) {
    fprintf(stderr, "test_cluster_topo: rank %d sees %d marker files in /dev/shm, expected %d\n",
            rank, seen, k);
    bad = 1;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  unlink(path);
  return bad;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* A barrier that sleeps while it waits, so that the ranks not taking part in a measurement do
 * not take the CPU from those that do (ranks outnumber cores here). */
static void lazy_barrier(void) {
  MPI_Request req;
  int done = 0;
  MPI_Ibarrier(MPI_COMM_WORLD, &req);
  const struct timespec ms = {0, 1000000};
  for (MPI_Test(&req, &done, MPI_STATUS_IGNORE); !done; MPI_Test(&req, &done, MPI_STATUS_IGNORE))
    nanosleep(&ms, NULL);
}

/* One-way stream of mb MiB from rank 0 to `peer`, ended by a one-byte reply; Gbit/s. */
static double stream(int peer, int mb, char *buf) {
  double gbps = 0.0;
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) {
    const double t0 = now_s();
    for (int i = 0; i < mb; i++) MPI_Send(buf, MSG, MPI_CHAR, peer, 1, MPI_COMM_WORLD);
    MPI_Recv(buf, 1, MPI_CHAR, peer, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    gbps = 8.0 * (double)mb * MSG / (now_s() - t0) / 1e9;
  } else if (rank == peer) {
    for (int i = 0; i < mb; i++) MPI_Recv(buf, MSG, MPI_CHAR, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    MPI_Send(buf, 1, MPI_CHAR, 0, 2, MPI_COMM_WORLD);
  }
  lazy_barrier();
  return gbps;
}

static int bandwidth(int k, int mb) {
  if (k < 2 || world < 2 * k) {
    if (rank == 0) fprintf(stderr, "test_cluster_topo: --bandwidth needs K >= 2 and 2 nodes\n");
    return 1;
  }
  char *buf = calloc(1, MSG);
  if (!buf) return fail("out of memory");
  stream(k, 2, buf); /* warm up both connections */
  stream(1, 2, buf);
  const double inter = stream(k, mb, buf), intra = stream(1, mb, buf);
  if (rank == 0)
    printf("one-way stream of %d MiB from rank 0: to rank 1 (same node) %.2f Gbit/s, "
           "to rank %d (other node) %.2f Gbit/s\n",
           mb, intra, k, inter);
  free(buf);
  return 0;
}

int main(int argc, char **argv) {
  int k = 0, mb = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--ranks-per-node"))
      k = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--bandwidth"))
      mb = atoi(argv[i + 1]);
  }
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  int bad = 0;
  if (k < 1 || world % k != 0 || mb < 0) {
    if (rank == 0)
      fprintf(stderr, "usage: test_cluster_topo --ranks-per-node K [--bandwidth MB] (W=%d must "
                      "be a multiple of K)\n", world);
    bad = 1;
  } else {
    bad |= check_names(k);
    bad |= check_shared_split(k);
    bad |= check_private_shm(k);
    int any = 0;
    MPI_Allreduce(&bad, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    bad = any;
    if (!bad && mb > 0) bad = bandwidth(k, mb);
  }
  if (rank == 0) printf("test_cluster_topo: %s\n", bad ? "FAILED" : "ok");
  MPI_Finalize();
  return bad;
}
