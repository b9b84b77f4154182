/* An in-process transport for sg_comm_create_xport, shared by the tests of the caller's
 * transport (test_comm --xport, test_comm_xport_split): ranks are threads of one process, a
 * mailbox per group of threads. */
#ifndef SG_TEST_MAILBOX_H
#define SG_TEST_MAILBOX_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shardgrad.h"

/* Posted sends and receives of one group of threads, matched in posting order per (source,
 * destination, tag), as MPI and gloo match them. Completion is reported from inside the
 * callback that finds the match (isend or irecv of either side). */
typedef struct mail {
  int recv, src, dst, tag;
  void *buf;
  size_t bytes;
  void *token;
  struct mail *next;
} mail;

typedef struct mailbox {
  pthread_mutex_t mu;
  mail *head;
  atomic_int released;
  atomic_int fail_sends; /* > 0: isend fails with a message */
} mailbox;

typedef struct xuser {
  mailbox *mb;
  int rank;
  int released; /* this rank's transport released (atomic builtins) */
} xuser;

static inline int mb_post(void *user, int recv, void *buf, size_t bytes, int peer, int tag, void *token,
                   char *msg, size_t cap) {
  xuser *u = user;
  mailbox *mb = u->mb;
  if (!recv && atomic_load(&mb->fail_sends) > 0) {
    snprintf(msg, cap, "mailbox: link to rank %d is down", peer);
    return 3;
  }
  const int src = recv ? peer : u->rank, dst = recv ? u->rank : peer;
  pthread_mutex_lock(&mb->mu);
  mail **pp = &mb->head;
  while (*pp && !((*pp)->recv != recv && (*pp)->src == src && (*pp)->dst == dst &&
                  (*pp)->tag == tag))
    pp = &(*pp)->next;
  if (*pp) {
    mail *m = *pp;
    *pp = m->next;
    pthread_mutex_unlock(&mb->mu);
    const void *from = recv ? m->buf : buf;
    void *to = recv ? buf : m->buf;
    const size_t rb = recv ? bytes : m->bytes, sb = recv ? m->bytes : bytes;
    const int ok = rb == sb;
    if (ok) memcpy(to, from, sb);
    const char *why = ok ? NULL : "message of another size";
    sg_xport_done(m->token, !ok, ok && m->recv ? sb : 0, why);
    sg_xport_done(token, !ok, ok && recv ? sb : 0, why);
    free(m);
    return 0;
  }
  mail *m = calloc(1, sizeof *m);
  *m = (mail){recv, src, dst, tag, buf, bytes, token, NULL};
  *pp = m; /* at the tail: matched after everything posted before */
  pthread_mutex_unlock(&mb->mu);
  return 0;
}

static inline int mb_isend(void *user, const void *buf, size_t bytes, int peer, int tag, void *token,
                    char *msg, size_t cap) {
  return mb_post(user, 0, (void *)buf, bytes, peer, tag, token, msg, cap);
}

static inline int mb_irecv(void *user, void *buf, size_t bytes, int peer, int tag, void *token,
                    char *msg, size_t cap) {
  return mb_post(user, 1, buf, bytes, peer, tag, token, msg, cap);
}

/* A posted transfer is dropped; one already matched was completed, so nothing touches it. */
static inline int mb_cancel(void *user, void *token) {
  mailbox *mb = ((xuser *)user)->mb;
  pthread_mutex_lock(&mb->mu);
  for (mail **pp = &mb->head; *pp; pp = &(*pp)->next)
    if ((*pp)->token == token) {
      mail *m = *pp;
      *pp = m->next;
      free(m);
      break;
    }
  pthread_mutex_unlock(&mb->mu);
  return 0;
}

static inline void mb_release(void *user) {
  xuser *u = user;
  __atomic_fetch_add(&u->released, 1, __ATOMIC_SEQ_CST);
  atomic_fetch_add(&u->mb->released, 1);
}

static inline void mb_init(mailbox *mb) {
  memset(mb, 0, sizeof *mb);
  pthread_mutex_init(&mb->mu, NULL);
}

static inline void mb_free(mailbox *mb) {
  while (mb->head) {
    mail *m = mb->head;
    mb->head = m->next;
    free(m);
  }
  pthread_mutex_destroy(&mb->mu);
}

static inline sg_status xport_comm(mailbox *mb, xuser *u, int rank, int world, sg_comm **out) {
  *u = (xuser){mb, rank, 0};
  sg_xport t = {sizeof t, "mailbox", u, 1, mb_isend, mb_irecv, mb_cancel, mb_release};
  return sg_comm_create_xport(&t, rank, world, out);
}

/* A group of `world` xport communicators over one mailbox (u: world users); SG_OK or the
 * first failure (the ones made are destroyed). */
static inline sg_status mb_group(mailbox *mb, xuser *u, int world, sg_comm **comms) {
  for (int r = 0; r < world; r++) {
    const sg_status st = xport_comm(mb, &u[r], r, world, &comms[r]);
    if (st != SG_OK) {
      for (int s = 0; s < r; s++) sg_comm_destroy(comms[s]);
      return st;
    }
  }
  return SG_OK;
}

#endif /* SG_TEST_MAILBOX_H */
