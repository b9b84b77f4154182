/* Comm jobs skipped after a comm failure must still give back what they own (issue 14: every
 * reduction queued behind a failed one leaked its 32-byte job argument). Rank 1 finalizes and
 * then never marks a gradient ready; rank 0 marks four buckets ready at once: the first
 * reduction times out at the barrier (200 ms), the three queued behind it are skipped. Under
 * ASan/LSan (scripts/test.sh's asan stage runs this test) a leaked job argument fails the run;
 * in any build the statuses are checked. */
#define _POSIX_C_SOURCE 200809L

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "shardgrad.h"

#include "sg_test_check.h" /* CHECK, counted under one lock across threads */

static pthread_barrier_t g_bar;

static void check(int ok, const char *what) { CHECK(ok, "%s", what); }

#define NP 4

static void *rank_main(void *arg) {
  sg_comm *c = (sg_comm *)arg;
  const int rank = sg_comm_rank(c);
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.timeout_ms = 200;
  cfg.bucket_bytes = 4096; /* one parameter per bucket: one reduction each */
  cfg.staging_buckets = NP; /* no wait for a free staging bucket: all four are queued at once */
  sg_engine *e = NULL;
  int ids[NP];
  sg_status st = sg_engine_create(c, &cfg, &e);
  for (int p = 0; p < NP && st == SG_OK; p++) {
    char name[16];
    snprintf(name, sizeof name, "p%d", p);
    st = sg_add_param(e, name, 1024, 0, &ids[p]);
  }
  if (st == SG_OK) st = sg_finalize(e);
  check(st == SG_OK, rank ? "rank 1: finalized" : "rank 0: finalized");
  pthread_barrier_wait(&g_bar);
  if (rank == 0 && st == SG_OK) {
    for (int p = NP - 1; p >= 0 && st == SG_OK; p--) st = sg_grad_ready(e, ids[p]);
    check(st == SG_OK, "rank 0: four reductions queued, the first of which cannot complete");
    st = sg_step(e, NULL);
    check(st == SG_ERR_TIMEOUT || st == SG_ERR_COMM, "rank 0: sg_step fails (timeout)");
    check(sg_step(e, NULL) == SG_ERR_COMM, "rank 0: and the engine stays broken");
  }
  pthread_barrier_wait(&g_bar); /* rank 1 waits here: it never reduces */
  sg_engine_destroy(e);
  return NULL;
}

int main(void) {
  sg_comm *cs[2];
  if (sg_comm_create_local(2, cs) != SG_OK) {
    printf("FAIL sg_comm_create_local: %s\n", sg_last_error());
    return 1;
  }
  pthread_barrier_init(&g_bar, NULL, 2);
  pthread_t th[2];
  for (int r = 0; r < 2; r++) pthread_create(&th[r], NULL, rank_main, cs[r]);
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  pthread_barrier_destroy(&g_bar);
  for (int r = 0; r < 2; r++) sg_comm_destroy(cs[r]);
  return sg_test_summary("");
}
