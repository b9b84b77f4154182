/* plan_step: memory per rank and predicted step time of flat and hybrid ZeRO-2 for a model of
 * `layers` square layers of `hidden` (plus biases) on `nodes` x `ranks_per_node` ranks, from the
 * public API only (sg_estimate_memory, sg_estimate_step; docs/planner.md).
 *
 *   plan_step [hidden layers nodes ranks_per_node net_gbit micro compute_s]
 *   plan_step 4096 32 2 2 1 8 1.3
 *
 * The link rates and the AdamW rate are described, not measured (python -m shardgrad.plan
 * --probe measures them); every one is printed. */
#include <stdio.h>
#include <stdlib.h>

#include "shardgrad.h"

#define MAX_LAYERS 1024

static int fail(const char *what) {
  fprintf(stderr, "plan_step: %s: %s\n", what, sg_last_error());
  return 1;
}

static int row(const char *label, const sg_config *cfg, const size_t *numels, int n, int world,
               int micro, const sg_hardware *hw) {
  sg_memory_stats mem = {.struct_size = sizeof mem};
  sg_step_estimate est = {.struct_size = sizeof est};
  if (sg_estimate_memory(cfg, numels, n, world, &mem) != SG_OK) return fail("sg_estimate_memory");
  if (sg_estimate_step(cfg, numels, n, world, micro, hw, &est) != SG_OK)
    return fail("sg_estimate_step");
  printf("%-22s %9.2f %9.3f %9.3f %9.3f %9.3f %9.3f %12.1f\n", label,
         (double)mem.total_bytes / (1 << 30), est.step_s, est.compute_s,
         est.exposed_s[SG_LEVEL_NET], est.exposed_s[SG_LEVEL_NODE], est.optim_s,
         (double)est.link_bytes[SG_LEVEL_NET] / 1e6);
  return 0;
}

int main(int argc, char **argv) {
  const long hidden = argc > 1 ? atol(argv[1]) : 4096, layers = argc > 2 ? atol(argv[2]) : 32;
  const int nodes = argc > 3 ? atoi(argv[3]) : 2, rpn = argc > 4 ? atoi(argv[4]) : 2;
  const double gbit = argc > 5 ? atof(argv[5]) : 1.0;
  const int micro = argc > 6 ? atoi(argv[6]) : 8;
  const double compute = argc > 7 ? atof(argv[7]) : 1.0;
  if (hidden < 1 || layers < 1 || layers > MAX_LAYERS / 2 || nodes < 1 || rpn < 1 || gbit <= 0) {
    fprintf(stderr, "usage: plan_step [hidden layers(<=%d) nodes ranks_per_node net_gbit micro "
                    "compute_s]\n", MAX_LAYERS / 2);
    return 64;
  }
  size_t numels[MAX_LAYERS];
  for (long l = 0; l < layers; l++) {
    numels[2 * l] = (size_t)hidden * (size_t)hidden;
    numels[2 * l + 1] = (size_t)hidden;
  }
  sg_hardware hw;
  if (sg_hardware_init(&hw, sizeof hw) != SG_OK) return fail("sg_hardware_init");
  hw.ranks_per_node = rpn;
  hw.algorithm = SG_ALGO_RING; /* NCCL */
  hw.link_bytes_per_s[SG_LEVEL_NET] = gbit * 1e9 / 8 * 0.7; /* 70% of nominal: assumed */
  hw.link_bytes_per_s[SG_LEVEL_NODE] = 100e9 * 0.7;         /* NVLink-class: assumed */
  hw.compute_s = compute;
  hw.device_bytes_per_s = 1.5e12 * 0.8; /* A100-class memory: assumed */
  printf("%ld x %ld (%.3g params) bf16 on %d x %d ranks, %.3g Gbit/s between nodes, %d "
         "micro-batches of %.3f s; links at 70%% of nominal, AdamW at 1.2 TB/s (assumed)\n",
         layers, hidden, (double)(hidden * hidden + hidden) * (double)layers, nodes, rpn, gbit,
         micro, compute);
  printf("%-22s %9s %9s %9s %9s %9s %9s %12s\n", "layout", "GiB/rank", "step s", "compute",
         "x-node", "in-node", "optim", "link MB/step");
  sg_config cfg;
  if (sg_config_init(&cfg, sizeof cfg) != SG_OK) return fail("sg_config_init");
  cfg.device = SG_DEVICE_CUDA;
  cfg.param_dtype = cfg.grad_dtype = SG_BF16;
  cfg.bucket_bytes = 128u << 20;
  cfg.overlap_param_gather = 1;
  const int world = nodes * rpn, n = (int)(2 * layers);
  if (row("flat ZeRO-2", &cfg, numels, n, world, micro, &hw)) return 1;
  cfg.shard_ranks = rpn;
  cfg.replica_reduce_dtype = SG_F32;
  if (nodes > 1 && row("hybrid, f32 wire", &cfg, numels, n, world, micro, &hw)) return 1;
  cfg.replica_reduce_dtype = SG_BF16;
  if (nodes > 1 && row("hybrid, bf16 wire", &cfg, numels, n, world, micro, &hw)) return 1;
  return 0;
}
