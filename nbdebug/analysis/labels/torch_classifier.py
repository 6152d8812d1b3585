"""A small scikit-learn adapter around a torch classifier, trained from scratch per fold.

:class:`TorchClassifier` lets :func:`nbdebug.find_label_issues` (through
``sklearn.model_selection.cross_val_predict``) get out-of-fold probabilities from a torch
model: every ``fit`` trains a fresh copy, the module the user passed is never touched, and
the global RNG state is left as it was.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin


def _as_float_tensor(X: object) -> torch.Tensor:
    if isinstance(X, torch.Tensor):
        return X.detach().to(torch.float32).cpu()
    if hasattr(X, "to_numpy"):  # pandas
        X = X.to_numpy()
    return torch.as_tensor(np.asarray(X, dtype=np.float32))


class TorchClassifier(ClassifierMixin, BaseEstimator):
    """Train a torch classifier with cross-entropy, scikit-learn style.

    Parameters
    ----------
    module : torch.nn.Module or callable
        A module used as a template (deep-copied and its parameters re-initialised through
        each submodule's ``reset_parameters`` at every ``fit``) or a zero-argument factory
        returning a fresh module. Its output must be logits of shape ``(batch, K)`` with
        ``K`` at least the number of classes.
    epochs, lr, batch_size, weight_decay : training settings (Adam).
    random_state : int
        Seed for initialisation and shuffling (the global RNG is restored afterwards).

    Attributes
    ----------
    module_ : torch.nn.Module
        The trained copy.
    classes_ : ndarray of int
    """

    def __init__(
        self,
        module: torch.nn.Module | Callable[[], torch.nn.Module],
        *,
        epochs: int = 30,
        lr: float = 1e-2,
        batch_size: int = 64,
        weight_decay: float = 0.0,
        random_state: int = 0,
    ):
        self.module = module
        self.epochs = epochs
        self.lr = lr
        self.batch_size = batch_size
        self.weight_decay = weight_decay
        self.random_state = random_state

    def _fresh(self) -> torch.nn.Module:
        if isinstance(self.module, torch.nn.Module):
            net = copy.deepcopy(self.module)
            for m in net.modules():
                reset = getattr(m, "reset_parameters", None)
                if callable(reset):
                    reset()
            return net
        if callable(self.module):
            net = self.module()
            if not isinstance(net, torch.nn.Module):
                raise TypeError(
                    "TorchClassifier's module factory must return a torch.nn.Module; "
                    f"it returned {type(net).__qualname__}."
                )
            return net
        raise TypeError(
            "TorchClassifier expects a torch.nn.Module or a zero-argument factory returning one; "
            f"got {type(self.module).__qualname__}."
        )

    def fit(self, X: object, y: object) -> TorchClassifier:
        xt = _as_float_tensor(X)
        y_np = np.asarray(y.detach().cpu() if isinstance(y, torch.Tensor) else y).astype(np.int64)
        self.classes_ = np.unique(y_np)
        yt = torch.as_tensor(y_np)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.random_state)
            net = self._fresh()
            net.train()
            opt = torch.optim.Adam(net.parameters(), lr=self.lr, weight_decay=self.weight_decay)
            gen = torch.Generator().manual_seed(self.random_state)
            n = len(yt)
            for _ in range(self.epochs):
                perm = torch.randperm(n, generator=gen)
                for start in range(0, n, self.batch_size):
                    idx = perm[start : start + self.batch_size]
                    opt.zero_grad(set_to_none=True)
                    logits = net(xt[idx])
                    _check_logits(logits, self.classes_)
                    loss = torch.nn.functional.cross_entropy(logits, yt[idx])
                    loss.backward()
                    opt.step()
        net.eval()
        self.module_ = net
        return self

    def predict_proba(self, X: object) -> np.ndarray:
        """Probabilities of ``classes_``, shape ``(n, len(classes_))`` float64."""
        xt = _as_float_tensor(X)
        with torch.no_grad():
            logits = self.module_(xt)
        _check_logits(logits, self.classes_)
        p = torch.softmax(logits.double(), dim=1).numpy()[:, self.classes_]
        return p / p.sum(axis=1, keepdims=True)

    def predict(self, X: object) -> np.ndarray:
        return self.classes_[self.predict_proba(X).argmax(axis=1)]


def _check_logits(logits: object, classes: np.ndarray) -> None:
    """One sentence when the module's output is not one score per class."""
    k = int(classes.max()) + 1
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2 or logits.shape[1] < k:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(
            f"the torch model must return one score per class, logits of shape (batch, {k}) "
            f"for the labels' {k} classes (0..{k - 1}); it returned {got}."
        )
