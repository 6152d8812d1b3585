"""The vocabularies of nbdebug: one table each, one home.

Every name a result carries in a field that other code compares (a phase, an event kind,
a guard failure kind, a fix or cause kind) is a member of one of these enums. They are
``str`` enums: a member equals its value (``Phase.FORWARD == "forward"``), prints as its
value, and is written to JSON as its value, so files, frames and user code that use the
plain strings keep working; nbdebug's own code compares members, never bare strings.
"""

from __future__ import annotations

from enum import Enum


class Vocab(str, Enum):
    """A ``str`` enum that prints as its value (``f"{Phase.LOSS}"`` is ``"loss"``)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def parse(cls, value: object, what: str) -> Vocab:
        """The member whose value is ``value``; a clear ``ValueError`` naming ``what``
        and the allowed values otherwise."""
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"{what} must be one of {allowed}; got {value!r}.") from None


class Phase(Vocab):
    """Where in a training step an event happened (``Event.phase``)."""

    INPUT = "input"  # the batch or the target as given
    FORWARD = "forward"  # a module's output
    LOSS = "loss"  # the loss computation
    BACKWARD = "backward"  # a gradient
    OPTIMIZER = "optimizer"  # the update made a weight or optimizer state non-finite


class EventKind(Vocab):
    """Which tensor an event measured (``Event.kind``)."""

    INPUT = "input"  # a batch tensor
    TARGET = "target"  # a tensor of the target (the loss function's second argument)
    OUTPUT = "output"  # a module's output
    LOSS = "loss"  # the loss
    GRAD_OUTPUT = "grad_output"  # gradient arriving at a module's output
    GRAD_INPUT = "grad_input"  # gradient leaving a module through an input
    PARAM_GRAD = "param_grad"  # a parameter's gradient
    UPDATE = "update"  # a parameter or optimizer state tensor after the optimizer step


class FailureKind(Vocab):
    """Why the training-loop guard stopped a step (``NonFiniteError.kind``)."""

    LOSS = "loss"  # the loss is non-finite
    GRAD = "grad"  # a gradient is non-finite while the loss is finite
    WEIGHTS = "weights"  # a weight is non-finite before the step
    SCALE = "scale"  # the grad scaler's scale collapsed
    RANK = "rank"  # another rank of a distributed run failed
    SPIKE = "spike"  # the loss or gradient norm spiked (finite; the spike detector)
    OPTIMIZER = "optimizer"  # the optimizer step made a weight or optimizer state non-finite


class FixKind(Vocab):
    """What a candidate fix of :func:`nbdebug.diagnose` does, and so the kind of cause it
    names when it ranks first (``Fix.kind``, ``Cause.kind``)."""

    EPSILON = "epsilon"  # guard the op that made the value (clamp, eps, shift)
    DROP_ROWS = "drop_rows"  # leave out the batch rows that make the value
    FLOAT32 = "float32"  # run the origin in float32 instead of half precision
    CLIP_GRAD = "clip_grad"  # clip the gradient norm
    LOWER_LR = "lower_lr"  # lower the learning rate
    SCALER = "scaler"  # let the grad scaler skip the step
    CUSTOM = "custom"  # a fix the user wrote
    WEIGHTS_CORRUPTED = "weights_corrupted"  # the weights were non-finite before the step
    NOT_REPRODUCIBLE = "not_reproducible"  # the same step replayed finite
    DIVERGED = "diverged"  # the weights grew over the updates before the step (the history)
    OPTIMIZER_EPS = "optimizer_eps"  # an optimizer eps that the state's dtype can hold
    STATE_FLOAT32 = "state_float32"  # the update and the optimizer state in float32
    RESET_STATE = "reset_state"  # start the optimizer state of the non-finite tensors afresh
    RERUN = "rerun"  # the same step replayed as it was: non-finite again


class UpdateFault(Vocab):
    """Why an optimizer step made a weight or a state tensor non-finite (the ``fault`` of
    an origin with phase ``"optimizer"``)."""

    EPS_BELOW_NORMAL = "eps_below_normal"  # eps under the dtype's smallest normal: 0/0
    ZERO_OVER_ZERO = "zero_over_zero"  # a 0/0 (NaN) in the update with a valid eps
    LR_OVERFLOW = "lr_overflow"  # learning rate x update overflowed the weight's dtype
    STATE_NONFINITE = "state_nonfinite"  # the state held NaN/Inf before the step
    STATE_OVERFLOW = "state_overflow"  # the update overflowed a state tensor's dtype


class FrameKind(Vocab):
    """Whose code a stack frame runs (:func:`nbdebug.core.trace.frames.frame_kind`)."""

    NBDEBUG = "nbdebug"  # nbdebug's own files
    TORCH = "torch"  # torch's own files
    PYTHON = "python"  # the standard library and frozen modules
    USER = "user"  # everything else: the user's code and other libraries (transformers)


class NonFinite(Vocab):
    """Which non-finite value a tensor holds (``ChainLink.value``): NaN wins over Inf."""

    NAN = "NaN"
    INF = "inf"


class SourceKind(Vocab):
    """What a user handed nbdebug as a step (:func:`nbdebug.core.snapshot.resolve_source`)."""

    TRACE = "trace"  # a recorded Trace (or a TraceError's partial trace)
    SNAPSHOT = "snapshot"  # a Snapshot, a snapshot file's path or a NonFiniteError
    DIRECTORY = "directory"  # a directory of snapshot files
    MODEL = "model"  # a model and its batch (or a (model, inputs[, target]) tuple)
