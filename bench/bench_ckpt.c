/* sg_bench_ckpt: checkpoint save and load throughput at W ranks (threads), beside plain copies of
 * the same bytes measured in the same run:
 *
 *   sg_save            every rank writes its file (CRC-32C per chunk, fsync, rename, directory
 *                      fsync), rank 0 the manifest, the previous generation is deleted
 *   cp -r              the checkpoint directory copied by cp (no fsync)
 *   cp -r + sync       the same followed by sync(1) of the copied files (fsync each)
 *   sg_load            every rank reads and verifies what its shard needs (same W here)
 *   sg_load W->W/2     loaded by half as many ranks (each reads more)
 *   cat > /dev/null    the checkpoint's files read once
 *
 * Reads come from the page cache (the files were just written), as a restart on the same node
 * would see them. Correctness is checked in an untimed pass (the master weights after the load
 * equal those before). Best of --reps repetitions.
 *
 *   sg_bench_ckpt [--numel N] [--params K] [--ranks W] [--dtype f32|bf16] [--dir D] [--reps R] */
#define _POSIX_C_SOURCE 200809L /* clock_gettime, pthread_barrier, mkdtemp */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "bench_util.h" /* bench_now_s */
#include "shardgrad.h"

typedef struct {
  size_t numel;
  int params, ranks, reps;
  sg_dtype dtype;
  const char *dir;
} options;

typedef struct {
  const options *o;
  const char *dir;
  int world; /* ranks of this engine */
  int do_save;
  pthread_barrier_t bar;
  double t_save, t_load; /* best over reps */
  int ok[16];
  char err[512];
} shared;

typedef struct {
  shared *s;
  sg_comm *comm;
  int rank;
} rank_arg;

static sg_status make(const options *o, sg_comm *c, sg_engine **e, int *ids) {
  sg_config cfg;
  sg_config_init(&cfg, sizeof cfg);
  cfg.param_dtype = cfg.grad_dtype = cfg.reduce_dtype = o->dtype;
  sg_status st = sg_engine_create(c, &cfg, e);
  const size_t per = o->numel / (size_t)o->params;
  for (int p = 0; p < o->params && !st; p++) {
    char name[32];
    snprintf(name, sizeof name, "layer%d.weight", p);
    st = sg_add_param(*e, name, per + (size_t)p, 0, &ids[p]);
  }
  if (!st) st = sg_finalize(*e);
  float *v = malloc((per + (size_t)o->params) * sizeof *v);
  for (int p = 0; p < o->params && !st; p++) {
    for (size_t i = 0; i < per + (size_t)p; i++)
      v[i] = (float)((i * 2654435761u + (size_t)p) % 1000) * 1e-3f;
    st = sg_set_param(*e, ids[p], v, SG_F32);
  }
  free(v);
  return st;
}

static void *rank_main(void *p) {
  rank_arg *a = p;
  shared *s = a->s;
  sg_engine *e = NULL;
  int ids[256];
  sg_status st = make(s->o, a->comm, &e, ids);
  float *before = NULL, *after = NULL;
  const size_t n0 = s->o->numel / (size_t)s->o->params;
  for (int r = 0; r < s->o->reps && !st; r++) {
    double t0 = 0;
    if (s->do_save) {
      pthread_barrier_wait(&s->bar);
      t0 = bench_now_s();
      st = sg_save(e, s->dir);
      pthread_barrier_wait(&s->bar);
      const double dt = bench_now_s() - t0;
      if (a->rank == 0 && (s->t_save == 0 || dt < s->t_save)) s->t_save = dt;
    }
    if (st) break;
    pthread_barrier_wait(&s->bar);
    t0 = bench_now_s();
    st = sg_load(e, s->dir);
    pthread_barrier_wait(&s->bar);
    const double dt = bench_now_s() - t0;
    if (a->rank == 0 && (s->t_load == 0 || dt < s->t_load)) s->t_load = dt;
  }
  /* untimed check: param 0's master survives a save/load round trip */
  if (!st) {
    before = malloc(n0 * 4);
    after = malloc(n0 * 4);
    st = sg_get_master(e, ids[0], before);
    if (!st) st = sg_load(e, s->dir);
    if (!st) st = sg_get_master(e, ids[0], after);
    if (!st && memcmp(before, after, n0 * 4) != 0) st = SG_ERR_INTERNAL;
  }
  s->ok[a->rank] = st == SG_OK;
  if (st && a->rank == 0)
    snprintf(s->err, sizeof s->err, "%s: %s", sg_status_string(st), sg_last_error());
  free(before);
  free(after);
  sg_engine_destroy(e);
  return NULL;
}

static int run(shared *s) {
  sg_comm *comms[16];
  pthread_t th[16];
  rank_arg args[16];
  if (s->world > 16 || sg_comm_create_local(s->world, comms) != SG_OK) return 0;
  pthread_barrier_init(&s->bar, NULL, (unsigned)s->world);
  for (int r = 0; r < s->world; r++) {
    args[r] = (rank_arg){s, comms[r], r};
    pthread_create(&th[r], NULL, rank_main, &args[r]);
  }
  for (int r = 0; r < s->world; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < s->world; r++) sg_comm_destroy(comms[r]);
  pthread_barrier_destroy(&s->bar);
  int ok = 1;
  for (int r = 0; r < s->world; r++) ok &= s->ok[r];
  if (!ok) printf("run at W=%d failed: %s\n", s->world, s->err);
  return ok;
}

/* Best wall time of a shell command over reps. */
static double time_cmd(const char *cmd, int reps) {
  double best = 0;
  for (int r = 0; r < reps; r++) {
    const double t0 = bench_now_s();
    if (system(cmd) != 0) return -1;
    const double dt = bench_now_s() - t0;
    if (best == 0 || dt < best) best = dt;
  }
  return best;
}

static double dir_bytes(const char *dir) {
  char cmd[600];
  snprintf(cmd, sizeof cmd, "du -sb '%s' | cut -f1", dir);
  FILE *p = popen(cmd, "r");
  double b = 0;
  if (p) {
    if (fscanf(p, "%lf", &b) != 1) b = 0;
    pclose(p);
  }
  return b;
}

static void row(const char *what, double bytes, double secs, double base) {
  if (secs <= 0) {
    printf("%-22s %12s %10s %10s\n", what, "-", "failed", "-");
    return;
  }
  printf("%-22s %12.0f %10.3f %10.2f", what, bytes / 1e6, secs * 1e3, bytes / secs / 1e9);
  if (base > 0) printf("   %5.2fx", base / secs);
  printf("\n");
}

int main(int argc, char **argv) {
  options o = {32u << 20, 8, 2, 3, SG_BF16, NULL};
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--numel") && i + 1 < argc)
      o.numel = (size_t)atof(argv[++i]);
    else if (!strcmp(argv[i], "--params") && i + 1 < argc)
      o.params = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--ranks") && i + 1 < argc)
      o.ranks = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
      o.reps = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--dir") && i + 1 < argc)
      o.dir = argv[++i];
    else if (!strcmp(argv[i], "--dtype") && i + 1 < argc)
      o.dtype = !strcmp(argv[++i], "f32") ? SG_F32 : SG_BF16;
    else {
      printf(
          "usage: %s [--numel N] [--params K] [--ranks W] [--dtype f32|bf16] [--dir D] "
          "[--reps R]\n",
          argv[0]);
      return 2;
    }
  }
  if (o.params < 1 || o.params > 256 || o.ranks < 1 || o.ranks > 16 || o.reps < 1 ||
      o.numel < (size_t)o.params) {
    printf("bad options\n");
    return 2;
  }
  char root[256];
  snprintf(root, sizeof root, "%s/sg_bench_ckpt_XXXXXX", o.dir ? o.dir : "/tmp");
  if (!mkdtemp(root)) {
    printf("cannot create a directory under %s\n", o.dir ? o.dir : "/tmp");
    return 1;
  }
  char ck[300], cp_dst[300], cmd[2048];
  snprintf(ck, sizeof ck, "%s/ck", root);
  snprintf(cp_dst, sizeof cp_dst, "%s/copy", root);

  shared s;
  memset(&s, 0, sizeof s);
  s.o = &o;
  s.dir = ck;
  s.world = o.ranks;
  s.do_save = 1;
  printf(
      "sg_bench_ckpt: %zu parameters (%s) in %d tensors, W=%d ranks (threads), best of %d, "
      "directory %s\n",
      o.numel, o.dtype == SG_F32 ? "f32" : "bf16", o.params, o.ranks, o.reps, root);
  if (!run(&s)) return 1;
  const double bytes = dir_bytes(ck);
  shared h;
  memset(&h, 0, sizeof h);
  h.o = &o;
  h.dir = ck;
  h.world = o.ranks > 1 ? o.ranks / 2 : 1;
  const int half_ok = run(&h);

  snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s'", cp_dst, ck, cp_dst);
  const double t_cp = time_cmd(cmd, o.reps);
  snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s' && sync '%s'/* '%s'", cp_dst, ck,
           cp_dst, cp_dst, cp_dst);
  const double t_cp_sync = time_cmd(cmd, o.reps);
  snprintf(cmd, sizeof cmd, "cat '%s'/* > /dev/null", ck);
  const double t_cat = time_cmd(cmd, o.reps);

  printf("\n%-22s %12s %10s %10s   %s\n", "operation", "MB", "ms", "GB/s", "x cp");
  row("sg_save (fsync)", bytes, s.t_save, t_cp_sync);
  row("cp -r", bytes, t_cp, 0);
  row("cp -r + sync", bytes, t_cp_sync, 0);
  row("sg_load (same W)", bytes, s.t_load, t_cp);
  char what[64];
  snprintf(what, sizeof what, "sg_load (W=%d)", h.world);
  row(what, bytes, half_ok ? h.t_load : 0, t_cp);
  row("cat > /dev/null", bytes, t_cat, 0);
  printf(
      "\nthroughput ratio ('x cp'): sg_save against cp -r + sync (the same durability), "
      "sg_load against cp -r\n");
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
  if (system(cmd) != 0) printf("could not remove %s\n", root);
  return 0;
}
