"""trace_overlap: how much of the gradient reduction time the backward pass hid, and how much
of the parameter all-gather time the caller did not wait for.

    with e.trace():
        for ...:
            e.trace_mark("backward")   # where each backward pass (micro-batch) begins
            ...
    print(sg.trace_overlap(e.trace_events()[0]))

The definition is the one of the examples' --trace summary (examples/mlp/mlp_cli.h,
mlp_trace_sum), for one rank's events in
issue order (as Engine.trace_events returns them):
 - The micro-batch of a REDUCE event reaches back to the nearest MARK or STEP before it and
   forward to the nearest MARK or STEP after it (neither included); with none before it, back
   to the first event. Its end of backward is the latest start_us of a GRAD_READY event in it
   (-1 when there is none).
 - The REDUCE's hidden time is the part of [start_us, end_us] before that end of backward:
   min(end_of_backward, end_us) - start_us when end_of_backward > start_us, else 0. It ran
   while the caller's queue was still producing gradients.
The all-gathers (the same definition as the C examples' summary):
 - gather_us is the sum of end_us - start_us over GATHER events (one per bucket and step);
 - gather_exposed_us is the sum of end_us - start_us over WAIT events: the time the caller's
   queue waited for all-gathers (Engine.param_wait, or the end of step() without
   overlap_param_gather, where the whole gather is waited for);
 - gather_hidden_us = max(0, gather_us - gather_exposed_us), and gather_hidden_fraction =
   gather_hidden_us / gather_us (0.0 when gather_us is 0). With overlap_param_gather on, the
   hidden part ran behind the next forward pass (or AdamW of the next bucket).
Events are compared by their times only; kind, start_us and end_us are all that is read.
"""

from ._structs import TraceKind

__all__ = ["trace_overlap"]


def _latest_ready_before(events):
    """For each index i: latest GRAD_READY start_us at j < i since the last MARK or STEP."""
    out, cur = [], -1.0
    for ev in events:
        out.append(cur)
        if ev.kind in (TraceKind.MARK, TraceKind.STEP):
            cur = -1.0
        elif ev.kind == TraceKind.GRAD_READY and ev.start_us > cur:
            cur = ev.start_us
    return out


def _latest_ready_after(events):
    """For each index i: latest GRAD_READY start_us at j > i before the next MARK or STEP."""
    out, cur = [0.0] * len(events), -1.0
    for i in range(len(events) - 1, -1, -1):
        out[i] = cur
        kind = events[i].kind
        if kind in (TraceKind.MARK, TraceKind.STEP):
            cur = -1.0
        elif kind == TraceKind.GRAD_READY and events[i].start_us > cur:
            cur = events[i].start_us
    return out


def trace_overlap(events):
    """Summary of the reductions and all-gathers in `events` (one rank's, in issue order; see
    the module text for the definitions): {"reduce_us": total REDUCE time, "hidden_us": the
    part of it before the end of its micro-batch's backward, "hidden_fraction": hidden_us /
    reduce_us (0.0 when there were no reductions), "exposed_us": reduce_us - hidden_us,
    "steps": number of STEP events, "gather_us": total GATHER time, "gather_exposed_us":
    total WAIT time, "gather_hidden_us": max(0, gather_us - gather_exposed_us),
    "gather_hidden_fraction": gather_hidden_us / gather_us (0.0 without gathers)}. Linear in
    the number of events."""
    events = list(events)
    before = _latest_ready_before(events)
    after = _latest_ready_after(events)
    total = hidden = gather = waited = 0.0
    steps = 0
    for i, ev in enumerate(events):
        if ev.kind == TraceKind.STEP:
            steps += 1
        elif ev.kind == TraceKind.GATHER:
            gather += ev.end_us - ev.start_us
        elif ev.kind == TraceKind.WAIT:
            waited += ev.end_us - ev.start_us
        if ev.kind != TraceKind.REDUCE:
            continue
        end_bwd = max(before[i], after[i])
        total += ev.end_us - ev.start_us
        if end_bwd > ev.start_us:
            hidden += min(end_bwd, ev.end_us) - ev.start_us
    gather_hidden = max(0.0, gather - waited)
    return {"reduce_us": total, "hidden_us": hidden,
            "hidden_fraction": hidden / total if total > 0 else 0.0,
            "exposed_us": total - hidden, "steps": steps,
            "gather_us": gather, "gather_exposed_us": waited,
            "gather_hidden_us": gather_hidden,
            "gather_hidden_fraction": gather_hidden / gather if gather > 0 else 0.0}
