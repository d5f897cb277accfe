"""Token shards: pairs of NumPy files, memory-mapped.

A shard ``NAME`` is ``NAME.tokens.npy`` (int32, uint16 or uint32 tokens) and
``NAME.offsets.npy`` (int64 document boundaries: ``offsets[0] == 0``, never
decreasing, ``offsets[-1] == len(tokens)``), next to the manifest.

A masked shard also has ``NAME.mask.npy``: its supervision mask (rule C5; see
:mod:`streampack.corpus.masks`), bool or uint8, one value per token of
``NAME.tokens.npy``. A source is masked when its entry says ``"mask": true`` or, with
no ``mask`` key, when any of its shards has a mask file; then every shard must have
one, of its tokens' length. ``"mask": false`` ignores mask files (train every token).

Tokens of any other integer dtype, of either byte order (``>i4``, ``int64``, ``uint8``,
...), are read all the same: each window takes its values into its own array, in the
dtype tokens travel in, and the vocabulary screen judges the values. A dtype that
holds no token ids (floats, booleans, text, records) refuses the corpus at open,
naming the file and its dtype: a file-level problem gets a file-level answer, never a
quarantine of every document it holds.

A remote shard (a URL: :mod:`streampack.corpus.storage`) reads its ``.npy`` header
and its offsets whole when opened (the index, once), then only the byte ranges of the
documents each window holds (``storage.RemoteArray``: tokens and mask).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

from streampack.corpus.files import regular_file
from streampack.corpus.offsets import OffsetsReader, Part, check_offsets
from streampack.corpus.reader import BindingSpec
from streampack.corpus.storage import CorpusPath, RemoteArray, RemoteFile, Url, exists
from streampack.errors import InvalidConfig

MASK_DTYPES = {np.dtype(np.bool_), np.dtype(np.uint8)}


def _load(path: CorpusPath, what: str) -> Any:
    """The array in the ``.npy`` file at ``path``: memory-mapped, or a remote array."""
    regular_file(path, what)
    try:
        if isinstance(path, Url):
            return _remote_npy(RemoteFile(path, what))
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        size = RemoteFile(path).size if isinstance(path, Url) else path.stat().st_size
        problem = "is empty (0 bytes)" if size == 0 else f"is not a readable .npy file ({exc})"
        raise InvalidConfig(
            f"{what} {str(path)!r} {problem}; expected a NumPy array written by numpy.save"
        ) from exc


def _remote_npy(file: RemoteFile) -> RemoteArray:
    """A remote ``.npy`` file's array, from its header (the first block read)."""
    head = io.BytesIO(file.read(0, max(file.block, 1 << 12)))  # the first block
    version = np.lib.format.read_magic(head)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(head)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(head)
    if dtype.hasobject:
        raise ValueError("Object arrays cannot be loaded when allow_pickle=False")
    count = int(np.prod(shape)) if shape else 1
    if head.tell() + count * dtype.itemsize > file.size:
        raise ValueError(f"the file is truncated: its header describes {shape} {dtype}")
    array = RemoteArray(file, head.tell(), dtype, count)
    array.shape = tuple(shape)  # its ndim for the checks below; the data is read flat
    return array


def open_shard(root: CorpusPath, name: str, masked: bool = False) -> Part:
    """Memory-map shard ``name`` of the corpus in ``root`` (and its mask file when
    ``masked``) and check its offsets."""
    tokens = _load(root / f"{name}.tokens.npy", f"shard {name!r} tokens")
    offsets_path = root / f"{name}.offsets.npy"
    offsets = _load(offsets_path, f"shard {name!r} offsets")
    if offsets.ndim != 1 or offsets.dtype.kind not in "iu":
        raise InvalidConfig(
            f"shard {name!r}: offsets {str(offsets_path)!r} have dtype {offsets.dtype} and "
            f"shape {offsets.shape}; expected a 1-D int64 array"
        )
    if tokens.ndim != 1:
        raise InvalidConfig(f"shard {name!r}: tokens shape {tokens.shape}; expected 1-D")
    if tokens.dtype.kind not in "iu":
        raise InvalidConfig(
            f"shard {name!r}: tokens {str(root / f'{name}.tokens.npy')!r} have dtype "
            f"{tokens.dtype.str} ({tokens.dtype.name}); expected integer token ids: int32, "
            f"uint16 or uint32 (any integer dtype of either byte order is read)"
        )
    if isinstance(offsets, RemoteArray):
        offsets = offsets[:]  # the index: read once, whole
    check_offsets(offsets, len(tokens), f"shard {name!r} ({str(offsets_path)!r})")
    mask = _open_mask(root, name, len(tokens)) if masked else None
    return Part(name, tokens, offsets, mask=mask)


def mask_path(root: CorpusPath, name: str) -> CorpusPath:
    return root / f"{name}.mask.npy"


def _open_mask(root: CorpusPath, name: str, num_tokens: int) -> Any:
    """The mask file of shard ``name``, memory-mapped, or one line saying what is wrong."""
    path = mask_path(root, name)
    if not exists(path):
        raise InvalidConfig(
            f"shard {name!r} has no mask file {str(path)!r}, but its corpus is masked; "
            f"write one (bool or uint8, one value per token) for every shard, or set "
            f'"mask": false to train every token'
        )
    mask = _load(path, f"shard {name!r} mask")
    if mask.ndim != 1 or mask.dtype not in MASK_DTYPES or len(mask) != num_tokens:
        raise InvalidConfig(
            f"shard {name!r}: mask {str(path)!r} has dtype {mask.dtype} and shape "
            f"{mask.shape}; expected a 1-D bool or uint8 array of {num_tokens} values, "
            f"one per token of {name}.tokens.npy"
        )
    return mask


class TokenShardSource(OffsetsReader):
    """Token shards in manifest order (tokens of any integer dtype; see module)."""

    def __init__(
        self, root: CorpusPath, names: list[str], binding: BindingSpec, mask: bool | None = None
    ) -> None:
        # No "mask" key: the files say. A mask file is never ignored unless asked to be.
        masked = any(exists(mask_path(root, n)) for n in names) if mask is None else mask
        super().__init__(
            [open_shard(root, name, masked) for name in names],
            binding,
            f"token shards in {str(root)!r}",
        )
