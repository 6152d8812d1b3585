"""Inputs as they were at the call: copies of mutable arguments for the op-level replay."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn

from nbdebug.core.trace.capture import CallCapture, copy_arguments
from nbdebug.core.trace.frames import frame_kind, user_frame


class Layer:
    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None


class Cache:
    """Shaped like a Hugging Face DynamicCache: layers extended in place by each call."""

    def __init__(self, n: int) -> None:
        self.layers = [Layer() for _ in range(n)]
        self.first = self.layers[0]  # a second reference to the same layer

    def update(self, i: int, k: torch.Tensor) -> torch.Tensor:
        layer = self.layers[i]
        layer.keys = k if layer.keys is None else torch.cat([layer.keys, k], 1)
        return layer.keys


def test_a_copied_cache_can_be_extended_without_touching_the_original() -> None:
    cache = Cache(2)
    cache.update(0, torch.ones(2, 3))
    copy = copy_arguments(cache)
    assert copy is not cache and copy.layers[0] is not cache.layers[0]
    assert copy.first is copy.layers[0]  # shared references stay shared
    copy.update(0, torch.ones(2, 3))
    copy.layers[0].keys.mul_(5)
    assert cache.layers[0].keys.shape == (2, 3)
    assert torch.equal(cache.layers[0].keys, torch.ones(2, 3))


def test_modules_functions_and_plain_batches_are_not_copied() -> None:
    lin = nn.Linear(2, 2)
    x = torch.randn(3, 2)
    out = copy_arguments({"m": lin, "f": torch.relu, "x": x, "n": 3}, clone_tensors=False)
    assert out["m"] is lin and out["f"] is torch.relu and out["x"] is x and out["n"] == 3
    # leaves=True: clones that require grad where the originals do, leaves of their own
    w = torch.randn(3, 2, requires_grad=True)
    made = w * 2  # a tensor with a graph behind it
    got = copy_arguments({"w": w, "made": made, "x": x}, leaves=True)
    assert got["w"].requires_grad and got["w"].is_leaf and got["w"] is not w
    assert got["made"].requires_grad and got["made"].is_leaf and got["made"].grad_fn is None
    assert not got["x"].requires_grad
    assert torch.equal(got["made"], made.detach())


def test_clone_tensors_detaches_and_copies_once_per_tensor() -> None:
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    a, b = copy_arguments((y, y))
    assert a is b and a is not y and not a.requires_grad and torch.equal(a, y.detach())


def test_a_capture_gives_fresh_copies_for_each_replay() -> None:
    cache = Cache(1)
    cap = CallCapture.take((torch.zeros(1),), {"cache": cache})
    cache.update(0, torch.ones(1, 4))  # the call extends the user's cache afterwards
    for _ in range(2):
        _, kwargs = cap.fresh()
        assert kwargs["cache"].layers[0].keys is None
        kwargs["cache"].update(0, torch.ones(1, 4))


def test_frame_kinds() -> None:
    assert frame_kind(torch.__file__) == "torch"
    assert frame_kind(os.__file__) == "python"
    assert frame_kind(__file__) == "user"
    assert frame_kind(os.path.join(os.path.dirname(torch.__file__) + "vision", "x.py")) == "user"


def _defined_in(filename: str, source: str, name: str, **env: object) -> Any:
    """A function whose code claims to live in ``filename`` (as its frames will say)."""
    ns: dict[str, Any] = dict(env)
    exec(compile(source, filename, "exec"), ns)
    return ns[name]


def test_user_frame_is_the_first_frame_outside_torch_site_packages_counting_as_user() -> None:
    """One rule (DESIGN.md): the first frame outside torch's own files (and nbdebug's and
    the standard library's); a library in site-packages, even in the standard library's
    folder, is the user's code."""
    torch_dir = os.path.dirname(torch.__file__)
    stdlib_dir = os.path.dirname(os.__file__)
    probe = _defined_in(
        os.path.join(torch_dir, "nn", "probe.py"),
        "def probe():\n    return user_frame(sys._getframe(0))\n",
        "probe",
        user_frame=user_frame,
        sys=sys,
    )
    in_torch = _defined_in(
        os.path.join(torch_dir, "nn", "fake.py"), "def in_torch(f):\n    return f()\n", "in_torch"
    )
    lib_file = os.path.join(stdlib_dir, "site-packages", "somelib", "mod.py")
    in_lib = _defined_in(lib_file, "def in_lib(f, *a):\n    return f(*a)\n", "in_lib")
    in_stdlib = _defined_in(
        os.path.join(stdlib_dir, "fake_stdlib.py"),
        "def in_stdlib(f, *a):\n    return f(*a)\n",
        "in_stdlib",
    )
    assert frame_kind(lib_file) == "user"
    found = in_lib(in_torch, probe)
    assert found is not None and found.f_code.co_filename == lib_file
    found = in_stdlib(in_torch, probe)  # the stdlib is skipped: this test's frame
    assert found is not None and found.f_code.co_filename == __file__
    assert user_frame(None) is None
