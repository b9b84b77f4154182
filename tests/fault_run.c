/* One rank of the fault matrix (tests/fault_matrix.sh): W ranks under mpirun on the simulated
 * cluster train a model whose gradients sum exactly, so every run that completes must end with
 * the same bits as the clean run.
 *
 *   fault_run DIR STEPS TIMEOUT_MS [--resume]
 *
 * Without --resume: trains 2 steps, saves DIR/ck, creates DIR/ready (the driver starts its
 * fault then), trains STEPS more steps. With --resume: loads DIR/ck and trains the same STEPS
 * steps. Each rank prints one line:
 *   OUTCOME rank=R status=S steps=N err_ms=T hash=H err=TEXT
 *   DESTROY rank=R engine_ms=A comm_ms=B       (once both destroys returned)
 * status: SG_OK or the first failure; err_ms: ms from the fault marker to that failure (-1:
 * none); hash: FNV-1a of the working parameters (0 unless the run completed); engine_ms,
 * comm_ms: how long sg_engine_destroy and sg_comm_destroy took. */
#define _GNU_SOURCE

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "shardgrad.h"

#define NPARAMS 3
static const size_t k_sizes[NPARAMS] = {1 << 20, 4096, 1 << 19}; /* ~6 MB of f32 per step */

static double now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec * 1e3 + (double)t.tv_nsec / 1e6;
}

static float grad_val(int step, int p, size_t i) {
  return (float)((int)((i * 7 + (size_t)step * 13 + (size_t)p * 5) % 5) - 2) * 0.125f;
}

static sg_status make(sg_comm *c, int timeout_ms, sg_engine **e, int *ids) {
  sg_config cfg;
  sg_status st = sg_config_init(&cfg, sizeof cfg);
  cfg.timeout_ms = timeout_ms;
  cfg.bucket_bytes = 1 << 20;
  cfg.lr = 0.01f;
  if (!st) st = sg_engine_create(c, &cfg, e);
  for (int p = 0; p < NPARAMS && !st; p++) {
    char name[32];
    snprintf(name, sizeof name, "p%d", p);
    st = sg_add_param(*e, name, k_sizes[p], 0, &ids[p]);
  }
  if (!st) st = sg_finalize(*e);
  float *buf = malloc(k_sizes[0] * sizeof *buf);
  for (int p = 0; p < NPARAMS && !st; p++) {
    for (size_t i = 0; i < k_sizes[p]; i++) buf[i] = (float)((i % 97) * 0.01);
    st = sg_set_param(*e, ids[p], buf, SG_F32);
  }
  free(buf);
  return st;
}

static sg_status train(sg_engine *e, const int *ids, int from, int to, int *done) {
  float *g = malloc(k_sizes[0] * sizeof *g);
  sg_status st = SG_OK;
  for (int s = from; s < to && !st; s++) {
    for (int p = NPARAMS - 1; p >= 0 && !st; p--) {
      for (size_t i = 0; i < k_sizes[p]; i++) g[i] = grad_val(s, p, i);
      st = sg_grad_add(e, ids[p], g, SG_F32);
    }
    if (!st) st = sg_step(e, NULL);
    if (!st) (*done)++;
  }
  free(g);
  return st;
}

static uint64_t param_hash(sg_engine *e, const int *ids) {
  uint64_t h = 0xcbf29ce484222325ull;
  float *buf = malloc(k_sizes[0] * sizeof *buf);
  for (int p = 0; p < NPARAMS; p++) {
    if (sg_get_param(e, ids[p], buf, SG_F32) != SG_OK) {
      free(buf);
      return 0;
    }
    const unsigned char *b = (const unsigned char *)buf;
    for (size_t i = 0; i < k_sizes[p] * sizeof *buf; i++) h = (h ^ b[i]) * 0x100000001b3ull;
  }
  free(buf);
  return h;
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: fault_run DIR STEPS TIMEOUT_MS [--resume]\n");
    return 64;
  }
  const char *dir = argv[1];
  const int steps = atoi(argv[2]), timeout_ms = atoi(argv[3]);
  const int resume = argc > 4 && strcmp(argv[4], "--resume") == 0;
  char ck[512], ready[512];
  snprintf(ck, sizeof ck, "%s/ck", dir);
  snprintf(ready, sizeof ready, "%s/ready", dir);
  sg_comm *c = NULL;
  sg_engine *e = NULL;
  int ids[NPARAMS], done = 0, rank = -1;
  double t_fault = -1, t_err = -1;
  sg_status st = sg_comm_create_mpi(NULL, &c);
  if (!st) rank = sg_comm_rank(c);
  if (!st) st = make(c, timeout_ms, &e, ids);
  if (!st && resume) st = sg_load(e, ck);
  if (!st && !resume) st = train(e, ids, 0, 2, &done);
  if (!st && !resume) st = sg_save(e, ck);
  if (!st && !resume && rank == 0) {
    FILE *f = fopen(ready, "w");
    if (f) fclose(f);
  }
  t_fault = now_ms();
  if (!st) st = train(e, ids, 2, 2 + steps, &done);
  if (st) t_err = now_ms();
  char err[400];
  snprintf(err, sizeof err, "%s", st ? sg_last_error() : "");
  const uint64_t h = st ? 0 : param_hash(e, ids);
  for (char *p = err; *p; p++)
    if (*p == '\n') *p = ' ';
  /* before the destroys: a destroy that does not return still leaves the outcome */
  printf("OUTCOME rank=%d status=%s steps=%d err_ms=%.0f hash=%016llx err=%s\n", rank,
         sg_status_string(st), done, t_err < 0 ? -1.0 : t_err - t_fault, (unsigned long long)h,
         err);
  fflush(stdout);
  const double t0 = now_ms();
  sg_engine_destroy(e);
  const double t1 = now_ms();
  sg_comm_destroy(c);
  const double t2 = now_ms();
  printf("DESTROY rank=%d engine_ms=%.0f comm_ms=%.0f\n", rank, t1 - t0, t2 - t1);
  fflush(stdout);
  return st ? 1 : 0;
}
