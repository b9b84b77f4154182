/* Checkpoint files under a planted symbolic link (issue 30, item 3.2). Somebody who can write
 * into a shared checkpoint directory plants links (and hard links) at the names the library
 * writes or reads; a victim file outside the directory must never change, and each call either
 * succeeds without touching it or fails with SG_ERR_IO saying what is in the way:
 *   manifest.tmp -> victim          sg_save refused ("symbolic link"); the checkpoint already
 *                                   there still loads; the failed save removes the link (not
 *                                   its target) with its other names, so the next save works
 *   manifest.tmp hard link to victim   sg_save succeeds (the name is replaced, not written)
 *   manifest.tmp stale regular file    sg_save succeeds (a crashed save never blocks the next)
 *   manifest -> victim              sg_save succeeds, the manifest is a regular file after
 *   g1.r0.shard -> victim           sg_save succeeds (generation 2), the link is removed
 *   save.lock -> victim             sg_save refused ("symbolic link"), the victim's text in no
 *                                   message
 *   <path>.tmp -> victim            sg_export refused; a stale regular <path>.tmp is replaced
 *   <path> -> victim                sg_export succeeds, <path> a regular file after, sg_import
 *                                   reads it back
 *   manifest, rank file -> a real checkpoint's file   sg_load refused ("symbolic link")
 *   sg_import of a link to a real export              followed (the caller's own path) */
#define _GNU_SOURCE /* mkdtemp, symlink, link */

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "test_ckpt_util.h"

static char g_root[256], g_victim[300];
static const model_cfg k_m = {3, {100, 37, 300}, SG_SHARD_GRAD_OP, SG_F32, 1024, 0, NULL};
static const char k_text[] = "the victim's own bytes: must never change\n";

/* ---------------------------------------------------------------------------------------- */
/* helpers                                                                                   */

static void in_root(char *buf, size_t n, const char *name) { snprintf(buf, n, "%s/%s", g_root, name); }

static void write_text(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (f) {
    fputs(text, f);
    fclose(f);
  }
}

/* 1 when the victim still holds exactly k_text and is a regular file with one name. */
static int victim_intact(void) {
  struct stat s;
  if (lstat(g_victim, &s) != 0 || !S_ISREG(s.st_mode)) return 0;
  char buf[256] = {0};
  FILE *f = fopen(g_victim, "r");
  if (!f) return 0;
  const size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  return n == strlen(k_text) && memcmp(buf, k_text, n) == 0;
}

static void reset_victim(void) {
  unlink(g_victim);
  write_text(g_victim, k_text);
}

static int is_link(const char *dir, const char *name) {
  char p[700];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  struct stat s;
  return lstat(p, &s) == 0 && S_ISLNK(s.st_mode);
}

static int is_regular(const char *path) {
  struct stat s;
  return lstat(path, &s) == 0 && S_ISREG(s.st_mode);
}

static void plant_link(const char *dir, const char *name, const char *target) {
  char p[700];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  unlink(p);
  if (symlink(target, p) != 0) printf("symlink %s: %s\n", p, strerror(errno));
}

static void fresh_dir(char *dir, size_t n, const char *name) {
  in_root(dir, n, name);
  mkdir(dir, 0755);
}

static void rm_rf(const char *p) {
  char cmd[800];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", p);
  if (system(cmd) != 0) printf("could not remove %s\n", p);
}

/* One W=1 engine of k_m for the whole test, trained `steps` steps at the start. */
typedef struct {
  sg_comm *c;
  sg_engine *e;
  int ids[MAXP];
} rig;

static int rig_up(rig *r, int steps) {
  memset(r, 0, sizeof *r);
  sg_status st = sg_comm_create_local(1, &r->c);
  if (!st) st = make_engine(r->c, &k_m, &r->e, r->ids);
  if (!st) st = train(r->e, &k_m, r->ids, 0, steps);
  CHECK(st == SG_OK, "engine trained %d steps: %s", steps, sg_last_error());
  return st == SG_OK;
}

static void rig_down(rig *r) {
  sg_engine_destroy(r->e);
  sg_comm_destroy(r->c);
}

/* dir loads into a fresh engine, bitwise equal to what r holds now. */
static int loads_same(rig *r, const char *dir) {
  rig f;
  if (!rig_up(&f, 0)) return 0;
  snap a, b;
  sg_status st = sg_load(f.e, dir);
  int ok = st == SG_OK && take_snap(f.e, &k_m, f.ids, &a) == SG_OK &&
           take_snap(r->e, &k_m, r->ids, &b) == SG_OK && same_snap("reload", &k_m, &a, &b);
  if (st != SG_OK) printf("  load of %s: %s\n", dir, sg_last_error());
  if (st == SG_OK) {
    free_snap(&a);
    free_snap(&b);
  }
  rig_down(&f);
  return ok;
}

/* ---------------------------------------------------------------------------------------- */
/* sg_save                                                                                   */

static void test_save_temp_link(rig *r) {
  char dir[300];
  fresh_dir(dir, sizeof dir, "temp_link");
  CHECK(sg_save(r->e, dir) == SG_OK, "first save: %s", sg_last_error());
  plant_link(dir, "manifest.tmp", g_victim);
  train(r->e, &k_m, r->ids, 3, 4);
  const sg_status st = sg_save(r->e, dir);
  printf("  manifest.tmp a link: %s \"%s\"\n", sg_status_string(st), sg_last_error());
  CHECK(st == SG_ERR_IO && contains(sg_last_error(), "symbolic link"),
        "sg_save with manifest.tmp a link to a victim: SG_ERR_IO naming the link");
  CHECK(victim_intact(), "manifest.tmp a link: the victim is untouched");
  CHECK(!is_link(dir, "manifest"), "manifest.tmp a link: the manifest is no link");
  snap old;
  rig f;
  if (rig_up(&f, 0)) {
    CHECK(sg_load(f.e, dir) == SG_OK && take_snap(f.e, &k_m, f.ids, &old) == SG_OK,
          "manifest.tmp a link: the checkpoint of the first save still loads: %s",
          sg_last_error());
    free_snap(&old);
    rig_down(&f);
  }
  /* the failed save cleared its names (the link, not what it points to) */
  CHECK(sg_save(r->e, dir) == SG_OK && loads_same(r, dir) && victim_intact(),
        "the next save works and loads: %s", sg_last_error());
  rm_rf(dir);
}

static void test_save_temp_hardlink(rig *r) {
  char dir[300], p[400];
  fresh_dir(dir, sizeof dir, "temp_hardlink");
  snprintf(p, sizeof p, "%s/manifest.tmp", dir);
  if (link(g_victim, p) != 0) {
    printf("  (hard link into %s not possible: %s; case skipped)\n", dir, strerror(errno));
    rm_rf(dir);
    return;
  }
  const sg_status st = sg_save(r->e, dir);
  CHECK(st == SG_OK && victim_intact() && is_regular(p) == 0 && loads_same(r, dir),
        "manifest.tmp a hard link to the victim: sg_save succeeds, the victim untouched, no "
        "temporary left: %s",
        sg_last_error());
  reset_victim();
  rm_rf(dir);
}

static void test_save_stale_temp(rig *r) {
  char dir[300], p[400];
  fresh_dir(dir, sizeof dir, "stale_temp");
  CHECK(sg_save(r->e, dir) == SG_OK, "first save: %s", sg_last_error());
  snprintf(p, sizeof p, "%s/manifest.tmp", dir);
  write_text(p, "half a manifest of a save that crashed");
  chmod(p, 0444); /* even a read-only leftover */
  train(r->e, &k_m, r->ids, 4, 5);
  CHECK(sg_save(r->e, dir) == SG_OK && !is_regular(p) && loads_same(r, dir),
        "a stale regular manifest.tmp does not block the next save: %s", sg_last_error());
  rm_rf(dir);
}

static void test_save_final_links(rig *r) {
  char dir[300];
  fresh_dir(dir, sizeof dir, "final_links");
  plant_link(dir, "manifest", g_victim);
  plant_link(dir, "g1.r0.shard", g_victim);
  const sg_status st = sg_save(r->e, dir);
  CHECK(st == SG_OK, "manifest and g1.r0.shard links to the victim: sg_save succeeds: %s",
        sg_last_error());
  CHECK(victim_intact(), "final names links: the victim is untouched");
  CHECK(!is_link(dir, "manifest") && !is_link(dir, "g1.r0.shard") && !is_link(dir, "g2.r0.shard"),
        "final names links: the manifest is a regular file, the planted rank file link removed");
  CHECK(loads_same(r, dir), "final names links: the checkpoint loads");
  rm_rf(dir);
}

static void test_save_lock_link(rig *r) {
  char dir[300];
  fresh_dir(dir, sizeof dir, "lock_link");
  write_text(g_victim, "shardgrad save lock\nsecret line of the victim\n");
  plant_link(dir, "save.lock", g_victim);
  const sg_status st = sg_save(r->e, dir);
  printf("  save.lock a link: %s \"%s\"\n", sg_status_string(st), sg_last_error());
  CHECK(st == SG_ERR_IO && contains(sg_last_error(), "symbolic link") &&
            !contains(sg_last_error(), "secret"),
        "save.lock a link: SG_ERR_IO naming the link, nothing of the victim in the message");
  reset_victim();
  rm_rf(dir);
}

/* ---------------------------------------------------------------------------------------- */
/* sg_export / sg_import                                                                     */

static void test_export(rig *r) {
  char dir[300], path[400], tmp[420];
  fresh_dir(dir, sizeof dir, "export");
  snprintf(path, sizeof path, "%s/model.safetensors", dir);
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  unlink(tmp);
  if (symlink(g_victim, tmp) != 0) printf("symlink %s: %s\n", tmp, strerror(errno));
  sg_status st = sg_export(r->e, path);
  printf("  <path>.tmp a link: %s \"%s\"\n", sg_status_string(st), sg_last_error());
  CHECK(st == SG_ERR_IO && contains(sg_last_error(), "symbolic link") && victim_intact() &&
            !is_regular(path),
        "sg_export with <path>.tmp a link: SG_ERR_IO, the victim untouched, no file made");
  unlink(tmp);
  write_text(tmp, "a crashed export's half");
  st = sg_export(r->e, path);
  CHECK(st == SG_OK && is_regular(path) && !is_regular(tmp),
        "a stale regular <path>.tmp is replaced: sg_export succeeds: %s", sg_last_error());
  unlink(path);
  if (symlink(g_victim, path) != 0) printf("symlink %s: %s\n", path, strerror(errno));
  st = sg_export(r->e, path);
  CHECK(st == SG_OK && victim_intact() && is_regular(path),
        "<path> a link to the victim: sg_export replaces the link, the victim untouched: %s",
        sg_last_error());
  /* the caller's own path may be a link (a hub cache's snapshot is one): followed */
  char alias[420];
  snprintf(alias, sizeof alias, "%s/alias.safetensors", dir);
  if (symlink(path, alias) != 0) printf("symlink %s: %s\n", alias, strerror(errno));
  st = sg_import(r->e, alias);
  CHECK(st == SG_OK, "sg_import through a link the caller names: followed: %s", sg_last_error());
  rm_rf(dir);
}

/* ---------------------------------------------------------------------------------------- */
/* sg_load                                                                                   */

static void test_load_links(rig *r) {
  char real[300], dir[300], p[400], q[400];
  fresh_dir(real, sizeof real, "load_real");
  fresh_dir(dir, sizeof dir, "load_links");
  CHECK(sg_save(r->e, real) == SG_OK, "save for the load cases: %s", sg_last_error());
  /* a directory of links to a real checkpoint's files */
  snprintf(p, sizeof p, "%s/manifest", real);
  plant_link(dir, "manifest", p);
  snprintf(p, sizeof p, "%s/manifest", dir);
  rig f;
  if (!rig_up(&f, 0)) return;
  sg_status st = sg_load(f.e, dir);
  printf("  manifest a link: %s \"%s\"\n", sg_status_string(st), sg_last_error());
  CHECK(st == SG_ERR_IO && contains(sg_last_error(), "symbolic link"),
        "sg_load with the manifest a link: refused, naming the link");
  /* the manifest real, a rank file a link */
  unlink(p);
  snprintf(q, sizeof q, "%s/manifest", real);
  char cmd[1000];
  snprintf(cmd, sizeof cmd, "cp '%s' '%s'", q, p);
  CHECK(system(cmd) == 0, "copy the manifest");
  char cmd2[1000];
  snprintf(cmd2, sizeof cmd2, "cd '%s' && for f in g*.shard; do ln -s '%s'/$f '%s'/$f; done", real,
           real, dir);
  CHECK(system(cmd2) == 0, "link the rank files");
  st = sg_load(f.e, dir);
  printf("  rank file a link: %s \"%s\"\n", sg_status_string(st), sg_last_error());
  CHECK(st == SG_ERR_IO && contains(sg_last_error(), "symbolic link"),
        "sg_load with a rank file a link: refused, naming the link");
  CHECK(sg_load(f.e, real) == SG_OK, "the engine still loads the real checkpoint: %s",
        sg_last_error());
  rig_down(&f);
  rm_rf(dir);
  rm_rf(real);
}

int main(void) {
  setvbuf(stdout, NULL, _IOLBF, 0);
  const char *t = getenv("TMPDIR");
  snprintf(g_root, sizeof g_root, "%s/sg_links_XXXXXX", t && *t ? t : "/tmp");
  if (!mkdtemp(g_root)) return 1;
  in_root(g_victim, sizeof g_victim, "victim.txt");
  reset_victim();
  rig r;
  if (rig_up(&r, 3)) {
    test_save_temp_link(&r);
    test_save_temp_hardlink(&r);
    test_save_stale_temp(&r);
    test_save_final_links(&r);
    test_save_lock_link(&r);
    test_export(&r);
    test_load_links(&r);
    rig_down(&r);
  }
  CHECK(victim_intact(), "at the end the victim is untouched");
  rm_rf(g_root);
  return finish();
}
