"""The constraints of the joint MILP: steps, timing, the two copy channels and memory.

A mixin of :class:`solvers.milp_model.JointModel`, which owns the variables these methods
read (``docs/milp.md`` names them); split out so that each module stays readable.
"""

from __future__ import annotations

import pulp

from solvers.milp_codec import (
    OFFLOAD_ACTIVATION,
    OFFLOAD_SAVED,
    Tensor,
    valid_at,
)
from solvers.plan import ACTIVATION, SAVED


class Constraints:
    """The constraints of ``docs/milp.md``, added by :class:`~solvers.milp_model.JointModel`."""

    def _step_constraints(self) -> None:
        length = self.length
        for tensor in self.issue:
            for k in range(1, length + 1):
                flight = self._in_flight(tensor, k)
                name = f"{tensor[0]}_{tensor[1]}_step{k}"
                self._add(flight >= 0, f"ready_after_issue_{name}")
                if k < length and tensor in self.resident[k]:
                    self._add(self.resident[k][tensor] + flight <= 1, f"not_twice_{name}")
        for k in range(length, 0, -1):
            state = self.resident[k]
            rec = self.recompute.get(k, {})
            for i in range(1, k + 1) if k < length else ():
                self._add(rec[(SAVED, i)] + state[(SAVED, i)] <= 1, f"no_rec_saved_{i}_step{k}")
                flight = self._in_flight((SAVED, i), k)
                if len(flight):
                    self._add(rec[(SAVED, i)] + flight <= 1, f"no_rec_flying_saved_{i}_step{k}")
                if i < k:
                    self._add(rec[(ACTIVATION, i)] + rec[(SAVED, i)] <= 1, f"one_kind_{i}_step{k}")
                    self._add(
                        rec[(ACTIVATION, i)]
                        + state[(ACTIVATION, i)]
                        + state[(SAVED, i)]
                        + self._in_flight((ACTIVATION, i), k)
                        <= 1,
                        f"no_rec_act_{i}_step{k}",
                    )
                if i >= 2:
                    # F(i) reads a_{i-1}: resident when the step starts, or produced in it.
                    self._add(
                        rec[(SAVED, i)] + rec.get((ACTIVATION, i), 0) <= self._available(k, i - 1),
                        f"input_of_F{i}_step{k}",
                    )
            if k < length:
                self._add(state[(SAVED, k)] + rec[(SAVED, k)] >= 1, f"saved_for_B{k}")
            if k < 2:
                continue
            self._add(self._available(k, k - 1) >= 1, f"input_of_B{k}")
            for j in range(1, k):
                self._add(state[(ACTIVATION, j)] + state[(SAVED, j)] <= 1, f"one_copy_a{j}_step{k}")
                if k < length:
                    # Persistence again, for a saved set that was computed rather than
                    # prefetched: a_j stays on the GPU, or went to the host in the first pass.
                    arrived = (
                        self._ready_since[(SAVED, j + 1)][k] if (SAVED, j + 1) in self.ready else 0
                    )
                    on_host = self._fate(j, OFFLOAD_SAVED) + self._fate(j, OFFLOAD_ACTIVATION)
                    self._add(
                        state[(SAVED, j + 1)] - arrived
                        <= state[(ACTIVATION, j)] + state[(SAVED, j)] + on_host,
                        f"input_stays_{j + 1}_step{k}",
                    )
            # Into step k-1: keep what was produced, drop (D) what was resident, or arrive.
            following = self.resident[k - 1]
            for tensor in valid_at(length, k - 1):
                name = f"{tensor[0]}_{tensor[1]}_step{k}"
                kept = self.keep[k][tensor] if k < length else 0.0
                if k < length:
                    self._add(kept <= rec[tensor], f"keep_produced_{name}")
                drop = self._continuous(f"drop_{name}", 0, 1)
                self._add(drop <= state[tensor], f"drop_resident_{name}")
                arriving = self.ready.get(tensor, {}).get(k - 1, 0.0)
                self._add(
                    following[tensor] == state[tensor] - drop + kept + arriving,
                    f"transition_{name}",
                )
                if tensor in self.issue and k in self.issue[tensor]:
                    # A prefetch issued at B(k) needs the tensor gone from the GPU by then.
                    self._add(
                        self.issue[tensor][k] + following[tensor] - arriving <= 1,
                        f"prefetch_not_resident_{name}",
                    )

    def _available(self, k: int, j: int) -> pulp.LpAffineExpression:
        """a_j usable in step k: resident alone or in x̄_j, or produced earlier in the step."""
        if j == 0:
            return pulp.LpAffineExpression(constant=1.0)
        state = self.resident[k]
        rec = self.recompute.get(k, {})
        return (
            state[(ACTIVATION, j)]
            + state[(SAVED, j)]
            + rec.get((SAVED, j), 0)
            + rec.get((ACTIVATION, j), 0)
        )

    def _timing(self) -> None:
        length, fwd, bwd = self.length, self.fwd, self.bwd
        big = self.big_time
        self.first_pass_start = {1: pulp.LpAffineExpression(constant=0.0)}
        for q in range(2, length + 1):
            start = self._continuous(f"T_{q}", 0, big)
            self._add(start >= self.first_pass_start[q - 1] + fwd[q - 1], f"first_pass_{q}")
            self.first_pass_start[q] = pulp.LpAffineExpression(start)
        self.step_start = {k: self._continuous(f"S_{k}", 0, big) for k in range(length, 0, -1)}
        self.backward_start = {length: self.step_start[length]}
        for k in range(length - 1, 0, -1):
            self.backward_start[k] = self._continuous(f"BS_{k}", 0, big)
        self.makespan = self._continuous("makespan", 0, big)
        self._add(self.step_start[length] >= self.first_pass_start[length] + fwd[length], "F_L")
        for k in range(length, 0, -1):
            if k < length:
                # x̄_k, right before B(k), is a refill (solvers.semantics.refills).
                recompute_time = pulp.lpSum(
                    (self.refill[k] if tensor == (SAVED, k) else fwd[tensor[1]]) * var
                    for tensor, var in self.recompute[k].items()
                )
                self._add(
                    self.backward_start[k] >= self.step_start[k] + recompute_time,
                    f"recompute_time_step{k}",
                )
            end = self.step_start[k - 1] if k >= 2 else self.makespan
            self._add(end >= self.backward_start[k] + bwd[k], f"backward_time_{k}")

    def _device_to_host(self) -> None:
        """FIFO offloads (E_i) and the release indicators of each offloaded output."""
        length, big = self.length, self.big_time
        self.offload_end: dict[int, pulp.LpVariable] = {}
        for i in self.offloadable:
            end = self._continuous(f"E_{i}", 0, big)
            duration = self._offloaded_bytes(i) * self.d2h
            if i - 1 in self.offload_end:
                self._add(end >= self.offload_end[i - 1] + duration, f"d2h_fifo_{i}")
            self._add(end >= self.first_pass_start[i + 1] + duration, f"d2h_issue_{i}")
            self.offload_end[i] = end
        # Admission points that see releases: each first-pass forward and each backward.
        self.positions: list[tuple[str, int]] = [("F", q) for q in range(1, length + 1)]
        self.positions += [("B", k) for k in range(length, 0, -1)]
        self.released: dict[int, dict[tuple[str, int], pulp.LpVariable]] = {}
        self.unreleased: dict[tuple[str, int], pulp.LpAffineExpression] = {}
        parts: dict[tuple[str, int], list[pulp.LpVariable]] = {p: [] for p in self.positions}
        for i in self.offloadable:
            first = self.positions.index(("F", i + 2))
            self.released[i] = {}
            previous = None
            for position in self.positions[first:]:
                name = f"{i}_{position[0]}{position[1]}"
                step = position[1]
                phi = self._binary(f"released_{name}", i, step, decision=False)
                self.released[i][position] = phi
                when = (
                    self.first_pass_start[position[1]]
                    if position[0] == "F"
                    else self.backward_start[position[1]]
                )
                self._add(when >= self.offload_end[i] - big * (1 - phi), f"release_time_{name}")
                if previous is not None:
                    self._add(previous <= phi, f"release_stays_{name}")
                earlier = self.released.get(i - 1, {}).get(position)
                if earlier is not None:
                    self._add(phi <= earlier, f"release_fifo_{name}")
                previous = phi
                remaining = self._continuous(f"unreleased_{name}", 0)
                self._add(
                    remaining >= self._offloaded_bytes(i) - self.saved[i] * phi,
                    f"unreleased_bytes_{name}",
                )
                parts[position].append(remaining)
        for position, terms in parts.items():
            if terms:
                total = self._continuous(f"unreleased_{position[0]}{position[1]}", 0)
                self._add(total == pulp.lpSum(terms), f"unreleased_{position[0]}{position[1]}")
                self.unreleased[position] = pulp.LpAffineExpression(total)
            else:
                self.unreleased[position] = pulp.LpAffineExpression()

    def _host_to_device(self) -> None:
        """FIFO prefetches. The prefetches listed after B(s) start with B(s) when their bytes
        fit beside it, or wait (memory admission) for the releases at its end: ``late``. The
        early ones are listed first; H_s ends the whole batch, P_t is tensor t's arrival."""
        length, big = self.length, self.big_time
        self.late: dict[Tensor, dict[int, pulp.LpVariable]] = {}
        for tensor, steps in self.issue.items():
            self.late[tensor] = {}
            for s, var in steps.items():
                late = self._binary(
                    f"late_{tensor[0]}_{tensor[1]}_step{s}",
                    tensor[1],
                    s,
                    decision=False,
                    copying=True,
                )
                self._add(late <= var, f"late_if_issued_{tensor[0]}_{tensor[1]}_step{s}")
                self.late[tensor][s] = late
        early_end: dict[int, pulp.LpVariable] = {}
        channel_end: dict[int, pulp.LpVariable] = {}
        later = None
        for s in range(length, 1, -1):
            batch = [t for t, steps in self.issue.items() if s in steps]
            if not batch:
                continue
            early_duration = self._continuous(f"h2d_early_{s}", 0)
            late_duration = self._continuous(f"h2d_late_{s}", 0)
            self._add(
                early_duration
                == pulp.lpSum(
                    self._size(t) * self.h2d * (self.issue[t][s] - self.late[t][s]) for t in batch
                ),
                f"h2d_early_{s}",
            )
            self._add(
                late_duration
                == pulp.lpSum(self._size(t) * self.h2d * self.late[t][s] for t in batch),
                f"h2d_late_{s}",
            )
            early = self._continuous(f"He_{s}", 0, big)
            end = self._continuous(f"H_{s}", 0, big)
            if later is not None:
                self._add(early >= later + early_duration, f"h2d_fifo_{s}")
            self._add(early >= self.backward_start[s] + early_duration, f"h2d_issue_{s}")
            self._add(end >= early + late_duration, f"h2d_then_late_{s}")
            backward_end = self.backward_start[s] + self.bwd[s]
            self._add(end >= backward_end + late_duration, f"h2d_late_issue_{s}")
            for t in batch:
                name = f"{t[0]}_{t[1]}_step{s}"
                on_host = self.offload_end[t[1]]
                self._add(
                    early >= on_host + early_duration - big * (1 - self.issue[t][s]),
                    f"h2d_host_ready_{name}",
                )
                self._add(
                    end >= on_host + late_duration - big * (1 - self.late[t][s]),
                    f"h2d_host_ready_late_{name}",
                )
            early_end[s] = early
            channel_end[s] = later = end
        self.prefetch_end: dict[Tensor, pulp.LpVariable] = {}
        for tensor, steps in self.issue.items():
            name = f"{tensor[0]}_{tensor[1]}"
            arrival = self._continuous(f"P_{name}", 0, big)
            self.prefetch_end[tensor] = arrival
            for s, var in steps.items():
                self._add(arrival >= early_end[s] - big * (1 - var), f"prefetch_end_{name}_{s}")
                self._add(
                    arrival >= channel_end[s] - big * (1 - self.late[tensor][s]),
                    f"prefetch_end_late_{name}_{s}",
                )
            for c, var in self.ready[tensor].items():
                # The first op of step c to read the tensor waits for it: B(c) for x̄_c; F(c)
                # (when recomputed) and then B(c) for a_{c-1}; else the first recomputation.
                if tensor == (SAVED, c):
                    reader = pulp.LpAffineExpression(self.backward_start[c])
                elif tensor[1] == c - 1:
                    reader = self.backward_start[c] - self.refill[c] * self.recompute.get(
                        c, {}
                    ).get((SAVED, c), 0)
                else:
                    reader = pulp.LpAffineExpression(self.step_start[c])
                self._add(reader >= arrival - big * (1 - var), f"wait_prefetch_{name}_{c}")

    def _memory(self) -> None:
        """Resident bytes at every admission point of the simulator stay within the budget."""
        length, x, saved, grad = self.length, self.x, self.saved, self.grad
        # First pass: a_0, δ_L, the kept outputs of stages <= q-2, unreleased offloads, the
        # input a_{q-1} (whatever its fate) and F(q)'s own output and temporary.
        kept_prefix = pulp.LpAffineExpression()
        for q in range(1, length + 1):
            if q >= 3:
                running = self._continuous(f"kept_first_pass_{q - 2}", 0)
                self._add(running == kept_prefix + self._kept_bytes(q - 2), f"kept_fp_{q - 2}")
                kept_prefix = pulp.LpAffineExpression(running)
            terms = [x[0] + grad[length], kept_prefix, self.unreleased[("F", q)]]
            if q >= 2:
                terms.append(self._product_bytes(q - 1))
            terms.append(self._product_bytes(q, temporary=True))
            self._add(pulp.lpSum(terms) <= self.budget, f"memory_F{q}")
        for k in range(length, 0, -1):
            state = self.resident[k]
            rec = self.recompute.get(k, {})
            resident_bytes = self._continuous(f"resident_bytes_step{k}", 0)
            self._add(
                resident_bytes == pulp.lpSum(self._size(t) * v for t, v in state.items()),
                f"resident_bytes_step{k}",
            )
            flying = pulp.LpAffineExpression()
            if self.issue:
                flying_var = self._continuous(f"in_flight_bytes_step{k}", 0)
                self._add(
                    flying_var
                    == pulp.lpSum(self._size(t) * self._in_flight(t, k) for t in self.issue),
                    f"in_flight_bytes_step{k}",
                )
                flying = pulp.LpAffineExpression(flying_var)
            # Issued at B(k) and admitted beside it (not waiting for its end).
            issued_here = pulp.lpSum(
                self._size(t) * (steps[k] - self.late[t][k])
                for t, steps in self.issue.items()
                if k in steps
            )
            # From B(L) on, the caller holds its output and the gradient it seeded.
            held = self.held if k < length else 0
            base = grad[k] + x[0] + held + resident_bytes + flying
            # Releases seen by step k's recomputation: those before the previous backward.
            seen_by_recompute = self.unreleased[("B", k + 1)] if k < length else None

            def produced(i: int, rec=rec) -> pulp.LpAffineExpression:
                return saved[i] * rec.get((SAVED, i), 0) + x[i] * rec.get((ACTIVATION, i), 0)

            kept_prefix = {0: pulp.LpAffineExpression()}
            for i in range(1, k - 1):
                running = self._continuous(f"kept_{i}_step{k}", 0)
                kept = self.keep.get(k, {})
                self._add(
                    running
                    == kept_prefix[i - 1]
                    + saved[i] * kept.get((SAVED, i), 0)
                    + x[i] * kept.get((ACTIVATION, i), 0),
                    f"kept_prefix_{i}_step{k}",
                )
                kept_prefix[i] = pulp.LpAffineExpression(running)
            for i in range(1, k + 1) if k < length else ():
                own = (saved[i] + self.fwd_tmp[i]) * rec[(SAVED, i)]
                if (ACTIVATION, i) in rec:
                    own += (x[i] + self.nograd_fwd_tmp[i]) * rec[(ACTIVATION, i)]
                terms = [base, seen_by_recompute, kept_prefix[max(i - 2, 0)], own]
                if i >= 2:
                    terms.append(produced(i - 1))
                self._add(pulp.lpSum(terms) <= self.budget, f"memory_F{i}_step{k}")
            terms = [base, issued_here, self.unreleased[("B", k)], kept_prefix[max(k - 2, 0)]]
            if k < length:
                if k >= 2:
                    terms.append(produced(k - 1))
                terms.append(saved[k] * rec[(SAVED, k)])
            terms.append(grad[k - 1] + self.bwd_tmp[k])
            self._add(pulp.lpSum(terms) <= self.budget, f"memory_B{k}")
