"""A lower bound on the step time that follows each recomputation's input between backwards.

:mod:`solvers.milp_bound` asks where a recomputation's input comes from only when B(L) starts.
This model asks it when every backward starts. Write t_m for the start of B(m) and I_m for the
ops listed after B(m) and before B(m-1) (I_1: after B(1)); T is the step's end. For every
valid plan (any op the format allows, non-persistent ones and copies included):

* F*_i is the F_all(i) that made the x̄_i B(i) reads: not always the last one before B(i),
  since a plan may copy x̄_i out in the first pass, recompute it after B(L) for nothing, free
  that, and prefetch the host copy for B(i) (then F*_i is the first pass's). It lies in the
  first pass (r_i = 0) or in one I_m, i < m <= L (p_im). Listed before B(i+1) it is not a
  refill (:func:`solvers.semantics.refills`), so it takes f_i there, and at least the refill
  time f'_i in I_{i+1}.
* A forward of stage i+1 in I_m (F*_{i+1}, or another: u_{i+1,m}, f_{i+1} each, a distinct op
  in each interval) reads a_i, an instance X made before it: by F*_i (then x̄_i exists at t_m
  unless F*_i lies in I_m, or it lies in I_m), by another forward of stage i in I_m (u_im), by
  a prefetch that starts between t_m and t_{m-1}, by time, wherever the list has it (h_im: x_i
  bytes or more on the host-to-device channel then, and on the device-to-host channel before),
  or else X is allocated when B(m) starts (c_im, x_i bytes or more; a stale x̄_i holding it
  counts here too). Such an X was in turn allocated at t_{m+1} (c_{i,m+1}), or made in I_{m+1}
  by a forward (u_{i,m+1}) or a prefetch (h_{i,m+1} or, not read in I_{m+1}, k_{i,m+1}: the
  prefetch that made the instance present at t_m). B(m) reads a_{m-1}: when F*_{m-1} lies in
  I_m it is such an X.
* When B(m) starts, the GPU holds its working set, a_0 and, after B(L), the caller's bytes
  (:func:`solvers.bounds.backward_room`), every x̄_i (i < m) that F*_i made before t_m unless
  it was copied out by then, B(m)'s input a_{m-1} when x̄_{m-1} is not there, and the c_im.
  Copied out: before t_L and made in the first pass (o_i; back after t_L), by t_m and made in
  the first pass (l_im; back after t_m), or by t_m and made after t_L (w_im, both copies after
  t_L).
* The a_i that a prefetch brings back (h_im, k_im) was first copied out (alone, or inside a
  whole x̄_i: x_i bytes or more either way) from the instance its forward made: before t_L
  (e_i, on the channel during the first pass), or later, from an instance allocated at t_L
  (c_iL) or made by a forward after t_L (u_in, n >= m).
* A prefetch of a_i after t_k reads a host copy. The first copy of a_i (alone or in x̄_i) to
  end copies an instance X made by a forward before that prefetch starts (a prefetched one
  would have read an earlier copy). If X was made before t_k, then at t_k that copy has
  ended, or X is still allocated (an offloaded tensor leaves the GPU when its copy ends): as
  a c_ik, as F*_i's x̄_i, or otherwise (z_ik, x_i bytes or more; with ``in_flight``).
* A prefetch of a_i that starts in I_m and is not read there (k_im) ends before its instance
  is first read, in some I_n or by B(i+1), and that instance is a c_il at every t_l between:
  its copy fits in τ_m and those intervals (with ``in_flight``).
* Each interval takes at least b_m plus its forwards; the copies that must be back before B(k)
  fit on the host-to-device channel between t_L and t_k, those out by t_k on the
  device-to-host channel between F(1)'s end and t_k (with ``in_flight``, those of stages j
  and up between F(j)'s end in the first pass and t_k), and the o_i as in
  :mod:`solvers.milp_bound`.

The model's optimum (or, cut short, HiGHS's proven dual bound) is a lower bound on every plan's
time: a plan's own ops give values to every variable that meet every constraint, with an
objective at most its time. The binaries grow as L²; long chains are cut short by the limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pulp

from solvers.bounds import backward_room
from solvers.chain import Chain
from solvers.milp_model import time_unit
from solvers.milp_search import HIGHS_OPTIONS, native_stdout_silenced

Var = pulp.LpVariable
WINDOW = 6
"""The most intervals one window of :func:`_add_fetch_windows` spans."""


@dataclass
class _Model:
    """The variables, indexed by (stage, interval); a missing key is a value fixed at 0."""

    chain: Chain
    copying: bool
    in_flight: bool
    problem: pulp.LpProblem = field(default_factory=lambda: pulp.LpProblem("intervals"))
    recomputed: dict[int, Var] = field(default_factory=dict)  # r_i
    offloaded: dict[int, Var] = field(default_factory=dict)  # o_i
    final: dict[tuple[int, int], Var] = field(default_factory=dict)  # p_im
    other: dict[tuple[int, int], Var] = field(default_factory=dict)  # u_im
    held: dict[tuple[int, int], Var] = field(default_factory=dict)  # c_im
    fetched: dict[tuple[int, int], Var] = field(default_factory=dict)  # h_im
    fetched_later: dict[tuple[int, int], Var] = field(default_factory=dict)  # k_im
    late: dict[tuple[int, int], Var] = field(default_factory=dict)  # l_im
    refetched: dict[tuple[int, int], Var] = field(default_factory=dict)  # w_im
    interval: dict[int, Var] = field(default_factory=dict)  # t_{m-1} - t_m, scaled
    sent_early: dict[int, Var] = field(default_factory=dict)  # a_i's host copy out by t_L
    leaving: dict[tuple[int, int], Var] = field(default_factory=dict)  # z_im

    def binary(self, name: str) -> Var:
        return self.problem.add_variable(name, cat=pulp.LpBinary)

    def fraction(self, name: str) -> Var:
        return self.problem.add_variable(name, 0, 1)

    made: dict[tuple[int, int], Var] = field(default_factory=dict)  # q_im

    def made_after(self, i: int, m: int) -> pulp.LpAffineExpression | Var | int:
        """q_im: whether F*_i lies after t_m (in I_m' for some m' <= m)."""
        return self.made.get((i, m), 0)

    def add_made(self, i: int) -> None:
        """q_im = p_{i,i+1} + ... + p_im, as variables: each sum is used often."""
        for m in range(i + 1, self.chain.length + 1):
            self.made[i, m] = self.problem.add_variable(f"q{i}_{m}", 0, 1)
            self.problem += self.made[i, m] == self.made_after(i, m - 1) + self.final[i, m]

    def away(self, i: int, m: int) -> pulp.LpAffineExpression:
        """Whether F*_i's x̄_i is not on the GPU when B(m) starts (i < m)."""
        if m == self.chain.length:
            return self.recomputed[i] + self.offloaded[i]
        return (
            self.made_after(i, m)
            + self.offloaded[i]
            + self.late.get((i, m), 0)
            + self.refetched.get((i, m), 0)
        )

    def source(self, i: int, m: int) -> pulp.LpAffineExpression:
        """Whether a_i can be there for a forward of stage i+1 in I_m (the module's notes)."""
        return (
            1
            - self.made_after(i, m - 1)
            + self.held.get((i, m), 0)
            + self.other.get((i, m), 0)
            + self.fetched.get((i, m), 0)
        )


def interval_bound_s(
    chain: Chain,
    budget_bytes: int,
    offload: bool = True,
    time_limit_s: float = 5.0,
    in_flight: bool = True,
) -> float:
    """The least step time the interval model allows at ``budget_bytes`` (``-inf`` when HiGHS
    proves nothing in ``time_limit_s``); for chains without frozen stages whose backwards'
    working sets fit, as :func:`solvers.milp_bound.whole_tensor_bound_s` calls it. With
    ``in_flight``, also where the instance behind a host copy is while the copy runs, when
    each stage's copies can start and when a prefetch that outlives its interval ends:
    tighter (ResNet-50 at 50% of keep-all: 28.34 to rotor's 28.67 ms, at 35%: 30.07 to
    30.53 ms against rotor's 30.56), and slower to close (82 s at 35%)."""
    length = chain.length
    model = _Model(chain, offload and chain.link is not None, in_flight)
    scale = time_unit(chain, offload)
    _add_variables(model)
    first_pass = model.problem.add_variable("first_pass")
    model.problem += first_pass >= sum(s.fwd_s for s in chain.stages) / scale
    starts = {length: first_pass + 0}  # t_m, scaled
    for m in range(length, 1, -1):
        starts[m - 1] = starts[m] + model.interval[m]
    model.problem += starts[1] + model.interval[1]  # T
    _add_sources(model)
    _add_compute(model, scale)
    for m in range(2, length + 1):
        _add_memory(model, budget_bytes, m)
    if model.copying:
        _add_copies(model, scale, first_pass, starts)
    with native_stdout_silenced():  # HiGHS prints its banner from C
        solver = pulp.HiGHS(msg=False, timeLimit=time_limit_s, gapRel=0, **HIGHS_OPTIONS)
        model.problem.solve(solver)
    info = model.problem.solverModel.getInfo()
    proven = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else -math.inf
    return proven * scale * (1 - 1e-9)


def _add_variables(model: _Model) -> None:
    length = model.chain.length
    for m in range(1, length + 1):
        model.interval[m] = model.problem.add_variable(f"tau{m}", 0)
    for i in range(1, length):
        model.recomputed[i] = model.binary(f"r{i}")
        model.offloaded[i] = model.binary(f"o{i}")
        if not model.copying:
            model.problem += model.offloaded[i] == 0
        model.problem += model.recomputed[i] + model.offloaded[i] <= 1
        for m in range(i + 1, length + 1):
            model.final[i, m] = model.binary(f"p{i}_{m}")
        model.add_made(i)
        model.problem += model.made_after(i, length) == model.recomputed[i]
        for m in range(i + 2, length + 1):  # a_i read in I_m by a forward of stage i+1
            model.other[i, m] = model.binary(f"u{i}_{m}")
            model.held[i, m] = model.binary(f"c{i}_{m}")
            if model.copying:
                model.fetched[i, m] = model.binary(f"h{i}_{m}")
                model.fetched_later[i, m] = model.binary(f"k{i}_{m}")
        if model.copying and i < length - 1:
            _add_host_copy(model, i)
        for m in range(i + 1, length):  # copied out by t_m, m < L (at t_L: o_i)
            if model.copying:
                model.late[i, m] = model.binary(f"l{i}_{m}")
                model.refetched[i, m] = model.binary(f"w{i}_{m}")
                made_before = model.recomputed[i] - model.made_after(i, m)
                model.problem += model.refetched[i, m] <= made_before
                model.problem += model.late[i, m] <= 1 - model.recomputed[i] - model.offloaded[i]


def _add_host_copy(model: _Model, i: int) -> None:
    """An a_i on the host (h_im, k_im) was first copied out from the instance that its
    forward made: before t_L (e_i), or later, and then that instance was allocated at t_L
    (c_iL, which counts any instance of a_i other than x̄_i's allocated then), or the
    forward ran after t_L (u_in)."""
    model.sent_early[i] = model.binary(f"e{i}")
    length = model.chain.length
    for m in range(i + 2, length + 1):
        if model.in_flight:
            model.leaving[i, m] = model.binary(f"z{i}_{m}")
        # Made after t_L, the copied instance was made before the prefetch: in I_n, n >= m.
        made_late = pulp.lpSum(model.other[i, n] for n in range(m, length + 1))
        for fetch in (model.fetched[i, m], model.fetched_later[i, m]):
            model.problem += fetch <= model.sent_early[i] + model.held[i, length] + made_late


def _add_sources(model: _Model) -> None:
    """Each forward after t_L reads its input; an instance held at t_m came from somewhere."""
    problem, length = model.problem, model.chain.length
    for i in range(2, length):
        for m in range(i + 1, length + 1):
            problem += model.final[i, m] <= model.source(i - 1, m)  # F*_i reads a_{i-1}
        for m in range(i + 2, length + 1):
            problem += model.other[i, m] <= model.source(i - 1, m)
    for (i, m), c in model.held.items():
        if m < length:
            problem += c <= (
                model.held.get((i, m + 1), 0)
                + model.other[i, m + 1]
                + model.fetched.get((i, m + 1), 0)
                + model.fetched_later.get((i, m + 1), 0)
            )
    for i in range(1, length - 1):  # B(i+1)'s input a_i when F*_i comes after t_{i+1}
        problem += model.final[i, i + 1] <= (
            model.held[i, i + 2]
            + model.other[i, i + 2]
            + model.fetched.get((i, i + 2), 0)
            + model.fetched_later.get((i, i + 2), 0)
        )


def _add_compute(model: _Model, scale: float) -> None:
    """Each interval runs its backward and the forwards listed in it."""
    chain = model.chain
    for m in range(1, chain.length + 1):
        forwards = pulp.lpSum(
            u * chain.stage(i).fwd_s for (i, n), u in model.other.items() if n == m
        ) + pulp.lpSum(
            p * (chain.stage(i).fwd_s if m >= i + 2 else chain.stage(i).refill_s)
            for (i, n), p in model.final.items()
            if n == m
        )
        model.problem += model.interval[m] >= (chain.stage(m).bwd_s + forwards) / scale


def _add_memory(model: _Model, budget_bytes: int, m: int) -> None:
    """What is allocated when B(m) starts fits beside its working set."""
    chain = model.chain
    unit = max(s.saved_bytes for s in chain.stages) or 1
    kept = pulp.lpSum((1 - model.away(i, m)) * chain.stage(i).saved_bytes for i in range(1, m))
    kept += model.away(m - 1, m) * chain.activation_bytes(m - 1)  # B(m)'s input, alone
    kept += pulp.lpSum(
        (model.held[i, m] + model.leaving.get((i, m), 0)) * chain.activation_bytes(i)
        for i in range(1, m - 1)
    )
    model.problem += kept / unit <= backward_room(chain, budget_bytes, m) / unit


def _add_copies(model: _Model, scale: float, first_pass: Var, starts: dict) -> None:
    """The copies fit on their channels (the module's notes)."""
    chain, problem, length = model.chain, model.problem, model.chain.length
    d2h = chain.link.d2h_bytes_per_s * scale
    h2d = chain.link.h2d_bytes_per_s * scale
    saved = {i: chain.stage(i).saved_bytes for i in range(1, length)}
    out = {i: chain.activation_bytes(i) for i in range(1, length)}
    first_forwards = 0.0
    for k in range(1, length):
        first_forwards += chain.stage(k).fwd_s / scale
        moved = pulp.lpSum(model.offloaded[i] * saved[i] for i in range(k, length))
        moved += pulp.lpSum(e * out[i] for i, e in model.sent_early.items() if i >= k)
        problem += first_pass >= first_forwards + moved / d2h
    # A copy of x̄_i out by t_n is out by every later t_k (k <= n); one out at any t_m comes
    # back after it and before B(i).
    late_by = _out_by(model, {key: [v] for key, v in model.late.items()}, "L")
    again_by = _out_by(model, {key: [v] for key, v in model.refetched.items()}, "W")
    every_fetch = pulp.lpSum(
        v * out[i] for (i, _), v in [*model.fetched.items(), *model.fetched_later.items()]
    )

    def back(i: int) -> pulp.LpAffineExpression:
        return (model.offloaded[i] + late_by.get((i, i + 1), 0) + again_by.get((i, i + 1), 0)) * (
            saved[i]
        )

    every_back = pulp.lpSum(back(i) for i in range(1, length))
    problem += starts[1] + model.interval[1] - first_pass >= (every_back + every_fetch) / h2d
    f_1 = chain.stage(1).fwd_s / scale
    # One copy of a_i out before each prefetch of it: by t_k, for those in I_m, m > k.
    fetches = {(i, k): [] for i in model.sent_early for k in range(1, length)}
    for (i, m), v in [*model.fetched.items(), *model.fetched_later.items()]:
        fetches[i, m - 1].append(v)
    sent_by = _out_by(model, fetches, "G")
    for k in range(1, length):
        # Back before B(k): the x̄_i, i >= k, copied out; the h_im read before t_k (m > k).
        before = pulp.lpSum(back(i) for i in range(k, length))
        before += pulp.lpSum(h * out[i] for (i, m), h in model.fetched.items() if m > k)
        problem += starts[k] - first_pass >= before / h2d
        # Out by t_k: every o_i, the x̄_i gone by t_k, one copy of each a_i fetched before t_k.
        sent = {i: sent_by[i, k] for i in range(1, length) if (i, k) in sent_by}
        after_l = pulp.lpSum(again_by[i, k] * saved[i] for i in range(1, k))
        out_by_k = pulp.lpSum(model.offloaded[i] * saved[i] for i in range(1, length))
        out_by_k += after_l + pulp.lpSum(late_by[i, k] * saved[i] for i in range(1, k))
        out_by_k += pulp.lpSum(g * out[i] for i, g in sent.items())
        problem += starts[k] - f_1 >= out_by_k / d2h
        problem += starts[k] - first_pass >= after_l / d2h  # the w_im leave after t_L
    _add_fetch_windows(model, starts, h2d, out)
    if not model.in_flight:
        return
    _add_leaving(model, late_by, again_by, sent_by)
    _add_fetch_ends(model, h2d, out)
    # A copy of stage i's x̄_i or a_i leaves after the first pass's F(i) has made it: those of
    # stages j and up, out by t_k, fit on the channel between F(j)'s end and t_k.
    for k in range(1, length):
        gone = {
            i: model.offloaded[i] * saved[i]
            + (late_by.get((i, k), 0) + again_by.get((i, k), 0)) * saved[i]
            + sent_by.get((i, k), 0) * out[i]
            for i in range(2, length)
        }
        first_forwards = chain.stage(1).fwd_s / scale
        for j in range(2, length):
            first_forwards += chain.stage(j).fwd_s / scale
            later = pulp.lpSum(gone[i] for i in range(j, length))
            problem += starts[k] - first_forwards >= later / d2h


def _add_leaving(model: _Model, late_by: dict, again_by: dict, sent_by: dict) -> None:
    """A prefetch of a_i reads a host copy: take the first copy of a_i (alone or in x̄_i) to
    end, and X the instance it copies, made before that prefetch starts by a forward (a
    prefetched one would have read an earlier copy). N_ik: a prefetch of a_i starts after t_k
    and X was made before t_k. Then at t_k that copy has ended (out by t_k on the channel),
    or X is allocated (an offloaded tensor leaves the GPU when its copy ends): as a c_ik, as
    F*_i's x̄_i, or otherwise (z_ik, x_i bytes or more)."""
    problem, length = model.problem, model.chain.length
    for i in model.sent_early:
        needed = 0
        for k in range(i + 2, length + 1):  # t_k earlier as k grows
            # A forward of stage i in I_k may make X for a prefetch after it, in I_k or later.
            made = model.final[i, k] + model.other[i, k]
            fetches = (needed, model.fetched[i, k], model.fetched_later[i, k])
            needed = model.fraction(f"N{i}_{k}")
            for fetch in fetches:
                problem += needed >= fetch - made
            if k == length:
                ended = model.sent_early[i] + model.offloaded[i]
            else:
                ended = sent_by[i, k] + model.offloaded[i] + late_by[i, k] + again_by[i, k]
            problem += needed <= (
                ended + model.held[i, k] + model.leaving[i, k] + 1 - model.away(i, k)
            )


def _out_by(model: _Model, gone: dict, name: str) -> dict:
    """For each (i, k): at least every binary of ``gone[i, n]``, n >= k (a copy that ended by
    t_n ended by t_k)."""
    by = {}
    for i, k in sorted(gone, key=lambda key: (key[0], -key[1])):
        by[i, k] = model.problem.add_variable(f"{name}{i}_{k}", 0, 1)
        for v in gone[i, k]:
            model.problem += by[i, k] >= v
        if (i, k + 1) in by:
            model.problem += by[i, k] >= by[i, k + 1]
    return by


def _add_fetch_windows(model: _Model, starts: dict, h2d: float, out: dict) -> None:
    """An h_im prefetch runs between t_m and t_{m-1}: those of I_{k+1} .. I_n fit between t_n
    and t_k. Windows of up to WINDOW intervals: each is a valid constraint, and all of them
    would take L⁴ terms."""
    length = model.chain.length
    by_interval = {m: [] for m in range(1, length + 1)}
    for (i, m), h in model.fetched.items():
        by_interval[m].append(h * out[i])
    for k in range(1, length):
        for n in range(k + 1, min(length, k + WINDOW) + 1):
            inside = pulp.lpSum(term for m in range(k + 1, n + 1) for term in by_interval[m])
            model.problem += starts[k] - starts[n] >= inside / h2d


def _add_fetch_ends(model: _Model, h2d: float, out: dict) -> None:
    """A k_im prefetch starts after t_m and ends before its instance Y is first read: by a
    forward in I_n (n < m) or by B(i+1) (then n = i+2). Y is a c_il at every t_l, n <= l < m
    (π_l, contiguous from t_{m-1}), and its copy fits in τ_m plus those intervals (σ_l <= τ_l,
    capped at the copy's time when π_l)."""
    problem = model.problem
    for (i, m), fetch in model.fetched_later.items():
        copy = out[i] / h2d
        unread, spans = 1, []
        for n in range(m - 1, i + 1, -1):
            unread_here = model.fraction(f"P{i}_{m}_{n}")
            problem += unread_here <= unread
            problem += unread_here <= model.held[i, n]
            span = problem.add_variable(f"S{i}_{m}_{n}", 0)
            problem += span <= model.interval[n]
            problem += span <= copy * unread_here
            spans.append(span)
            unread = unread_here
        problem += copy * fetch <= model.interval[m] + pulp.lpSum(spans)
