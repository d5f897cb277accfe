"""Corpus readers: one module per stored format, all behind the reader protocol of
:mod:`streampack.corpus.reader`; :func:`open_corpus` opens a manifest.

The cut of a corpus into windows lives in :mod:`streampack.windows`.
"""

from streampack.corpus.manifest import (
    MANIFEST_FORMAT,
    MANIFEST_VERSION,
    binding_spec,
    open_corpus,
    read_manifest,
)
from streampack.corpus.reader import (
    BindingSpec,
    RandomAccessReader,
    Reader,
    Record,
    SequentialReader,
)
from streampack.corpus.sources import FORMATS, open_source

__all__ = [
    "FORMATS",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "BindingSpec",
    "RandomAccessReader",
    "Reader",
    "Record",
    "SequentialReader",
    "binding_spec",
    "open_corpus",
    "open_source",
    "read_manifest",
]
