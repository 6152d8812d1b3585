"""Which Jacobian elements (or random projections) a gradient check measures, and how:
:class:`Layout` picks the checked rows and columns (a seeded random subset of a large
input, and of a large output the elements the checked inputs move), measures the numerical
Jacobian by central differences and the analytic one by batched vector-Jacobian products
(:func:`batched_vjp`).

Jacobians are ``(rows, cols)`` numpy arrays with ``J[r, c] = d out[rows[r]] / d in[cols[c]]``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from .problem import Problem, raised

#: elements of gradient rows materialised at once by the batched backward
GRAD_CHUNK_ELEMENTS = 1 << 24


@dataclass
class Layout:
    """Which elements (or projections) are checked, and how to measure them."""

    problem: Problem
    xs0: list[torch.Tensor]
    f0: list[torch.Tensor]
    fast: bool
    cols: list[np.ndarray] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)
    sampled_in: list[bool] = field(default_factory=list)
    sampled_out: list[bool] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    n_proj: int = 4
    v: list[list[torch.Tensor]] = field(default_factory=list)  # [input][proj] direction
    u: list[list[torch.Tensor]] = field(default_factory=list)  # [output][proj] flat

    @classmethod
    def build(
        cls,
        problem: Problem,
        xs0: list[torch.Tensor],
        f0: list[torch.Tensor],
        *,
        eps: float,
        max_elements: int,
        fast: bool,
        rng: np.random.Generator,
    ) -> Layout:
        lay = cls(problem, xs0, f0, fast)
        if fast:
            lay.v = [[unit_vector(rng, tuple(x.shape), x) for _ in range(lay.n_proj)] for x in xs0]
            lay.u = [[unit_vector(rng, (f.numel(),), f) for _ in range(lay.n_proj)] for f in f0]
            return lay
        for name, x in zip(problem.names, xs0):
            n = x.numel()
            if n > max_elements:
                lay.cols.append(
                    np.sort(rng.choice(n, size=max_elements, replace=False)).astype(np.int64)
                )
                lay.sampled_in.append(True)
                lay.notes.append(
                    f"{name} has {n} elements: checked a random subset of {max_elements}."
                )
            else:
                lay.cols.append(np.arange(n, dtype=np.int64))
                lay.sampled_in.append(False)
        big = [k for k, f in enumerate(f0) if f.numel() > max_elements]
        influenced: dict[int, list[np.ndarray]] = {k: [] for k in big}
        if big:
            # one probe per input: which output elements do the checked input elements move?
            for i, x in enumerate(xs0):
                s = torch.zeros(x.numel(), dtype=torch.float64)
                picked = lay.cols[i]
                s[torch.from_numpy(picked)] = torch.from_numpy(
                    rng.uniform(0.5, 1.0, picked.size) * rng.choice([-1.0, 1.0], picked.size)
                )
                direction = s.reshape(x.shape).to(x.device, x.dtype)
                plus = lay.shifted(i, direction, eps)
                minus = lay.shifted(i, direction, -eps)
                for k in big:
                    moved = (plus[k] - minus[k]).abs().cpu().numpy()
                    influenced[k].append(np.flatnonzero(moved > 0))
        for k, f in enumerate(f0):
            n = f.numel()
            name = (problem.out_names or [])[k]
            if k not in big:
                lay.rows.append(np.arange(n, dtype=np.int64))
                lay.sampled_out.append(False)
                continue
            chosen: set[int] = set()
            sets = [hit for hit in influenced[k] if hit.size]
            n_hit = np.unique(np.concatenate(sets)).size if sets else 0
            # all moved elements when they fit, else 3/4 of the budget (the rest: random ones)
            quota = max_elements if n_hit <= max_elements else (3 * max_elements) // 4
            for j, hit in enumerate(sets):
                share = (quota - len(chosen)) // (len(sets) - j)
                if share > 0:
                    fresh = np.setdiff1d(
                        hit, np.fromiter(chosen, dtype=np.int64, count=len(chosen))
                    )
                    if fresh.size:
                        take = rng.choice(fresh, size=min(share, fresh.size), replace=False)
                        chosen.update(int(t) for t in take)
            rest = np.setdiff1d(
                np.arange(n), np.fromiter(chosen, dtype=np.int64, count=len(chosen))
            )
            extra = rng.choice(rest, size=min(max_elements - len(chosen), rest.size), replace=False)
            chosen.update(int(t) for t in extra)
            lay.rows.append(np.sort(np.fromiter(chosen, dtype=np.int64, count=len(chosen))))
            lay.sampled_out.append(True)
            lay.notes.append(
                f"{name} has {n} elements: checked {len(chosen)} of them (elements the checked "
                "inputs move, plus random ones)."
            )
        return lay

    def direction(self, i: int, c: int) -> torch.Tensor | int:
        return self.v[i][c] if self.fast else int(self.cols[i][c])

    def shifted(self, i: int, d: torch.Tensor | int, h: float) -> list[torch.Tensor]:
        """Flat float64 outputs with input ``i`` moved by ``h`` along ``d`` (an element index
        or a direction tensor)."""
        x = self.xs0[i].clone()
        if isinstance(d, int):
            x.view(-1)[d] += h
        else:
            x.add_(d, alpha=h)
        xs = list(self.xs0)
        xs[i] = x
        return self.problem.flat(xs)

    def measure(self, k: int, c: int, flat: torch.Tensor) -> np.ndarray:
        """The checked rows of output ``k`` (fast: its projection ``u_c``), shape (R,)."""
        if self.fast:
            return np.array([float(torch.dot(self.u[k][c], flat))])
        return flat[torch.from_numpy(self.rows[k]).to(flat.device)].cpu().numpy()

    def numerical(self, h: float) -> list[list[np.ndarray]]:
        K = len(self.f0)
        out = [[np.empty(0) for _ in self.xs0] for _ in range(K)]
        for i in range(len(self.xs0)):
            C = self.n_proj if self.fast else self.cols[i].size
            cols_k: list[list[np.ndarray]] = [[] for _ in range(K)]
            for c in range(C):
                d = self.direction(i, c)
                plus = self.shifted(i, d, h)
                minus = self.shifted(i, d, -h)
                for k in range(K):
                    cols_k[k].append(
                        (self.measure(k, c, plus[k]) - self.measure(k, c, minus[k])) / (2 * h)
                    )
            for k in range(K):
                R = 1 if self.fast else self.rows[k].size
                out[k][i] = np.stack(cols_k[k], axis=1) if C else np.zeros((R, 0))
        return out

    def analytic(self) -> tuple[list[list[np.ndarray]], bool]:
        """The backward's Jacobian entries at the checked rows/columns, and whether the
        output had no autograd graph at all."""
        xs = [x.detach().clone().requires_grad_(True) for x in self.xs0]
        outs = self.problem.outputs(xs, grad=True)
        K, n_in = len(outs), len(xs)
        if self.fast:
            ys = [o.reshape(-1) for o in outs]
            # grad_outputs: one row per (output k, projection p)
            vecs = []
            for k in range(K):
                for p in range(self.n_proj):
                    vecs.append(
                        torch.cat(
                            [
                                self.u[k][p].to(y.dtype) if j == k else torch.zeros_like(y)
                                for j, y in enumerate(ys)
                            ]
                        )
                    )
            y = torch.cat(ys)
            grads, no_graph = batched_vjp(y, xs, torch.stack(vecs), self.problem.fn_name)
            out = [[np.zeros((1, self.n_proj)) for _ in range(n_in)] for _ in range(K)]
            for k in range(K):
                for i in range(n_in):
                    for p in range(self.n_proj):
                        g = grads[i][k * self.n_proj + p]
                        out[k][i][0, p] = float(
                            torch.dot(
                                g.to(torch.float64), self.v[i][p].reshape(-1).to(torch.float64)
                            )
                        )
            return out, no_graph
        sel = [
            o.reshape(-1)[torch.from_numpy(self.rows[k]).to(o.device)] for k, o in enumerate(outs)
        ]
        y = torch.cat(sel) if sel else torch.zeros(0)
        eye = torch.eye(y.numel(), dtype=y.dtype, device=y.device)
        cols = [torch.from_numpy(c).to(x.device) for c, x in zip(self.cols, xs)]
        grads, no_graph = batched_vjp(y, xs, eye, self.problem.fn_name, cols=cols)
        out = []
        offset = 0
        for k in range(K):
            R = self.rows[k].size
            out.append(
                [grads[i][offset : offset + R].to(torch.float64).cpu().numpy() for i in range(n_in)]
            )
            offset += R
        return out, no_graph


def batched_vjp(
    y: torch.Tensor,
    xs: list[torch.Tensor],
    vecs: torch.Tensor,
    fn_name: str,
    *,
    cols: list[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], bool]:
    """``vecs @ J`` for each input: one vector-Jacobian product per row of ``vecs``, batched
    with ``is_grads_batched`` (checked against one unbatched product, else a loop). Returns,
    per input, a (rows, cols-or-numel) tensor; and True when ``y`` has no graph at all."""
    B = vecs.shape[0]
    widths = [c.numel() for c in cols] if cols is not None else [x.numel() for x in xs]
    out = [torch.zeros(B, w, dtype=torch.float64, device=x.device) for w, x in zip(widths, xs)]
    if B == 0 or not y.requires_grad:
        return out, not y.requires_grad

    def take(g: torch.Tensor | None, i: int, lead: int) -> torch.Tensor:
        if g is None:
            return torch.zeros(lead, widths[i], dtype=torch.float64, device=xs[i].device)
        g = g.reshape(lead, -1)
        if cols is not None:
            g = g[:, cols[i]]
        return g.to(torch.float64)

    def single(r: int) -> list[torch.Tensor]:
        try:
            gs = torch.autograd.grad(y, xs, vecs[r], retain_graph=True, allow_unused=True)
        except Exception as e:
            raise raised(f"the backward of {fn_name}", e) from e
        return [take(g, i, 1)[0] for i, g in enumerate(gs)]

    first = single(0)
    numel = sum(x.numel() for x in xs)
    chunk = max(1, min(B, GRAD_CHUNK_ELEMENTS // max(numel, 1)))
    batched = B > 1
    start = 0
    while start < B:
        stop = min(B, start + chunk)
        rows_out = None
        if batched:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    gs = torch.autograd.grad(
                        y,
                        xs,
                        vecs[start:stop],
                        retain_graph=True,
                        allow_unused=True,
                        is_grads_batched=True,
                    )
                rows_out = [take(g, i, stop - start) for i, g in enumerate(gs)]
                if start == 0 and not all(
                    torch.allclose(r[0], f, rtol=1e-9, atol=1e-12, equal_nan=True)
                    for r, f in zip(rows_out, first)
                ):
                    rows_out, batched = None, False
            except Exception:
                rows_out, batched = None, False
        if rows_out is None:
            rows_out = [torch.stack(col) for col in zip(*(single(r) for r in range(start, stop)))]
        for i in range(len(xs)):
            out[i][start:stop] = rows_out[i]
        start = stop
    return out, False


def unit_vector(
    rng: np.random.Generator, shape: tuple[int, ...], like: torch.Tensor
) -> torch.Tensor:
    """A seeded random unit vector of ``shape``, in ``like``'s device and float dtype."""
    v = rng.standard_normal(int(np.prod(shape)) if shape else 1)
    v /= np.linalg.norm(v) or 1.0
    return torch.from_numpy(v.reshape(shape)).to(
        like.device, torch.float64 if not like.is_floating_point() else like.dtype
    )
