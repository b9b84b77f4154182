/* Tests of src/core: status names, thread-local last error, version/backends, dtype helpers,
 * FNV-1a, config init/copy/check, and the logger (SG_LOG, SG_LOG_FILE with %r). */
#define _POSIX_C_SOURCE 200809L /* setenv, mkdtemp, fork, pthread_barrier */

#include <math.h>     /* NAN, INFINITY */
#include <pthread.h>  /* threads for thread-locality and concurrent logging */
#include <stdio.h>    /* printf, fopen */
#include <stdlib.h>   /* setenv, mkdtemp */
#include <string.h>   /* strcmp, strstr */
#include <sys/wait.h> /* waitpid */
#include <unistd.h>   /* fork, dup2, unlink, rmdir */

#include "core/sg_core.h" /* sg__err, sg__config_*, SG_LOG */

#define SG_TEST_PRINT_PASSES 0
#include "sg_test_check.h"

static void test_status_strings(void) {
  printf("status strings ...\n");
  static const char *names[] = {"SG_OK",
                                "SG_ERR_INVALID_ARGUMENT",
                                "SG_ERR_INVALID_STATE",
                                "SG_ERR_OUT_OF_MEMORY",
                                "SG_ERR_UNSUPPORTED",
                                "SG_ERR_MISMATCH",
                                "SG_ERR_COMM",
                                "SG_ERR_TIMEOUT",
                                "SG_ERR_IO",
                                "SG_ERR_CORRUPT",
                                "SG_ERR_CUDA",
                                "SG_ERR_INTERNAL"};
  for (int s = 0; s <= 11; s++)
    CHECK(strcmp(sg_status_string((sg_status)s), names[s]) == 0, "status %d -> %s", s,
          sg_status_string((sg_status)s));
  CHECK(strcmp(sg_status_string((sg_status)12), "SG_ERR_UNKNOWN") == 0, "12");
  CHECK(strcmp(sg_status_string((sg_status)-1), "SG_ERR_UNKNOWN") == 0, "-1");
}

static void test_errors(void) {
  printf("last error text ...\n");
  sg__err_clear();
  CHECK(sg_last_error() && sg_last_error()[0] == '\0', "empty after clear");
  sg_status st =
      sg__err(SG_ERR_INVALID_ARGUMENT, "sg_add_param: numel must be >= 1 (param '%s')", "fc1.b");
  CHECK(st == SG_ERR_INVALID_ARGUMENT, "sg__err returns its status");
  CHECK(strcmp(sg_last_error(), "sg_add_param: numel must be >= 1 (param 'fc1.b')") == 0, "'%s'",
        sg_last_error());
  st = sg__err_at(SG_ERR_IO, "/some/long/path/ckpt.c", 42, "open %s failed", "x.ckpt");
  CHECK(st == SG_ERR_IO && strcmp(sg_last_error(), "open x.ckpt failed (ckpt.c:42)") == 0, "'%s'",
        sg_last_error());
  st = sg__err_prefix(SG_ERR_COMM, "sg_step");
  CHECK(
      st == SG_ERR_COMM && strcmp(sg_last_error(), "sg_step: open x.ckpt failed (ckpt.c:42)") == 0,
      "'%s'", sg_last_error());
  /* The caller may pass the current text as an argument. */
  sg__err(SG_ERR_INTERNAL, "outer: %s", sg_last_error());
  CHECK(strcmp(sg_last_error(), "outer: sg_step: open x.ckpt failed (ckpt.c:42)") == 0, "'%s'",
        sg_last_error());
  /* Long texts are truncated, never overflow, and keep a prefix. */
  char big[3000];
  memset(big, 'z', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  sg__err(SG_ERR_IO, "%s", big);
  size_t n = strlen(sg_last_error());
  CHECK(n > 500 && n < sizeof big, "truncated length %zu", n);
  sg__err_prefix(SG_ERR_IO, "fn");
  CHECK(strncmp(sg_last_error(), "fn: zzz", 7) == 0 && strlen(sg_last_error()) == n,
        "prefix of long");
  sg__err_at(SG_ERR_IO, "a.c", 1, "%s", big);
  CHECK(strlen(sg_last_error()) == n, "err_at on a full buffer stays bounded");
  sg__err_clear();
  CHECK(sg_last_error()[0] == '\0', "cleared");
}

/* Two threads set different errors in lock step; each must read back its own. */
static pthread_barrier_t g_bar;
static void *err_thread(void *arg) {
  const char *tag = (const char *)arg;
  int ok = sg_last_error()[0] == '\0'; /* a new thread starts empty */
  pthread_barrier_wait(&g_bar);
  sg__err(SG_ERR_TIMEOUT, "thread %s failed", tag);
  pthread_barrier_wait(&g_bar); /* both have written */
  char want[64];
  snprintf(want, sizeof want, "thread %s failed", tag);
  ok &= strcmp(sg_last_error(), want) == 0;
  return ok ? arg : NULL;
}

static void test_error_threads(void) {
  printf("last error is thread-local ...\n");
  sg__err(SG_ERR_IO, "main thread text");
  pthread_t a, b;
  void *ra = NULL, *rb = NULL;
  pthread_barrier_init(&g_bar, NULL, 2);
  pthread_create(&a, NULL, err_thread, "A");
  pthread_create(&b, NULL, err_thread, "B");
  pthread_join(a, &ra);
  pthread_join(b, &rb);
  pthread_barrier_destroy(&g_bar);
  CHECK(ra != NULL, "thread A saw its own text");
  CHECK(rb != NULL, "thread B saw its own text");
  CHECK(strcmp(sg_last_error(), "main thread text") == 0, "main unchanged: '%s'", sg_last_error());
}

static void test_util(void) {
  printf("version, backends, dtypes, clock, hash ...\n");
  CHECK(sg_version() == SG_VERSION_MAJOR * 10000 + SG_VERSION_MINOR * 100 + SG_VERSION_PATCH,
        "version %d", sg_version());
  CHECK(sg_has_backend("local") == 1, "local");
  CHECK(sg_has_backend(NULL) == 0 && sg_has_backend("") == 0 && sg_has_backend("LOCALX") == 0,
        "unknown names");
#ifdef SG_HAVE_MPI
  CHECK(sg_has_backend("mpi") == 1, "mpi compiled in");
#else
  CHECK(sg_has_backend("mpi") == 0, "mpi not compiled in");
#endif
  int c = sg_has_backend("cuda"), n = sg_has_backend("nccl");
  CHECK((c == 0 || c == 1) && (n == 0 || n == 1) && (!n || c), "cuda %d nccl %d", c, n);
  CHECK(strcmp(sg__dtype_name(SG_F32), "f32") == 0 &&
            strcmp(sg__dtype_name(SG_BF16), "bf16") == 0 &&
            strcmp(sg__dtype_name(SG_F16), "f16") == 0,
        "dtype names");
  CHECK(sg__dtype_size(SG_F32) == 4 && sg__dtype_size(SG_BF16) == 2 && sg__dtype_size(SG_F16) == 2,
        "dtype sizes");
  CHECK(sg__dtype_valid(0) && sg__dtype_valid(2) && !sg__dtype_valid(3) && !sg__dtype_valid(-1),
        "dtype_valid");
  int64_t t0 = sg__now_ms(), t1 = sg__now_ms();
  CHECK(t0 > 0 && t1 >= t0, "monotonic clock %lld %lld", (long long)t0, (long long)t1);
  CHECK(sg__deadline(0) == INT64_MAX && sg__deadline(1000) >= t1 + 1000, "deadline");
  /* Published FNV-1a 64 test vectors. */
  CHECK(sg__hash_bytes(SG__HASH_INIT, "", 0) == 0xcbf29ce484222325ull, "fnv('')");
  CHECK(sg__hash_bytes(SG__HASH_INIT, "a", 1) == 0xaf63dc4c8601ec8cull, "fnv('a')");
  CHECK(sg__hash_bytes(SG__HASH_INIT, "foobar", 6) == 0x85944171f73967e8ull, "fnv('foobar')");
  CHECK(sg__hash_bytes(sg__hash_bytes(SG__HASH_INIT, "foo", 3), "bar", 3) == 0x85944171f73967e8ull,
        "fnv is incremental");
}

static void test_config_init(void) {
  printf("config init and copy ...\n");
  sg_config c;
  memset(&c, 0x5a, sizeof c);
  CHECK(sg_config_init(&c, sizeof c) == SG_OK, "%s", sg_last_error());
  CHECK(c.struct_size == sizeof c && c.strategy == SG_SHARD_GRAD_OP && c.device == SG_DEVICE_CPU &&
            c.cuda_device == -1,
        "struct_size, strategy, device");
  CHECK(c.param_dtype == SG_F32 && c.grad_dtype == SG_DTYPE_AUTO && c.reduce_dtype == SG_DTYPE_AUTO &&
            c.accum_dtype == SG_F32,
        "dtypes");
  CHECK(c.bucket_bytes == 32u << 20 && c.staging_buckets == 2, "bucket defaults");
  CHECK(c.lr == 1e-3f && c.beta1 == 0.9f && c.beta2 == 0.999f && c.eps == 1e-8f &&
            c.weight_decay == 0.01f && c.max_grad_norm == 0.0f && c.grad_average == 1,
        "adamw defaults");
  CHECK(c.loss_scale == 0.0f && c.init_loss_scale == 65536.0f && c.scale_window == 2000 &&
            c.min_loss_scale == 1.0f && c.skip_nonfinite == 1,
        "loss scale defaults");
  CHECK(c.stochastic_rounding == 0 && c.seed == 0 && c.timeout_ms == 600000, "misc defaults");
  CHECK(sg__config_check(&c, "test") == SG_OK, "defaults pass the check: %s", sg_last_error());
  CHECK(sg_config_init(NULL, sizeof c) == SG_ERR_INVALID_ARGUMENT && sg_last_error()[0],
        "NULL cfg");
  /* Sizes outside [first published, current] are rejected and nothing is written. */
  size_t bad[] = {0, 8, sizeof c - 1, sizeof c + 1, sizeof c + 64};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    unsigned char buf[sizeof(sg_config) + 128];
    memset(buf, 0xa5, sizeof buf);
    sg_status st = sg_config_init((sg_config *)(void *)buf, bad[i]);
    int untouched = 1;
    for (size_t k = 0; k < sizeof buf; k++) untouched &= buf[k] == 0xa5;
    CHECK(st == SG_ERR_INVALID_ARGUMENT && untouched && strstr(sg_last_error(), "struct_size"),
          "struct_size %zu: %s '%s'", bad[i], sg_status_string(st), sg_last_error());
  }
  /* Copy: fields come through, struct_size becomes the library's size. */
  sg_config in, out;
  sg_config_init(&in, sizeof in);
  in.lr = 0.5f;
  in.seed = 77;
  in.timeout_ms = -1;
  memset(&out, 0, sizeof out);
  CHECK(sg__config_copy(&in, &out, "sg_engine_create") == SG_OK, "%s", sg_last_error());
  CHECK(out.lr == 0.5f && out.seed == 77 && out.timeout_ms == -1 && out.struct_size == sizeof out,
        "copied fields");
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    in.struct_size = bad[i];
    sg_status st = sg__config_copy(&in, &out, "sg_engine_create");
    CHECK(st == SG_ERR_INVALID_ARGUMENT &&
              strstr(sg_last_error(), "sg_engine_create: cfg->struct_size"),
          "copy with struct_size %zu: '%s'", bad[i], sg_last_error());
  }
  in.struct_size = sizeof in;
  CHECK(sg__config_copy(NULL, &out, "f") == SG_ERR_INVALID_ARGUMENT, "copy NULL in");
  CHECK(sg__config_copy(&in, NULL, "f") == SG_ERR_INVALID_ARGUMENT, "copy NULL out");
  CHECK(sg__config_check(NULL, "f") == SG_ERR_INVALID_ARGUMENT, "check NULL");
}

/* One bad value of one field: rejected, and the message names the caller and the field. */
typedef void (*mutator)(sg_config *c);
#define BAD(name, field, stmt) \
  static void name(sg_config *c) { stmt; }
BAD(b_strategy, "strategy", c->strategy = (sg_strategy)3)
BAD(b_strategy_neg, "strategy", c->strategy = (sg_strategy)-1)
BAD(b_device, "device", c->device = (sg_device)2)
BAD(b_cuda_device, "cuda_device", c->cuda_device = -2)
BAD(b_param_dtype, "param_dtype", c->param_dtype = (sg_dtype)3)
BAD(b_grad_dtype, "grad_dtype", c->grad_dtype = (sg_dtype)-2)
BAD(b_reduce_dtype, "reduce_dtype", c->reduce_dtype = (sg_dtype)7)
BAD(b_accum_f16, "accum_dtype", c->accum_dtype = SG_F16)
BAD(b_accum_bad, "accum_dtype", c->accum_dtype = (sg_dtype)9)
BAD(b_bucket_f32, "bucket_bytes", c->bucket_bytes = 255)
BAD(b_bucket_bf16, "bucket_bytes", (c->grad_dtype = SG_BF16, c->bucket_bytes = 127))
BAD(b_staging0, "staging_buckets", c->staging_buckets = 0)
BAD(b_staging65, "staging_buckets", c->staging_buckets = 65)
BAD(b_lr_neg, "lr", c->lr = -1e-3f)
BAD(b_lr_nan, "lr", c->lr = NAN)
BAD(b_lr_inf, "lr", c->lr = INFINITY)
BAD(b_beta1_big, "beta1", c->beta1 = 1.5f)
BAD(b_beta1_one, "beta1", c->beta1 = 1.0f)
BAD(b_beta1_neg, "beta1", c->beta1 = -0.1f)
BAD(b_beta1_nan, "beta1", c->beta1 = NAN)
BAD(b_beta2_one, "beta2", c->beta2 = 1.0f)
BAD(b_beta2_nan, "beta2", c->beta2 = NAN)
BAD(b_eps_zero, "eps", c->eps = 0.0f)
BAD(b_eps_nan, "eps", c->eps = NAN)
BAD(b_wd_neg, "weight_decay", c->weight_decay = -0.01f)
BAD(b_wd_nan, "weight_decay", c->weight_decay = NAN)
BAD(b_clip_neg, "max_grad_norm", c->max_grad_norm = -1.0f)
BAD(b_clip_nan, "max_grad_norm", c->max_grad_norm = NAN)
BAD(b_avg, "grad_average", c->grad_average = 2)
BAD(b_skip, "skip_nonfinite", c->skip_nonfinite = -1)
BAD(b_sr, "stochastic_rounding", c->stochastic_rounding = 5)
BAD(b_ls_neg, "loss_scale", c->loss_scale = -1.0f)
BAD(b_ls_nan, "loss_scale", c->loss_scale = NAN)
BAD(b_ls_inf, "loss_scale", c->loss_scale = INFINITY)
BAD(b_init_zero, "init_loss_scale", c->init_loss_scale = 0.0f)
BAD(b_init_nan, "init_loss_scale", c->init_loss_scale = NAN)
BAD(b_window, "scale_window", c->scale_window = 0)
BAD(b_min_zero, "min_loss_scale", c->min_loss_scale = 0.0f)
BAD(b_min_nan, "min_loss_scale", c->min_loss_scale = NAN)
BAD(b_min_gt_init, "min_loss_scale", (c->param_dtype = SG_F16, c->min_loss_scale = 1e6f))
BAD(b_size, "struct_size", c->struct_size = 3)

static void test_config_check(void) {
  printf("config check rejects each bad field ...\n");
  static const struct {
    mutator f;
    const char *field;
  } cases[] = {{b_strategy, "strategy"},
               {b_strategy_neg, "strategy"},
               {b_device, "device"},
               {b_cuda_device, "cuda_device"},
               {b_param_dtype, "param_dtype"},
               {b_grad_dtype, "grad_dtype"},
               {b_reduce_dtype, "reduce_dtype"},
               {b_accum_f16, "accum_dtype"},
               {b_accum_bad, "accum_dtype"},
               {b_bucket_f32, "bucket_bytes"},
               {b_bucket_bf16, "bucket_bytes"},
               {b_staging0, "staging_buckets"},
               {b_staging65, "staging_buckets"},
               {b_lr_neg, "lr"},
               {b_lr_nan, "lr"},
               {b_lr_inf, "lr"},
               {b_beta1_big, "beta1"},
               {b_beta1_one, "beta1"},
               {b_beta1_neg, "beta1"},
               {b_beta1_nan, "beta1"},
               {b_beta2_one, "beta2"},
               {b_beta2_nan, "beta2"},
               {b_eps_zero, "eps"},
               {b_eps_nan, "eps"},
               {b_wd_neg, "weight_decay"},
               {b_wd_nan, "weight_decay"},
               {b_clip_neg, "max_grad_norm"},
               {b_clip_nan, "max_grad_norm"},
               {b_avg, "grad_average"},
               {b_skip, "skip_nonfinite"},
               {b_sr, "stochastic_rounding"},
               {b_ls_neg, "loss_scale"},
               {b_ls_nan, "loss_scale"},
               {b_ls_inf, "loss_scale"},
               {b_init_zero, "init_loss_scale"},
               {b_init_nan, "init_loss_scale"},
               {b_window, "scale_window"},
               {b_min_zero, "min_loss_scale"},
               {b_min_nan, "min_loss_scale"},
               {b_min_gt_init, "min_loss_scale"},
               {b_size, "struct_size"}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    sg_config c;
    sg_config_init(&c, sizeof c);
    cases[i].f(&c);
    char want[64];
    snprintf(want, sizeof want, "sg_engine_create: cfg->%s ", cases[i].field);
    sg__err_clear();
    sg_status st = sg__config_check(&c, "sg_engine_create");
    CHECK(st == SG_ERR_INVALID_ARGUMENT && strstr(sg_last_error(), want) == sg_last_error(),
          "case %zu (%s): %s '%s'", i, cases[i].field, sg_status_string(st), sg_last_error());
    if (i < 3 || cases[i].f == b_beta1_big) printf("  %s\n", sg_last_error());
  }
  sg_config c;
  sg_config_init(&c, sizeof c);
  sg__config_check(&c, "f");
  c.beta1 = 1.5f;
  sg__config_check(&c, "sg_engine_create");
  CHECK(strcmp(sg_last_error(), "sg_engine_create: cfg->beta1 must be in [0, 1) (got 1.5)") == 0,
        "'%s'", sg_last_error());
  /* Edge values that are legal. */
  sg_config_init(&c, sizeof c);
  c.lr = 0.0f;
  c.beta1 = 0.0f;
  c.beta2 = 0.0f;
  c.weight_decay = 0.0f;
  c.staging_buckets = 64;
  c.grad_dtype = SG_BF16;
  c.bucket_bytes = 128;
  c.accum_dtype = SG_BF16;
  c.timeout_ms = 0;
  c.strategy = SG_NO_SHARD;
  c.device = SG_DEVICE_CUDA;
  c.cuda_device = 3;
  c.scale_window = 1;
  CHECK(sg__config_check(&c, "f") == SG_OK, "edge values accepted: %s", sg_last_error());
}

static void test_dynamic_scale(void) {
  printf("dynamic loss scale ...\n");
  sg_config c;
  sg_config_init(&c, sizeof c);
  CHECK(sg__config_dynamic_scale(&c) == 0, "f32: static");
  c.param_dtype = SG_BF16;
  c.grad_dtype = SG_BF16;
  CHECK(sg__config_dynamic_scale(&c) == 0, "bf16: static");
  c.param_dtype = SG_F16;
  CHECK(sg__config_dynamic_scale(&c) == 1, "f16 params: dynamic");
  c.param_dtype = SG_F32;
  c.grad_dtype = SG_F16;
  CHECK(sg__config_dynamic_scale(&c) == 1, "f16 grads: dynamic");
  c.loss_scale = 128.0f;
  CHECK(sg__config_dynamic_scale(&c) == 0, "explicit loss_scale: static");
  CHECK(sg__config_dynamic_scale(NULL) == 0, "NULL");
}

/* ---- logging ---- */

static char g_dir[] = "/tmp/sg_test_core_XXXXXX";

static int file_text(const char *path, char *buf, size_t cap) {
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  size_t n = fread(buf, 1, cap - 1, f);
  buf[n] = '\0';
  fclose(f);
  return (int)n;
}

/* Child process with its own environment: the logger reads SG_LOG once per process. */
static int log_child_default_level(void) {
  char path[256], buf[4096];
  snprintf(path, sizeof path, "%s/default_%%r.log", g_dir);
  unsetenv("SG_LOG");
  setenv("SG_LOG_FILE", path, 1);
  SG_LOG(SG_LOG_INFO, 1, "info line must not appear");
  SG_LOG(SG_LOG_WARN, 1, "warn line %d", 7);
  snprintf(path, sizeof path, "%s/default_1.log", g_dir);
  if (file_text(path, buf, sizeof buf) < 0) return 2;
  if (strstr(buf, "info line")) return 3;
  if (!strstr(buf, "shardgrad[1] WARN test_core.c:")) return 4;
  if (!strstr(buf, ": warn line 7\n")) return 5;
  return sg__log_enabled(SG_LOG_DEBUG) ? 6 : 0;
}

/* SG_LOG_FILE that cannot be opened: lines go to stderr instead. */
static int log_child_fallback(void) {
  char path[256], buf[4096];
  snprintf(path, sizeof path, "%s/stderr.txt", g_dir);
  FILE *err = fopen(path, "w");
  if (!err || dup2(fileno(err), 2) < 0) return 2;
  setenv("SG_LOG", "info", 1);
  setenv("SG_LOG_FILE", "/nonexistent_dir_sg/x_%r.log", 1);
  SG_LOG(SG_LOG_INFO, 4, "fallback %s", "ok");
  SG_LOG(SG_LOG_DEBUG, 4, "debug must not appear");
  fflush(stderr);
  if (file_text(path, buf, sizeof buf) < 0) return 3;
  if (!strstr(buf, "shardgrad[4] INFO test_core.c:") || !strstr(buf, ": fallback ok\n")) return 4;
  return strstr(buf, "debug must not") ? 5 : 0;
}

static void run_child(int (*fn)(void), const char *what) {
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) _exit(fn());
  int status = -1;
  waitpid(pid, &status, 0);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s: child exit %d", what,
        WIFEXITED(status) ? WEXITSTATUS(status) : -1);
}

static void *log_thread(void *arg) {
  int t = *(const int *)arg;
  for (int i = 0; i < 200; i++) SG_LOG(SG_LOG_DEBUG, 7, "thread %d line %d", t, i);
  return NULL;
}

static int count_lines(const char *buf, const char *must) {
  int n = 0;
  for (const char *p = buf; *p;) {
    const char *e = strchr(p, '\n');
    if (!e) return -1; /* a torn last line */
    if (strncmp(p, must, strlen(must)) != 0) return -1;
    n++;
    p = e + 1;
  }
  return n;
}

static void test_logging(void) {
  printf("logging: default level, stderr fallback, SG_LOG_FILE with %%r, threads ...\n");
  CHECK(mkdtemp(g_dir) != NULL, "mkdtemp");
  run_child(log_child_default_level, "default level is warn");
  run_child(log_child_fallback, "unopenable SG_LOG_FILE falls back to stderr");
  char path[256], buf[1 << 16];
  snprintf(path, sizeof path, "%s/rank_%%r.log", g_dir);
  setenv("SG_LOG", "debug", 1);
  setenv("SG_LOG_FILE", path, 1);
  CHECK(sg__log_enabled(SG_LOG_DEBUG) && sg__log_enabled(SG_LOG_WARN), "debug level enabled");
  int line = __LINE__ + 1;
  SG_LOG(SG_LOG_INFO, 3, "hello %d", 42);
  SG_LOG(SG_LOG_WARN, -1, "no rank");
  snprintf(path, sizeof path, "%s/rank_3.log", g_dir);
  char want[128];
  snprintf(want, sizeof want, "shardgrad[3] INFO test_core.c:%d: hello 42\n", line);
  CHECK(file_text(path, buf, sizeof buf) > 0 && strcmp(buf, want) == 0, "rank 3 file: '%s'", buf);
  snprintf(path, sizeof path, "%s/rank_x.log", g_dir);
  CHECK(file_text(path, buf, sizeof buf) > 0 && strstr(buf, "shardgrad[-] WARN ") == buf,
        "rankless file: '%s'", buf);
  unlink(path);
  pthread_t th[4];
  int ids[4] = {0, 1, 2, 3};
  for (int i = 0; i < 4; i++) pthread_create(&th[i], NULL, log_thread, &ids[i]);
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  snprintf(path, sizeof path, "%s/rank_7.log", g_dir);
  CHECK(file_text(path, buf, sizeof buf) > 0, "rank 7 file exists");
  CHECK(count_lines(buf, "shardgrad[7] DEBUG test_core.c:") == 800,
        "800 whole lines from 4 threads");
  const char *names[] = {"rank_3.log", "rank_7.log", "default_1.log", "stderr.txt"};
  for (int i = 0; i < 4; i++) {
    snprintf(path, sizeof path, "%s/%s", g_dir, names[i]);
    unlink(path);
  }
  CHECK(rmdir(g_dir) == 0, "only the expected files were written");
}

int main(void) {
  test_status_strings();
  test_errors();
  test_error_threads();
  test_util();
  test_config_init();
  test_config_check();
  test_dynamic_scale();
  test_logging();
  return sg_test_summary("");
}
