/* The one table of environment settings (src/core/sg_env.c), run with the environment env.cmake
 * sets: one rule per type (a boolean in any spelling, a choice in any case, a number in range),
 * a value not understood counting as unset, an old name still read, the report (WARN for what
 * it does not understand, INFO for every value set otherwise), the wire words; and, under
 * mpirun with SG_COLL_REDUCE_SCATTER set on one rank only ("mismatch"), SG_ERR_MISMATCH from
 * sg_finalize on every rank, naming the variable. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/core/sg_core.h"
#include "sg_test_check.h"

static int log_has(const char *path, const char *s) {
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  char line[1024];
  int found = 0;
  while (!found && fgets(line, sizeof line, f)) found = strstr(line, s) != NULL;
  fclose(f);
  return found;
}

static void rules(void) {
  CHECK(sg__env_value(SG_ENV_COMM_FOLD, 1) == 0, "SG_COMM_FOLD=Off is false");
  CHECK(sg__env_value(SG_ENV_CPU_HUGEPAGES, 7) == 7, "SG_CPU_HUGEPAGES=maybe counts as unset");
  CHECK(sg__env_value(SG_ENV_COLL_ALLGATHER, 0) == 1, "SG_MPI_ALLGATHER=ring (old name): ring");
  CHECK(sg__env_value(SG_ENV_COLL_REDUCE_SCATTER, 1) == 0, "SG_COLL_REDUCE_SCATTER=DIRECT: direct");
  CHECK(sg__env_value(SG_ENV_COMM_WAIT, 0) == 1, "SG_COMM_WAIT=yield");
  CHECK(sg__env_value(SG_ENV_NCCL_INIT_TIMEOUT_MS, 42) == 42, "a number out of range: unset");
  CHECK(sg__env_value(SG_ENV_COMM_RX_RELEASE, 5) == 5, "unset: the caller's default");
  CHECK(sg__env_text(SG_ENV_TRACE) == NULL, "SG_TRACE unset: NULL");
  uint64_t w[4] = {0};
  const char *names[4] = {0};
  CHECK(sg__env_wire_words(w, 4, names) == 2 && !strcmp(names[0], "SG_COLL_ALLGATHER") &&
            !strcmp(names[1], "SG_COLL_REDUCE_SCATTER"),
        "two wire settings");
  CHECK(w[0] == 2 && w[1] == 1, "wire words: the values + 1 (0: unset)");
}

static void report(void) {
  const char *path = sg__env_text(SG_ENV_LOG_FILE);
  if (!CHECK(path != NULL, "SG_LOG_FILE set by the test")) return;
  remove(path); /* the log opens it on first use */
  sg__env_report(0);
  sg__env_report(0); /* once per process */
  CHECK(log_has(path, "SG_CPU_HUGEPAGES=maybe is not understood"), "WARN for a bad boolean");
  CHECK(log_has(path, "SG_NCCL_INIT_TIMEOUT_MS=-5 is not understood"), "WARN for a bad number");
  CHECK(log_has(path, "SG_MPI_ALLGATHER=ring (the old name of SG_COLL_ALLGATHER)"),
        "INFO for an old name");
  CHECK(log_has(path, "SG_COMM_FOLD=Off"), "INFO for a value other than the default");
  CHECK(!log_has(path, "SG_COMM_WAIT=sleep"), "nothing for what is unset");
}

/* Two ranks under mpirun, SG_COLL_REDUCE_SCATTER set on one of them. */
static int mismatch(void) {
  sg_comm *c = NULL;
  if (sg_comm_create_mpi(NULL, &c) != SG_OK) {
    printf("FAIL sg_comm_create_mpi: %s\n", sg_last_error());
    return 1;
  }
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.timeout_ms = 20000;
  sg_engine *e = NULL;
  int id = -1;
  if (CHECK(sg_engine_create(c, &cfg, &e) == SG_OK && sg_add_param(e, "w", 1000, 0, &id) == SG_OK,
            "engine and a parameter")) {
    const sg_status st = sg_finalize(e);
    CHECK(st == SG_ERR_MISMATCH && strstr(sg_last_error(), "SG_COLL_REDUCE_SCATTER"),
          "rank %d: sg_finalize fails with SG_ERR_MISMATCH naming SG_COLL_REDUCE_SCATTER (%s)",
          sg_comm_rank(c), sg_status_string(st));
  }
  sg_engine_destroy(e);
  char prefix[32];
  snprintf(prefix, sizeof prefix, "rank %d: ", sg_comm_rank(c));
  sg_comm_destroy(c);
  return sg_test_summary(prefix);
}

int main(int argc, char **argv) {
  if (argc > 1 && !strcmp(argv[1], "mismatch")) return mismatch();
  rules();
  report();
  return sg_test_summary("");
}
