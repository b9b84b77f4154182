/* NCCL loaded at run time: see sg_nccl_dl.h for why and in which order it is looked for. */
#ifdef SG_HAVE_NCCL

#define _GNU_SOURCE /* RTLD_DEFAULT, RTLD_NOLOAD, dladdr */

#include <dlfcn.h>   /* dlopen, dlsym, dlerror, dladdr */
#include <pthread.h> /* pthread_once */
#include <stdarg.h>  /* va_list */
#include <stdio.h>   /* vsnprintf */
#include <stdlib.h>
#include <string.h>  /* strlen */

#include "sg_nccl_dl.h"

/* The major version of an NCCL version code: X*1000+Y*100+Z up to 2.8, X*10000+Y*100+Z after. */
#define SG__NCCL_MAJOR_OF(code) ((code) >= 10000 ? (code) / 10000 : (code) / 1000)
#ifdef NCCL_MAJOR
#define SG__NCCL_HEADER_MAJOR NCCL_MAJOR
#else
#define SG__NCCL_HEADER_MAJOR SG__NCCL_MAJOR_OF(NCCL_VERSION_CODE)
#endif

/* Written once under sg__nccl_once, read-only afterwards (pthread_once orders the reads). */
static pthread_once_t sg__nccl_once = PTHREAD_ONCE_INIT;
static sg__nccl_lib sg__nccl_table;
static int sg__nccl_loaded;
static char sg__nccl_why[768]; /* why loading failed: every place tried */

/* Appends to sg__nccl_why; a text that does not fit is cut. */
static void sg__nccl_why_add(const char *fmt, ...) {
  size_t len = strlen(sg__nccl_why);
  if (len + 1 >= sizeof sg__nccl_why) return;
  va_list ap;
  va_start(ap, fmt);
  (void)vsnprintf(sg__nccl_why + len, sizeof sg__nccl_why - len, fmt, ap);
  va_end(ap);
}

static const char *sg__nccl_dlerror(void) {
  const char *e = dlerror();
  return e ? e : "unknown dlerror";
}

/* Looks up every function of the table in h (a dlopen handle or RTLD_DEFAULT). Returns the
 * name of the first missing one, or NULL when all are there. dlsym's void * is converted to a
 * function pointer, as POSIX allows. */
static const char *sg__nccl_bind(void *h, sg__nccl_lib *t) {
#define SG__NCCL_BIND(f)            \
  do {                              \
    void *p_ = dlsym(h, "nccl" #f); \
    if (!p_) return "nccl" #f;      \
    t->f = (__typeof__(t->f))p_;    \
  } while (0)
  SG__NCCL_BIND(GetVersion);
  SG__NCCL_BIND(GetErrorString);
  SG__NCCL_BIND(GetLastError);
  SG__NCCL_BIND(GetUniqueId);
  SG__NCCL_BIND(CommInitRankConfig);
  SG__NCCL_BIND(CommGetAsyncError);
  SG__NCCL_BIND(CommFinalize);
  SG__NCCL_BIND(CommDestroy);
  SG__NCCL_BIND(CommAbort);
  SG__NCCL_BIND(GroupStart);
  SG__NCCL_BIND(GroupEnd);
  SG__NCCL_BIND(AllReduce);
  SG__NCCL_BIND(ReduceScatter);
  SG__NCCL_BIND(AllGather);
  SG__NCCL_BIND(Broadcast);
  SG__NCCL_BIND(Send);
  SG__NCCL_BIND(Recv);
#undef SG__NCCL_BIND
  t->CommSplit = (__typeof__(t->CommSplit))dlsym(h, "ncclCommSplit"); /* optional */
  return NULL;
}

/* The file that holds the bound functions, for messages. */
static const char *sg__nccl_file(const sg__nccl_lib *t) {
  Dl_info info;
  if (dladdr((void *)t->GetVersion, &info) && info.dli_fname && *info.dli_fname)
    return info.dli_fname;
  return "?";
}

/* Takes the NCCL in h (from `what`) if it is complete and of the build's major version. On
 * failure the handle is closed (an NCCL that was loaded before stays loaded: dlopen counted
 * our reference) and the reason noted. */
static int sg__nccl_take(void *h, const char *what) {
  sg__nccl_lib t;
  memset(&t, 0, sizeof t);
  const char *missing = sg__nccl_bind(h, &t);
  int v = 0;
  if (missing) {
    sg__nccl_why_add("%s: has no %s (not NCCL, or NCCL older than 2.14)", what, missing);
  } else if (t.GetVersion(&v) != ncclSuccess) {
    sg__nccl_why_add("%s (%s): ncclGetVersion failed", what, sg__nccl_file(&t));
  } else if (SG__NCCL_MAJOR_OF(v) != SG__NCCL_HEADER_MAJOR) {
    sg__nccl_why_add("%s (%s): NCCL version %d, built against major version %d", what,
                     sg__nccl_file(&t), v, SG__NCCL_HEADER_MAJOR);
  } else {
    t.version = v;
    sg__nccl_table = t;
    sg__nccl_loaded = 1;
    SG_LOG(SG_LOG_INFO, -1, "NCCL %d.%d.%d from %s (%s)", SG__NCCL_MAJOR_OF(v),
           v >= 10000 ? v / 100 % 100 : v / 100 % 10, v % 100, sg__nccl_file(&t), what);
    return 1;
  }
  if (h != RTLD_DEFAULT) (void)dlclose(h);
  return 0;
}

/* Step 1: an NCCL the process already has. 1: taken, -1: there is one but it is unusable
 * (another would clash with it), 0: none. */
static int sg__nccl_try_present(void) {
  void *h = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
  const char *what = "already loaded libnccl.so.2";
  if (!h) {
    (void)dlerror(); /* not loaded: not an error */
    if (!dlsym(RTLD_DEFAULT, "ncclGetVersion")) {
      (void)dlerror();
      sg__nccl_why_add("no NCCL loaded in the process");
      return 0;
    }
    h = RTLD_DEFAULT;
    what = "NCCL in the global symbol scope";
  }
  if (!sg__nccl_take(h, what)) return -1;
  const char *env = sg__env_text(SG_ENV_NCCL_LIBRARY);
  if (env && *env)
    SG_LOG(SG_LOG_WARN, -1, "SG_NCCL_LIBRARY=%s not used: the process already has NCCL (%s)", env,
           sg__nccl_file(&sg__nccl_table));
  return 1;
}

/* Opens `name` (a file name or path). 1: taken, -1: opened but unusable, 0: cannot open. */
static int sg__nccl_try_open(const char *name) {
  void *h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    sg__nccl_why_add("; %.240s", sg__nccl_dlerror()); /* dlerror's text names the file */
    return 0;
  }
  sg__nccl_why_add("; "); /* before sg__nccl_take's reason, should there be one */
  return sg__nccl_take(h, name) ? 1 : -1;
}

static void sg__nccl_load_once(void) {
  int r = sg__nccl_try_present();
  if (r != 0) return;
  const char *env = sg__env_text(SG_ENV_NCCL_LIBRARY);
  if (env && *env) {
    /* An explicit choice: another NCCL in its place would hide the mistake. */
    sg__nccl_why_add("; SG_NCCL_LIBRARY is set, so nothing else was tried");
    (void)sg__nccl_try_open(env);
    return;
  }
  static const char *const names[] = {"libnccl.so.2", "libnccl.so",
#ifdef SG_NCCL_BUILD_LIBRARY
                                      SG_NCCL_BUILD_LIBRARY,
#endif
                                      NULL};
  for (int i = 0; names[i] && r == 0; i++) r = sg__nccl_try_open(names[i]);
  if (r == 0) sg__nccl_why_add("; set SG_NCCL_LIBRARY to the path of libnccl.so.2");
}

sg_status sg__nccl_lib_load(const char *fn, const sg__nccl_lib **lib) {
  if (!fn || !lib) return sg__err(SG_ERR_INVALID_ARGUMENT, "sg__nccl_lib_load: fn or lib is NULL");
  *lib = NULL;
  int e = pthread_once(&sg__nccl_once, sg__nccl_load_once);
  if (e != 0) return sg__err(SG_ERR_INTERNAL, "%s: pthread_once failed (%d)", fn, e);
  if (!sg__nccl_loaded)
    return sg__err(SG_ERR_UNSUPPORTED, "%s: cannot load NCCL (%s)", fn, sg__nccl_why);
  *lib = &sg__nccl_table;
  return SG_OK;
}

#else  /* !SG_HAVE_NCCL */
typedef int sg__nccl_dl_not_built; /* ISO C wants a translation unit to declare something */
#endif /* SG_HAVE_NCCL */
