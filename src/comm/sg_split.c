/* sg_comm_split: new communicators from the ranks of one, by color (DESIGN.md section 6).
 *
 * The rendezvous runs on a channel of its own (sg__comm_bind), so it never mixes with the
 * collectives of engines already using the communicator, and it is bounded by a deadline: the
 * colors and keys of every rank are all-gathered first, and only then does the backend make
 * the new communicators (the MPI backend calls the blocking MPI_Comm_split, which can no longer
 * wait for a missing peer). The local backend's part is here too: it needs nothing but the
 * channel's all-gather and sg_comm_create_local. */
#include <stdint.h> /* uintptr_t, uint64_t */
#include <stdlib.h> /* calloc, free */

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

/* The rank of c that becomes rank 0 of `rank`'s color. */
static int leader_of(const int *colors, const int *keys, int world, int rank) {
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
    const int lead = leader_of(colors, keys, world, me);
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

sg_status sg_comm_split(sg_comm *c, int color, int key, sg_comm **out) {
  static const char fn[] = "sg_comm_split";
  if (!out) return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: out is NULL", fn);
  *out = NULL;
  SG_TRY(sg__comm_usable(c, fn));
  if (c->parent)
    return sg__err(SG_ERR_INVALID_ARGUMENT, "%s: comm is an engine's channel, not a communicator",
                   fn);
  if (!c->ops->split)
    return sg__err(SG_ERR_UNSUPPORTED,
                   "%s: %s communicators cannot be split (split the communicator they were made "
                   "from, then create one per part)",
                   fn, c->ops->name);
  sg_comm *chan = NULL;
  SG_TRY(sg__comm_bind(c, NULL, SG__SPLIT_TIMEOUT_MS, &chan));
  const int64_t dl = sg__deadline(SG__SPLIT_TIMEOUT_MS);
  const int world = c->world;
  int *tab = calloc((size_t)world * 4u, sizeof *tab); /* (color, key) per rank, then colors, keys */
  sg_status st = tab ? SG_OK : sg__err(SG_ERR_OUT_OF_MEMORY, "%s: out of memory", fn);
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
  }
  free(tab);
  sg__comm_unbind(chan);
  if (st != SG_OK) {
    sg_comm_destroy(*out);
    *out = NULL;
    c->broken = 1; /* ranks may have left at different points of the rendezvous */
  }
  return st;
}
