/* sg_comm_split: new communicators from the ranks of one, by color (DESIGN.md section 6).
 *
 * The rendezvous runs on a channel of its own (sg__comm_bind), so it never mixes with the
 * collectives of engines already using the communicator, and it is bounded by a deadline: the
 * colors and keys of every rank are all-gathered first, and only then does the backend make
 * the new communicators (the MPI backend calls the blocking MPI_Comm_split, which can no longer
 * wait for a missing peer). The local backend's part is here too: it needs nothing but the
 * channel's all-gather and sg_comm_create_local.
 *
 * sg_comm_split_nodes makes both of its communicators in one rendezvous: one channel, one
 * gather of every rank's arguments (and, for nodes by host, the node of every rank), then the
 * backend's split twice on that channel. So a backend whose channels are costly (NCCL before
 * 2.18 has only the communicator's first channel) pays once. */
#define _POSIX_C_SOURCE 200809L /* gethostname */

#include <stdint.h> /* uintptr_t, uint64_t */
#include <stdio.h>  /* snprintf */
#include <stdlib.h> /* calloc, free */
#include <string.h> /* memset, strncmp */
#include <unistd.h> /* gethostname */

#include "sg_comm.h" /* sg_comm, sg__comm_ops, sg__comm_bind */

#define SG__SPLIT_TIMEOUT_MS 600000 /* as sg_config's default timeout_ms */

int sg__comm_split_rank(const int *colors, const int *keys, int world, int rank, int *size) {
  int n = 0, below = 0;
  for (int s = 0; s < world; s++) {
    if (colors[s] != colors[rank]) continue;
    n++;
    below += keys[s] < keys[rank] || (keys[s] == keys[rank] && s < rank);
  }
  *size = n;
  return colors[rank] < 0 ? -1 : below;
}

int sg__comm_split_leader(const int *colors, const int *keys, int world, int rank) {
  int size = 0;
  for (int s = 0; s < world; s++)
    if (colors[s] == colors[rank] && sg__comm_split_rank(colors, keys, world, s, &size) == 0)
      return s;
  return rank; /* unreachable: every color has a rank 0 */
}

/* Threads: the new rank 0 of every color makes that color's group and posts the array of its
 * communicators; each member takes its own; a second rendezvous tells the makers that every
 * member has read, so the arrays can go. */
sg_status sg__comm_split_threads(sg_comm *chan, const int *colors, const int *keys,
                                 int64_t deadline_ms, sg_comm **out) {
  static const char fn[] = "sg_comm_split(local)";
  const int world = chan->world, me = chan->rank;
  int size = 0;
  const int nr = sg__comm_split_rank(colors, keys, world, me, &size);
  uint64_t *slots = calloc((size_t)world, sizeof *slots);
  if (!slots) return sg__comm_fail(chan, SG_ERR_OUT_OF_MEMORY, fn, "out of memory (world %d)", world);
  sg_comm **made = NULL;
  if (nr == 0 && (made = calloc((size_t)size, sizeof *made)) != NULL &&
      sg_comm_create_local(size, made) != SG_OK) {
    free(made);
    made = NULL;
  }
  slots[me] = (uint64_t)(uintptr_t)made;
  sg_status st = chan->ops->all_gather(chan, slots, sizeof *slots, deadline_ms);
  if (st == SG_OK && nr >= 0) {
    const int lead = sg__comm_split_leader(colors, keys, world, me);
    sg_comm **group = (sg_comm **)(uintptr_t)slots[lead];
    if (group)
      *out = group[nr];
    else
      st = sg__comm_fail(chan, SG_ERR_OUT_OF_MEMORY, fn,
                         "rank %d, which makes the group of color %d (%d ranks), ran out of memory",
                         lead, colors[me], size);
  }
  const sg_status st2 = chan->ops->all_gather(chan, slots, sizeof *slots, deadline_ms);
  if (st2 == SG_OK) free(made); /* else a member may still read it: leak it, the group broken */
  free(slots);
  return st != SG_OK ? st : st2;
}


/* The first steps of every split: c must be a splittable communicator; its host channel. */
static sg_status open_channel(sg_comm *c, const char *fn, sg_comm **chan) {
  SG_TRY(sg__comm_usable(c, fn));
  if (c->parent)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: comm is an engine's channel, not a communicator",
                   fn);
  if (!c->ops->split)
    return sg__err(SG_ERR_UNSUPPORTED,
                   "%s: %s communicators cannot be split (split the communicator they were made "
                   "from, then create one per part)",
                   fn, c->ops->name);
  return sg__comm_bind(c, NULL, SG__SPLIT_TIMEOUT_MS, chan);
}

/* broke: the failure came from inside the rendezvous (a collective, the backend), which leaves
 * the ranks at different points of it, so c is broken; a verdict every rank reached from the
 * same table leaves c as it was. */
static sg_status close_channel(sg_comm *c, sg_comm *chan, sg_status st, int broke, sg_comm **outs,
                               int nout) {
  sg__comm_unbind(chan);
  if (st == SG_OK) return SG_OK;
  for (int i = 0; i < nout; i++) {
    sg_comm_destroy(outs[i]);
    outs[i] = NULL;
  }
  if (broke) c->broken = 1;
  return st;
}

sg_status sg_comm_split(sg_comm *c, int color, int key, sg_comm **out) {
  static const char fn[] = "sg_comm_split";
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
  *out = NULL;
  sg_comm *chan = NULL;
  SG_TRY(open_channel(c, fn, &chan));
  const int64_t dl = sg__deadline(SG__SPLIT_TIMEOUT_MS);
  const int world = c->world;
  int *tab = calloc((size_t)world * 4u, sizeof *tab); /* (color, key) per rank, then colors, keys */
  sg_status st = tab ? SG_OK : sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  int broke = 1;
  if (st == SG_OK) {
    tab[2 * c->rank] = color;
    tab[2 * c->rank + 1] = key;
    st = chan->ops->all_gather(chan, tab, 2 * sizeof *tab, dl);
  }
  if (st == SG_OK) {
    int *colors = tab + 2 * world, *keys = tab + 3 * world;
    for (int r = 0; r < world; r++) {
      colors[r] = tab[2 * r] < 0 ? -1 : tab[2 * r];
      keys[r] = tab[2 * r + 1];
    }
    st = chan->ops->split(chan, colors, keys, dl, out);
    broke = chan->broken; /* unbroken: a verdict every rank reached */
  }
  free(tab);
  return close_channel(c, chan, st, broke, out, 1);
}

/* ---- sg_comm_split_nodes ------------------------------------------------------------------ */

#define SG__HOST_BYTES 256 /* a host name, NUL-padded (POSIX HOST_NAME_MAX is at most 255) */

/* The lowest rank of chan on this rank's host, by host name: for backends without a notion of
 * a node of their own (node_leader NULL). Collective over chan. */
static sg_status leader_by_host_name(sg_comm *chan, int64_t dl, int *leader) {
  static const char fn[] = "sg_comm_split_nodes";
  const int world = chan->world;
  char *names = calloc((size_t)world, SG__HOST_BYTES);
  if (!names) return sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of memory (world %d)", fn, world);
  char *mine = names + (size_t)chan->rank * SG__HOST_BYTES;
  if (gethostname(mine, SG__HOST_BYTES - 1) != 0) snprintf(mine, SG__HOST_BYTES, "?");
  const sg_status st = chan->ops->all_gather(chan, names, SG__HOST_BYTES, dl);
  for (int r = 0; st == SG_OK && r < world; r++)
    if (strncmp(names + (size_t)r * SG__HOST_BYTES, mine, SG__HOST_BYTES) == 0) {
      *leader = r;
      break;
    }
  free(names);
  return st;
}

/* Each rank's record in the rendezvous: its arguments were bad (1/0), its ranks_per_node, and
 * its node: the lowest rank of that node. */
enum { REC_BAD, REC_RPN, REC_NODE, REC_INTS };

typedef struct layout {
  const int *tab; /* world records */
  int world;
} layout;

static int node_of(const layout *l, int r) { return l->tab[(size_t)r * REC_INTS + REC_NODE]; }

/* Ranks of r's node; and how many of them are below r (r's index in its node). */
static int node_size(const layout *l, int r, int *index) {
  int n = 0, below = 0;
  for (int s = 0; s < l->world; s++)
    if (node_of(l, s) == node_of(l, r)) {
      n++;
      below += s < r;
    }
  *index = below;
  return n;
}

/* Nodes ordered by their lowest rank: the position of r's node. */
static int node_ordinal(const layout *l, int r) {
  int n = 0;
  for (int s = 0; s < node_of(l, r); s++) n += node_of(l, s) == s;
  return n;
}

/* Every rank reaches the same verdict from the same table, naming the first rank whose
 * arguments were bad or differ from rank 0's (this rank's own bad arguments: `own`). */
static sg_status check_args(const layout *l, const char *own, const char *fn) {
  if (own) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: %s", fn, own);
  const int rpn0 = l->tab[REC_RPN];
  for (int r = 0; r < l->world; r++) {
    const int *t = l->tab + (size_t)r * REC_INTS;
    if (t[REC_BAD])
      return sg__err(SG_ERR_MISMATCH, "%s: rank %d passed bad arguments (see its error)", fn, r);
    if (t[REC_RPN] != rpn0)
      return sg__err(SG_ERR_MISMATCH, "%s: ranks disagree: rank 0 passed ranks_per_node %d, rank %d %d",
                     fn, rpn0, r, t[REC_RPN]);
  }
  if (rpn0 > 0 && l->world % rpn0 != 0)
    return sg__err(SG_ERR_MISMATCH,
                   "%s: every node must have the same number of ranks: %d ranks are not a "
                   "multiple of ranks_per_node %d",
                   fn, l->world, rpn0);
  return SG_OK;
}

static sg_status check_sizes(const layout *l, const char *fn) {
  int index = 0;
  const int size0 = node_size(l, 0, &index);
  for (int r = 1; r < l->world; r++) {
    const int sz = node_size(l, r, &index);
    if (sz != size0)
      return sg__err(SG_ERR_MISMATCH,
                     "%s: every node must have the same number of ranks: the host of rank 0 has "
                     "%d of the %d ranks, the host of rank %d has %d",
                     fn, size0, l->world, r, sz);
  }
  return SG_OK;
}

/* What this rank got wrong itself, or NULL. */
static const char *own_error(int rpn, sg_comm **shard, sg_comm **replica, char *buf, size_t n) {
  if (!shard || !replica) return shard ? "replica is NULL" : "shard is NULL";
  if (shard == replica) return "shard and replica point to the same place";
  if (rpn < 0) {
    snprintf(buf, n, "ranks_per_node must be >= 0 (0: ranks sharing a host), got %d", rpn);
    return buf;
  }
  return NULL;
}

/* Shard: the ranks of one node, by rank; replica: the ranks of one index in their nodes, by
 * node. Both splits on the rendezvous channel. */
static sg_status split_both(sg_comm *chan, const layout *l, int *colors, int *keys, int64_t dl,
                            sg_comm **outs) {
  int index = 0;
  for (int r = 0; r < l->world; r++) colors[r] = node_of(l, r), keys[r] = r;
  SG_TRY(chan->ops->split(chan, colors, keys, dl, &outs[0]));
  for (int r = 0; r < l->world; r++) {
    (void)node_size(l, r, &index);
    colors[r] = index;
    keys[r] = node_ordinal(l, r);
  }
  return chan->ops->split(chan, colors, keys, dl, &outs[1]);
}

sg_status sg_comm_split_nodes(sg_comm *c, int ranks_per_node, sg_comm **shard,
                              sg_comm **replica) {
  static const char fn[] = "sg_comm_split_nodes";
  if (shard) *shard = NULL;
  if (replica) *replica = NULL;
  char why[128];
  const char *own = own_error(ranks_per_node, shard, replica, why, sizeof why);
  sg_comm *chan = NULL, *outs[2] = {NULL, NULL};
  SG_TRY(open_channel(c, fn, &chan));
  const int64_t dl = sg__deadline(SG__SPLIT_TIMEOUT_MS);
  const int world = c->world, me = c->rank;
  int *tab = calloc((size_t)world * (REC_INTS + 2), sizeof *tab); /* records, colors, keys */
  sg_status st = tab ? SG_OK : sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
  int broke = 1;
  const layout l = {tab, world};
  int *rec = tab ? tab + (size_t)me * REC_INTS : NULL;
  if (st == SG_OK) {
    rec[REC_BAD] = own != NULL;
    rec[REC_RPN] = ranks_per_node;
    rec[REC_NODE] = ranks_per_node > 0 ? me / ranks_per_node * ranks_per_node : 0;
    st = chan->ops->all_gather(chan, tab, REC_INTS * sizeof *tab, dl);
  }
  if (st == SG_OK && (st = check_args(&l, own, fn)) != SG_OK) broke = 0;
  if (st == SG_OK && ranks_per_node == 0) {
    st = chan->ops->node_leader ? chan->ops->node_leader(chan, dl, &rec[REC_NODE])
                                : leader_by_host_name(chan, dl, &rec[REC_NODE]);
    if (st == SG_OK) st = chan->ops->all_gather(chan, tab, REC_INTS * sizeof *tab, dl);
    if (st == SG_OK && (st = check_sizes(&l, fn)) != SG_OK) broke = 0;
  }
  if (st == SG_OK) {
    st = split_both(chan, &l, tab + (size_t)world * REC_INTS,
                    tab + (size_t)world * (REC_INTS + 1), dl, outs);
    broke = chan->broken;
  }
  free(tab);
  st = close_channel(c, chan, st, broke, outs, 2);
  if (st == SG_OK) *shard = outs[0], *replica = outs[1];
  return st;
}
