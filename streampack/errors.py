"""The error hierarchy.

Every mistake a caller can make raises a subclass of :class:`StreampackError`; the
ones about bad values are also :class:`ValueError` so ordinary ``except ValueError``
code keeps working. A broken internal invariant is an :class:`InternalError`: it means
streampack has a bug, never that the input was wrong.
"""

from __future__ import annotations


class StreampackError(Exception):
    """Base class of every error streampack raises on purpose."""


class InvalidConfig(StreampackError, ValueError):
    """A configuration field is out of its accepted range."""


class InvalidExample(StreampackError, ValueError):
    """An example (document, range or token) breaks rule C1 or the vocabulary."""


class OversizedExample(InvalidExample):
    """An example has more prediction pairs than one row holds (rule C2)."""


class CapacityError(StreampackError, ValueError):
    """A batch would hold more cells than ``max_cells`` allows (rule C8)."""


class MetadataBudgetError(StreampackError, ValueError):
    """A pack call would hold more bytes than ``max_metadata_bytes`` (rule C8)."""


class BindingMismatch(StreampackError, ValueError):
    """A batch carries another binding than the one its consumer expects (rule C9)."""


class EmptyObjective(StreampackError, ValueError):
    """A loss was asked for over zero loss-eligible targets (rule C7)."""


class InvalidArray(StreampackError, ValueError):
    """An array handed to a kernel has the wrong shape, dtype, layout or values."""


class ProtocolError(StreampackError, ValueError):
    """A wire message is malformed, too large, or of an unknown version or kind."""


class InternalError(StreampackError, RuntimeError):
    """A streampack invariant broke. This is a bug in streampack; please report it."""


class InvalidCoordinate(StreampackError, IndexError):
    """A (row, query, key) coordinate lies outside the batch it addresses."""


class ResumeError(StreampackError, ValueError):
    """A saved cursor a stream cannot continue from (see ``streampack.client.resume_cursor``)."""


class StreamTimeout(StreampackError, TimeoutError):
    """No answer from the producer within a ``BatchStream``'s timeout."""


class CorpusUnavailable(InvalidConfig):
    """A corpus file cannot be read from its store: it does not exist (``missing``), access
    is denied, the store did not answer after every retry, or the object changed after
    it was opened (another ETag: refused, never mixed into the stream)."""

    def __init__(self, message: str, *, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing
