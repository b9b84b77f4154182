/* The replica transports (sg__replica_ops, sg_engine_internal.h): what their files share. */
#ifndef SG_REPLICA_POLICY_H
#define SG_REPLICA_POLICY_H

#include "../sg_engine_internal.h" /* engine, sg__replica_ops */

/* sg_replica_select.c: the transport of this engine and replica communicator (DESIGN.md section
 * 1, the table of "Hybrid engines"), the device to bind the channel to (*dev, NULL: none) and
 * e->rep.mem; staged: makes its host queue (ops->release frees it). */
sg_status sg__replica_select(sg_engine *e, const sg_comm *replica, const sg__replica_ops **ops,
                             sg__device **dev);

extern const sg__replica_ops sg__replica_flat;     /* sg_replica_flat.c */
extern const sg__replica_ops sg__replica_host;     /* sg_replica_direct.c */
extern const sg__replica_ops sg__replica_attached; /* sg_replica_direct.c */
extern const sg__replica_ops sg__replica_unbound;  /* sg_replica_direct.c */
extern const sg__replica_ops sg__replica_staged;   /* sg_replica_staged.c */
extern const sg__replica_ops sg__replica_at_step;  /* sg_replica_at_step.c */
extern const sg__replica_ops sg__replica_at_step_int8; /* sg_replica_at_step.c */
extern const sg__replica_ops sg__replica_at_step_int4; /* sg_replica_at_step.c */
extern const sg__replica_ops sg__replica_outer_host;      /* sg_replica_outer_host.c */
extern const sg__replica_ops sg__replica_outer_host_int8; /* sg_replica_outer_host.c */
extern const sg__replica_ops sg__replica_outer_stream_host;      /* sg_replica_outer_stream.c */
extern const sg__replica_ops sg__replica_outer_stream_host_int8; /* sg_replica_outer_stream.c */
/* sg_replica_outer_host.c: its prepare (sg_replica_outer.c's, or with int8 codes
 * sg_replica_outer_int8.c's, with the host's place), which streaming with offload shares (the
 * release: sg__replica_staged_release, or with int8 codes sg__replica_codec_release_queue). */
sg_status sg__replica_outer_host_prepare(sg_engine *e);
/* 1 where the outer steps take the host's place (an offloaded optimizer): their delta and apply
 * run from sg_step's thread, outside jobs (their copies use the compute queue). */
int sg__replica_outer_on_host(const sg_engine *e);
sg_status sg__replica_outer_host_prepare_int8(sg_engine *e);
extern const sg__replica_ops sg__replica_int8;     /* sg_replica_int8.c */
extern const sg__replica_ops sg__replica_int4;     /* sg_replica_int4.c */
extern const sg__replica_ops sg__replica_outer;    /* sg_replica_outer.c */
extern const sg__replica_ops sg__replica_outer_int8; /* sg_replica_outer_int8.c */
extern const sg__replica_ops sg__replica_outer_stream;      /* sg_replica_outer_stream.c */
extern const sg__replica_ops sg__replica_outer_stream_int8; /* sg_replica_outer_stream.c */
extern const sg__replica_ops sg__replica_outer_staged;      /* sg_replica_outer_staged.c */
extern const sg__replica_ops sg__replica_outer_int8_staged; /* sg_replica_outer_staged.c */
extern const sg__replica_ops sg__replica_int8_staged;       /* sg_replica_codec_staged.c */
extern const sg__replica_ops sg__replica_int4_staged;       /* sg_replica_codec_staged.c */
/* sg_replica_codec_staged.c: the codec's pinned stage (rep.stage, after the codec's prepare),
 * and bucket b's slice x of device memory summed across replicas through it (waited phases on
 * the engine's comm queue and the staged host queue, from the caller's thread). */
sg_status sg__replica_codec_staged_stage(sg_engine *e);
sg_status sg__replica_codec_staged_sum(sg_engine *e, int b, float *x);
/* sg_replica_outer_int8.c: the bytes of its state (the outer state, then the codec's), and the
 * entries the streaming variant with int8 codes shares: prepare, the coded sum of a bucket's
 * pseudo-gradient run, the checkpoint entries. */
size_t sg__replica_outer_int8_bytes(const sg__plan *p, const sg_config *cfg, int n);
sg_status sg__replica_outer_int8_prepare(sg_engine *e);
sg_status sg__replica_outer_int8_sum(sg_engine *e, int b, float *d, size_t n);
void sg__replica_outer_int8_describe(const sg_engine *e, sg__rep_ck *ck);
sg_status sg__replica_outer_int8_save(sg_engine *e, sg__rep_ck *ck);
void sg__replica_outer_int8_restore(sg_engine *e, const sg__rep_ck *ck);
/* sg_replica_outer.c: the bytes of its state (outer parameters, momentum, a run's wire), and
 * the pieces outer steps with int8 codes share: prepare (the state at the start of the replica
 * buffer), the sum of bucket b's pseudo-gradient run d across replicas (on the comm queue) that
 * sync takes, and the entries of the table. */
size_t sg__replica_outer_bytes(const sg__plan *p, const sg_config *cfg);
typedef sg_status (*sg__outer_sum_fn)(sg_engine *e, int b, float *d, size_t n);
sg_status sg__replica_outer_prepare(sg_engine *e);
sg_status sg__replica_outer_wire_sum(sg_engine *e, int b, float *d, size_t n);
sg_status sg__replica_outer_sync(sg_engine *e, sg__outer_sum_fn sum);
/* The pieces of an outer step that streaming takes apart: the pseudo-gradient po - theta of this
 * rank's run of bucket b into d (returns its values), bucket b's Nesterov step from the summed d
 * (the parameters become the new po), the node's gathers of buckets first, first + stride, ...
 * (waited for), and the pseudo-gradient buffer (with streaming: room for the largest group's
 * runs). */
sg_status sg__replica_outer_delta(sg_engine *e, int b, float *d, size_t *n);
sg_status sg__replica_outer_apply(sg_engine *e, int b, const float *d);
/* The host buffer of one run's working values (an offloaded optimizer's,
 * sg_replica_outer_host.c; NULL otherwise). */
float *sg__replica_outer_work(sg_engine *e);
/* Where delta and apply find this rank's fp32 run o of the parameters for the element device
 * (theta) and how the working copy then follows it (working: bf16/f16 parameters cast from
 * it, f32 ones are it): the engine's device (sg_replica_outer.c), or an offloaded optimizer's
 * host (sg_replica_outer_host.c: called from sg_step's thread, outside jobs). Set by
 * prepare: e->rep.outer.place. */
typedef struct sg__outer_place {
  sg_status (*theta)(sg_engine *e, const sg__owned *o, float **theta);
  sg_status (*working)(sg_engine *e, const sg__owned *o, const float *theta);
} sg__outer_place;
sg_status sg__replica_outer_gather(sg_engine *e, int first, int stride);
float *sg__replica_outer_dbuf(sg_engine *e);
/* Streaming: due at every step whose group (the buckets b with b mod H = the step's position in
 * the period) has a bucket; that group (of the step that just ended). */
int sg__replica_outer_stream_due(sg_engine *e);
int sg__replica_outer_group(const sg_engine *e);
/* sg_replica_outer_stream.c: the bytes of its replica buffer for n replicas (the outer state,
 * the codec's with int8 codes, its own). */
size_t sg__replica_outer_stream_bytes(const sg__plan *p, const sg_config *cfg, int n);
sg_status sg__replica_outer_finish(sg_engine *e);
int sg__replica_outer_due(sg_engine *e);
int sg__replica_outer_grad_replicas(const sg_engine *e);
sg_status sg__replica_outer_claim(sg_engine *e, int b);
void sg__replica_outer_describe(const sg_engine *e, sg__rep_ck *ck);
sg_status sg__replica_outer_save(sg_engine *e, sg__rep_ck *ck);
void sg__replica_outer_restore(sg_engine *e, const sg__rep_ck *ck);
#define SG__REPLICA_OUTER_COMMON                                                                  \
  .share_scratch = 1, .claim = sg__replica_outer_claim, .finish = sg__replica_outer_finish,      \
  .run = sg__replica_run_comm, .drain = sg__replica_no_drain,                                    \
  .grad_replicas = sg__replica_outer_grad_replicas
#define SG__REPLICA_OUTER_STEPS SG__REPLICA_OUTER_COMMON, .sync_due = sg__replica_outer_due

/* sg_replica_select.c: the bytes of the layout's replica buffer (sg__replicas_shape). */
size_t sg__replica_select_bytes(const sg__plan *p, const sg_config *cfg, int n);

/* sg_replica_codec.c: the codecs' scheme. Its buffer's bytes (residuals and exchange buffers)
 * for a plan over n replicas; prepare (bits 8 or 4: e->rep.codec over the layout's replica
 * buffer from byte off, zeroed; its residuals are checkpoint state ck_state) and release; bucket b's slice x (slice_numel values, this
 * rank's residuals at the bucket's shard offset) summed across replicas in place, every replica
 * with the same bits (on the comm queue); and bucket b's accumulator slice so (a comm job). */
size_t sg__replica_codec_bytes(const sg__plan *p, int n, int bits);
/* The code bytes each replica sends each other one per stage for a slice of n values (the step
 * model's bytes: an all-to-all and an all-gather of this many per replica). */
size_t sg__replica_codec_region(size_t n, int N, int bits);
sg_status sg__replica_codec_prepare(sg_engine *e, int bits, size_t off, int ck_state);
void sg__replica_codec_release(sg_engine *e);
/* ... and with it the transport's own device (rep.host_dev, sg__replica_staged_release): the
 * release of every codec table whose select made one. */
void sg__replica_codec_release_queue(sg_engine *e);
void sg__replica_codec_describe(const sg_engine *e, sg__rep_ck *ck);
sg_status sg__replica_codec_save(sg_engine *e, sg__rep_ck *ck);
void sg__replica_codec_restore(sg_engine *e, const sg__rep_ck *ck);
#define SG__REPLICA_CODEC_CK                                                                      \
  .ck_describe = sg__replica_codec_describe, .ck_save = sg__replica_codec_save,                 \
  .restore = sg__replica_codec_restore
sg_status sg__replica_codec_sum(sg_engine *e, int b, float *x);
/* ... and its pieces for a channel that takes host memory (sg_replica_codec_staged.c), in the
 * queue of the replica element work: bucket b's exchange buffers (N regions of *region code
 * bytes, device memory on CUDA); stage 1's codes of x into send (encode); once recv holds every
 * replica's codes of this replica's chunk, their sum encoded into its region of send (owner);
 * once send holds every owner's codes, x decoded from them (decode). */
void sg__replica_codec_bufs(const sg_engine *e, int b, char **send, char **recv, size_t *region);
sg_status sg__replica_codec_encode(sg_engine *e, int b, float *x);
sg_status sg__replica_codec_owner(sg_engine *e, int b, float *x);
sg_status sg__replica_codec_decode(sg_engine *e, int b, float *x);
sg_status sg__replica_codec_reduce(sg_engine *e, int b);
sg_status sg__replica_codec_claim(sg_engine *e, int b);

/* sg_replica_staged.c: the staged transport's host queue (a CPU device), made by select (also
 * for streaming outer steps on the CPU device, sg_replica_outer_stream.c; on a CUDA device with
 * host-driven communicators select puts the device's twin in rep.host_dev instead; their
 * release destroys either). */
sg_status sg__replica_staged_host_queue(sg_engine *e, const sg_comm *replica, sg__device **dev);
/* ... and its entries over that queue: its release, drain and run. */
void sg__replica_staged_release(sg_engine *e);
sg_status sg__replica_staged_drain(sg_engine *e);
sg_status sg__replica_staged_run(sg_engine *e, sg__job_fn fn, void *arg);

/* sg_replica_common.c: the entry points every transport but flat shares. */
sg_status sg__replica_init(sg_engine *e);
void sg__replica_free(sg_engine *e);
void sg__replica_detach(sg_engine *e);
sg_status sg__replica_agree(sg_engine *e, sg_status st);
sg_status sg__replica_open(sg_engine *e, const char *fn);
sg_status sg__replica_after_reduce(sg_engine *e, int b);
sg_status sg__replica_rest(sg_engine *e);
sg_status sg__replica_allgather_host(sg_engine *e, void *host, size_t bytes);
sg_status sg__replica_broadcast_params(sg_engine *e, int root);
/* bytes of the engine's device memory at dev_buf broadcast from replica root over the replica
 * channel on the transport's queue (its run), through a temporary where the channel takes host
 * memory (rep.mem): the codec's residuals in checkpoints. */
sg_status sg__replica_broadcast_dev(sg_engine *e, void *dev_buf, size_t bytes, int root);
/* ... and of host memory (through a device temporary where the channel takes device memory). */
sg_status sg__replica_broadcast_host(sg_engine *e, void *host_buf, size_t bytes, int root);
#define SG__REPLICA_ENTRIES                                                                       \
  .init = sg__replica_init, .free = sg__replica_free, .detach = sg__replica_detach,              \
  .agree = sg__replica_agree, .open = sg__replica_open, .after_reduce = sg__replica_after_reduce, \
  .rest = sg__replica_rest, .allgather_host = sg__replica_allgather_host,                        \
  .broadcast_params = sg__replica_broadcast_params

/* ... and the pieces of their transports: */
/* Bucket b's all-reduce across replicas queued on the engine's comm queue, through
 * reduce(e, b) (marks it SG__CLAIM_QUEUED). */
sg_status sg__replica_submit(sg_engine *e, int b, sg_status (*reduce)(sg_engine *e, int b));
/* The one all-reduce of bucket b's slice (itself, or cast through the wire buffer by the
 * device on its comm queue). */
sg_status sg__replica_reduce_device(sg_engine *e, int b);
/* fn(arg) on the engine's comm queue, waited for (run), and nothing to drain (drain). */
sg_status sg__replica_run_comm(sg_engine *e, sg__job_fn fn, void *arg);
/* The queue of the replica element work (outer steps, codes) on the engine's device, chosen by
 * sg_replica_select.c: the comm queue on CUDA (the replica job's stream), the compute queue on
 * the CPU device (at once, in the caller's order). */
sg__queue sg__replica_elem_queue(const sg_engine *e);
/* Bucket b's sum left for the step (SG__CLAIM_AT_STEP: the transport's finish runs it, once
 * every arrival is folded or its phases can wait on the host). */
sg_status sg__replica_claim_at_step(sg_engine *e, int b);
/* The layout's replica buffer: the COMM arena's (device memory on CUDA), or with an offloaded
 * optimizer pinned host memory (sg_memory's host bytes), made by init before prepare. */
char *sg__replica_buf(const sg_engine *e);
/* The device of the replica sums' element work (the casts to and from the wire, the codes),
 * chosen by sg_replica_select.c: the replica element work's (rep.elem_dev), or with streaming
 * outer steps over host-driven communicators on CUDA the twin device their channel is bound to
 * (its queue runs the sums). */
sg__device *sg__replica_sum_dev(const sg_engine *e);
sg_status sg__replica_no_drain(sg_engine *e);
sg_status sg__replica_no_prepare(sg_engine *e);
void sg__replica_no_release(sg_engine *e);
sg_status sg__replica_no_finish(sg_engine *e);
/* The step's gradient summed over every replica; no outer period; nothing of its own to
 * restore after a load. */
int sg__replica_all_replicas(const sg_engine *e);
int sg__replica_never_due(sg_engine *e);
/* No state of its own in checkpoints. */
void sg__replica_no_ck_describe(const sg_engine *e, sg__rep_ck *ck);
sg_status sg__replica_no_ck_save(sg_engine *e, sg__rep_ck *ck);
void sg__replica_no_restore(sg_engine *e, const sg__rep_ck *ck);
#define SG__REPLICA_EVERY_STEP                                                                    \
  .grad_replicas = sg__replica_all_replicas, .sync_due = sg__replica_never_due,                 \
  .sync = sg__replica_no_finish
#define SG__REPLICA_NO_CK                                                                         \
  .ck_describe = sg__replica_no_ck_describe, .ck_save = sg__replica_no_ck_save,                 \
  .restore = sg__replica_no_restore

#endif /* SG_REPLICA_POLICY_H */
