"""A small float64 decoder that proves packing changes nothing a model can see.

The decoder exists to be run three ways on the same examples and compared:

* **separate** — every example alone, a one-row batch exactly as wide as its
  prediction length, positions ``0..L-1``, every key of its prefix allowed;
* **padded** — one example per row, right-padded to the longest;
* **packed** — a :class:`~streampack.batch.PackedBatch` as the packer produced it,
  several occurrences sharing a row, attention limited to each query's key range.

If the packer and the attention kernels keep the contract (rules C1–C7), the three
give the same logits on every loss-eligible cell, the same token-summed loss and the
same gradient for every parameter. The worked example's first row shows what the
packed run has to get right::

    column      0   1   2   3   4   5
    inputs      0  99 100   0 101  -1      A = [0,99,100,1] then B = [0,101,1]
    positions   0   1   2   0   1   0      rotary angles restart with B (C4)
    seg start   0   0   0   3   3  -1      B's queries see keys [3, q+1) only (C6)

Architecture (fixed, so any independent implementation can be compared with it)::

    h = embedding[inputs]                   PAD_CELL cells start at 0
    for each layer i:
        h += Attn(RMSNorm(h; layers.i.attn_norm))
        h += FFN(RMSNorm(h; layers.i.ffn_norm))
    logits = RMSNorm(h; final_norm) @ embedding.T          tied output

    RMSNorm(x; g) = x / sqrt(mean(x**2) + 1e-6) * g
    Attn(x)       = range_attention(rope(x@wq), rope(x@wk), x@wv) @ wo
    FFN(x)        = (silu(x @ w_gate) * (x @ w_up)) @ w_down

The rotary embedding uses local positions, base 10000 and the rotate-half
convention (first half and second half of each head). Scores are scaled by
``head_dim**-0.5``. Attention always goes through
:func:`streampack.kernels.attention.range_attention` and its backward, so the
equivalence tests are tests of those kernels too. There is no autograd framework:
the backward pass is written out below, layer by layer, and checked against finite
differences in the tests.

Besides the public methods (``forward_*``, ``loss_and_grad_*``), the module has an
internal API that ``streampack.auditing`` and the isolation tests build on, and that
this module owns: ``Cells`` (the layout every execution mode reduces to), the
``Decoder.cells_*`` builders, ``Decoder.evaluate``, ``Decoder.loss_and_logits``,
``Decoder.loss_and_backward`` (the full ``Trace``/``Backward`` record) and
``sum_parts``. None of it is exported from ``streampack``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .batch import PAD_CELL, PackedBatch
from .errors import BindingMismatch, InvalidConfig, InvalidExample
from .examples import Examples
from .kernels.attention import range_attention, range_attention_backward

_RMS_EPS = 1e-6
_ROPE_BASE = 10000.0


def _host(x: Any) -> np.ndarray:
    """Results of ``device="cuda"`` are device arrays; the decoder works on the host."""
    return x.copy_to_host() if hasattr(x, "copy_to_host") else x


def _range_attention(*args: Any, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
    out, lse = range_attention(*args, **kwargs)
    return _host(out), _host(lse)


def _range_attention_backward(
    *args: Any, **kwargs: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    dq, dk, dv = range_attention_backward(*args, **kwargs)
    return _host(dq), _host(dk), _host(dv)


# ---------------------------------------------------------------------------------------
# Configuration and parameters
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecoderConfig:
    """Shape of the reference decoder.

    Attributes:
        vocab_size: rows of the tied embedding; must match the batch binding.
        width: model width ``d``; a multiple of ``heads``.
        heads: attention heads; ``width // heads`` must be even for the rotate-half rotary.
        ff_width: hidden width of the gated feed-forward block.
        layers: decoder blocks.
        max_positions: longest prediction length the decoder accepts. It is a contract,
            not a table size: the audit crops longer examples to keep its cost bounded.
    """

    vocab_size: int
    width: int
    heads: int
    ff_width: int
    layers: int
    max_positions: int

    def __post_init__(self) -> None:
        for name in ("vocab_size", "width", "heads", "ff_width", "layers", "max_positions"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidConfig(
                    f"DecoderConfig.{name} must be a positive integer, got {value!r}"
                )
        if self.width % self.heads != 0:
            raise InvalidConfig(
                f"DecoderConfig.width={self.width} is not a multiple of heads={self.heads}; "
                f"accepted: width = heads * head_dim"
            )
        if (self.width // self.heads) % 2 != 0:
            raise InvalidConfig(
                f"DecoderConfig head_dim={self.width // self.heads} (width={self.width}, "
                f"heads={self.heads}) is odd; the rotate-half rotary needs an even head_dim"
            )

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @classmethod
    def small(cls, vocab_size: int = 266) -> DecoderConfig:
        """Width 4, 2 heads, feed-forward 4, 1 layer, prediction length up to 4."""
        return cls(vocab_size=vocab_size, width=4, heads=2, ff_width=4, layers=1, max_positions=4)

    @classmethod
    def large(cls, vocab_size: int = 266) -> DecoderConfig:
        """Width 8, 2 heads, feed-forward 16, 2 layers, prediction length up to 16."""
        return cls(vocab_size=vocab_size, width=8, heads=2, ff_width=16, layers=2, max_positions=16)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter name with its shape, in a fixed order."""
        d, f = self.width, self.ff_width
        shapes: dict[str, tuple[int, ...]] = {"embedding": (self.vocab_size, d)}
        for i in range(self.layers):
            p = f"layers.{i}."
            shapes[p + "attn_norm"] = (d,)
            for name in ("wq", "wk", "wv", "wo"):
                shapes[p + name] = (d, d)
            shapes[p + "ffn_norm"] = (d,)
            shapes[p + "w_gate"] = (d, f)
            shapes[p + "w_up"] = (d, f)
            shapes[p + "w_down"] = (f, d)
        shapes["final_norm"] = (d,)
        return shapes

    def parameter_count(self) -> int:
        return sum(math.prod(shape) for shape in self.parameter_shapes().values())


class LossAndGrad(NamedTuple):
    """Raw token-summed loss, the number of targets it sums, and d(loss_sum)/d(parameter)."""

    loss_sum: float
    count: int  # type: ignore[assignment]  # a field named like tuple.count, on purpose: the API's name
    grads: dict[str, np.ndarray]


# ---------------------------------------------------------------------------------------
# The cell layout every execution mode reduces to
# ---------------------------------------------------------------------------------------


@dataclass
class Cells:
    """Rows of cells with the metadata attention and loss need.

    ``segment_starts[r, q]`` and ``valid_lengths[r]`` are exactly what the kernels take:
    query ``q < valid_lengths[r]`` may use keys ``[segment_starts[r, q], q + 1)``.
    """

    inputs: np.ndarray  # int [R, C], PAD_CELL where no input
    targets: np.ndarray  # int [R, C], PAD_CELL where no target
    positions: np.ndarray  # int [R, C], local positions
    segment_starts: np.ndarray  # int32 [R, C]
    valid_lengths: np.ndarray  # int32 [R]
    eligible: np.ndarray  # bool [R, C], cells whose target enters the loss

    @property
    def shape(self) -> tuple[int, int]:
        return self.inputs.shape


@dataclass
class Trace:
    """What the forward pass keeps for the backward pass."""

    cells: Cells
    layers: list[dict[str, np.ndarray]]
    h_final: np.ndarray
    r_final: np.ndarray
    z_eligible: np.ndarray
    logits: np.ndarray  # [N, V], eligible cells only, row-major cell order
    cos: np.ndarray  # rotary tables [R, 1, C, head_dim // 2]
    sin: np.ndarray


@dataclass
class Backward:
    """Gradients of one backward pass.

    ``residual[i]`` is d(loss)/d(residual stream entering layer i) (``residual[0]`` is
    the embedding output, ``residual[layers]`` enters the final norm). ``attention[i]``
    holds the kernel's ``dq, dk, dv`` for layer i, layout [rows, heads, capacity, head_dim].
    """

    grads: dict[str, np.ndarray]
    residual: list[np.ndarray]
    attention: list[dict[str, np.ndarray]]


def _single_cells(selected: np.ndarray) -> Cells:
    """A one-row layout of one example's selected tokens, positions 0..L-1."""
    length = selected.size - 1
    return Cells(
        inputs=selected[None, :-1].copy(),
        targets=selected[None, 1:].copy(),
        positions=np.arange(length, dtype=np.int64)[None, :],
        segment_starts=np.zeros((1, length), dtype=np.int32),
        valid_lengths=np.array([length], dtype=np.int32),
        eligible=np.ones((1, length), dtype=bool),
    )


def sum_parts(parts: list[LossAndGrad]) -> LossAndGrad:
    """Loss sums, counts and gradients added up (separate execution of several examples)."""
    grads = {name: np.zeros_like(value) for name, value in parts[0].grads.items()}
    for part in parts:
        for name, value in part.grads.items():
            grads[name] += value
    return LossAndGrad(
        float(sum(part.loss_sum for part in parts)), sum(part.count for part in parts), grads
    )


def _rms_forward(x: np.ndarray, gain: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + _RMS_EPS)
    return x * r * gain, r


def _rms_backward(
    x: np.ndarray, r: np.ndarray, gain: np.ndarray, dy: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """d/dx and d/dgain of ``x * r * gain`` with ``r = (mean(x**2) + eps) ** -1/2``."""
    d_gain = np.sum((dy * x * r).reshape(-1, x.shape[-1]), axis=0)
    dn = dy * gain
    dx = r * dn - (r**3) * x * np.mean(dn * x, axis=-1, keepdims=True)
    return dx, d_gain


def _rope_tables(positions: np.ndarray, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of shape [R, 1, C, head_dim // 2] for the local positions."""
    half = head_dim // 2
    inv_freq = _ROPE_BASE ** (-np.arange(half, dtype=np.float64) * 2.0 / head_dim)
    angles = positions.astype(np.float64)[:, None, :, None] * inv_freq
    return np.cos(angles), np.sin(angles)


def _rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _rope_backward(dy: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """The rotation is orthogonal, so its backward is the inverse rotation."""
    half = dy.shape[-1] // 2
    d1, d2 = dy[..., :half], dy[..., half:]
    return np.concatenate([d1 * cos + d2 * sin, d2 * cos - d1 * sin], axis=-1)


def _split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    rows, cap, width = x.shape
    return np.ascontiguousarray(x.reshape(rows, cap, heads, width // heads).transpose(0, 2, 1, 3))


def _merge_heads(x: np.ndarray) -> np.ndarray:
    rows, heads, cap, head_dim = x.shape
    return x.transpose(0, 2, 1, 3).reshape(rows, cap, heads * head_dim)


def _flat(x: np.ndarray) -> np.ndarray:
    return x.reshape(-1, x.shape[-1])


def _nll_sum_and_grad(logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
    """Summed NLL over rows of ``logits`` [N, V] and its gradient ``softmax - onehot``.

    Works in one scratch array the size of ``logits`` (it becomes the gradient), so a
    large vocabulary costs two [N, V] arrays, not four.
    """
    rows = np.arange(logits.shape[0])
    grad = logits - logits.max(axis=1, keepdims=True)
    gold = grad[rows, targets]
    np.exp(grad, out=grad)
    total = grad.sum(axis=1, keepdims=True)
    nll = np.log(total[:, 0]) - gold
    grad /= total
    grad[rows, targets] -= 1.0
    return float(nll.sum()), grad


# ---------------------------------------------------------------------------------------
# The decoder
# ---------------------------------------------------------------------------------------


class Decoder:
    """The reference decoder: plain float64 NumPy around the range-aware kernels."""

    def __init__(self, config: DecoderConfig, params: dict[str, np.ndarray]) -> None:
        self.config = config
        self._params = params

    # -- construction ---------------------------------------------------------------

    @classmethod
    def init(cls, config: DecoderConfig, seed: int) -> Decoder:
        """Untrained, seed-fixed parameters.

        The scales keep activations, logits and gradients of order one, so that the
        equivalence tolerance (1e-10 absolute) cannot hide a real difference; the
        norm gains are jittered around 1 so their gradients are not all alike.
        """
        rng = np.random.default_rng(seed)
        params: dict[str, np.ndarray] = {}
        for name, shape in config.parameter_shapes().items():
            if name == "embedding":
                # 1/sqrt(width) keeps the tied output logits of order one.
                params[name] = rng.normal(0.0, 1.0 / math.sqrt(config.width), size=shape)
            elif name.endswith("norm"):
                params[name] = 1.0 + 0.1 * rng.normal(size=shape)
            else:
                params[name] = rng.normal(0.0, 1.0 / math.sqrt(shape[0]), size=shape)
        return cls(config, params)

    @classmethod
    def from_parameters(cls, config: DecoderConfig, params: dict[str, np.ndarray]) -> Decoder:
        """A decoder over copies of ``params``; names and shapes must match the config."""
        shapes = config.parameter_shapes()
        missing = sorted(set(shapes) - set(params))
        extra = sorted(set(params) - set(shapes))
        if missing or extra:
            raise InvalidConfig(
                f"parameters do not match the config: missing {missing}, unexpected {extra}; "
                f"accepted names: {list(shapes)}"
            )
        copied: dict[str, np.ndarray] = {}
        for name, shape in shapes.items():
            value = np.array(params[name], dtype=np.float64, copy=True)
            if value.shape != shape:
                raise InvalidConfig(
                    f"parameter {name!r} has shape {value.shape}; accepted: {shape}"
                )
            if not np.all(np.isfinite(value)):
                raise InvalidConfig(f"parameter {name!r} holds non-finite values")
            copied[name] = value
        return cls(config, copied)

    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the parameters, by name, in the config's fixed order."""
        return {name: value.copy() for name, value in self._params.items()}

    # -- public forward passes ------------------------------------------------------

    def forward_packed(self, batch: PackedBatch, device: str = "cpu") -> np.ndarray:
        """Logits ``[rows, capacity, V]``; every cell that is not loss-eligible is NaN.

        The NaN is deliberate: a loss that reads an ineligible cell fails loudly.
        """
        cells = self.cells_from_batch(batch)
        trace = self._forward(cells, device=device)
        return self._scatter(cells, trace)

    def forward_separate(self, examples: Examples, device: str = "cpu") -> list[np.ndarray]:
        """One ``[prediction_length, V]`` array per example, each run alone."""
        out = []
        for cells in self.cells_separate(examples):
            trace = self._forward(cells, device=device)
            out.append(self._scatter(cells, trace)[0])
        return out

    def forward_padded(self, examples: Examples, device: str = "cpu") -> np.ndarray:
        """Logits ``[examples, max_length, V]``, one example per row, NaN on padding."""
        cells = self.cells_padded(examples)
        return self._scatter(cells, self._forward(cells, device=device))

    def loss_and_grad_packed(self, batch: PackedBatch, device: str = "cpu") -> LossAndGrad:
        """Raw NLL sum over the batch's loss-eligible cells, their count, d(sum)/d(params).

        A sum, not the token mean of rule C7, so that it can be compared with the sum
        of the examples' separate losses; divide both by ``count`` for the mean.
        """
        return self._loss_and_grad(self.cells_from_batch(batch), device=device)

    def loss_and_grad_separate(self, examples: Examples, device: str = "cpu") -> LossAndGrad:
        """Sum of every example's own loss and gradient, each computed alone."""
        return self._sum_loss_and_grad(self.cells_separate(examples), device=device)

    def loss_and_grad_padded(self, examples: Examples, device: str = "cpu") -> LossAndGrad:
        """As :meth:`loss_and_grad_packed`, one example per right-padded row."""
        return self._loss_and_grad(self.cells_padded(examples), device=device)

    # -- layouts (internal API: cells_separate, cells_padded, cells_from_batch) -------

    def _check_tokens(self, tokens: np.ndarray, what: str) -> None:
        real = tokens[tokens != PAD_CELL]
        if real.size and (real.min() < 0 or real.max() >= self.config.vocab_size):
            bad = int(real[(real < 0) | (real >= self.config.vocab_size)][0])
            raise InvalidExample(
                f"{what} holds token {bad}, outside the decoder vocabulary "
                f"[0, {self.config.vocab_size})"
            )

    def _check_length(self, length: int, what: str) -> None:
        if length < 1:
            raise InvalidExample(f"{what} has prediction length {length}; accepted: >= 1")
        if length > self.config.max_positions:
            raise InvalidExample(
                f"{what} has prediction length {length}, longer than the decoder's "
                f"max_positions={self.config.max_positions}; crop it or use a larger profile"
            )

    def _example_sequences(self, examples: Examples) -> list[np.ndarray]:
        sequences = []
        for i in range(len(examples)):
            selected = np.asarray(examples.example_tokens(i), dtype=np.int64)
            what = examples.describe(i)
            self._check_length(selected.size - 1, what)
            self._check_tokens(selected, what)
            sequences.append(selected)
        return sequences

    def cells_separate(self, examples: Examples) -> list[Cells]:
        """One single-row layout per example, exactly as wide as its prediction length."""
        return [_single_cells(selected) for selected in self._example_sequences(examples)]

    def cells_padded(self, examples: Examples) -> Cells:
        """One example per row from column 0, right-padded to the longest."""
        sequences = self._example_sequences(examples)
        if not sequences:
            raise InvalidExample("no examples to run; accepted: at least one example")
        lengths = np.array([s.size - 1 for s in sequences], dtype=np.int32)
        rows, cap = len(sequences), int(lengths.max())
        inputs = np.full((rows, cap), PAD_CELL, dtype=np.int64)
        targets = np.full((rows, cap), PAD_CELL, dtype=np.int64)
        for r, selected in enumerate(sequences):
            inputs[r, : lengths[r]] = selected[:-1]
            targets[r, : lengths[r]] = selected[1:]
        valid = np.arange(cap)[None, :] < lengths[:, None]
        return Cells(
            inputs=inputs,
            targets=targets,
            positions=np.where(valid, np.arange(cap)[None, :], 0),
            segment_starts=np.where(valid, 0, -1).astype(np.int32),
            valid_lengths=lengths,
            eligible=valid,
        )

    def cells_from_batch(self, batch: PackedBatch) -> Cells:
        """The batch's own arrays, unchanged, so any layout mistake reaches the results."""
        if batch.binding.vocab_size != self.config.vocab_size:
            raise BindingMismatch(
                f"batch vocabulary size {batch.binding.vocab_size} differs from the "
                f"decoder's vocab_size={self.config.vocab_size}; build the decoder with "
                f"DecoderConfig(vocab_size={batch.binding.vocab_size}, ...)"
            )
        occ = batch.occurrences
        if len(occ):
            lengths = occ["stop"] - occ["start"]
            too_long = np.flatnonzero(lengths > self.config.max_positions)
            if too_long.size:
                i = int(too_long[0])
                self._check_length(
                    int(lengths[i]),
                    f"occurrence {int(occ['ordinal'][i])} (example_id {int(occ['example_id'][i])})",
                )
        inputs = np.asarray(batch.inputs, dtype=np.int64)
        self._check_tokens(inputs, "batch inputs")
        eligible = np.asarray(batch.loss_mask, dtype=bool)
        targets = np.asarray(batch.targets, dtype=np.int64)
        self._check_tokens(np.where(eligible, targets, PAD_CELL), "batch targets")
        return Cells(
            inputs=inputs,
            targets=targets,
            positions=np.asarray(batch.positions, dtype=np.int64),
            segment_starts=np.ascontiguousarray(batch.segment_starts, dtype=np.int32),
            valid_lengths=np.ascontiguousarray(batch.valid_lengths, dtype=np.int32),
            eligible=eligible,
        )

    def _scatter(self, cells: Cells, trace: Trace) -> np.ndarray:
        rows, cap = cells.shape
        out = np.full((rows, cap, self.config.vocab_size), np.nan)
        out[cells.eligible] = trace.logits
        return out

    # -- forward ----------------------------------------------------------------------

    def _forward(
        self,
        cells: Cells,
        *,
        device: str = "cpu",
        causal_prefix: bool | frozenset[int] = False,
        perturb: dict[int, np.ndarray] | None = None,
    ) -> Trace:
        """Run the decoder over ``cells``; logits only on loss-eligible cells.

        ``causal_prefix`` and ``perturb`` exist for the isolation tests only.
        ``causal_prefix`` (True, or a set of layer indices) widens every active query's
        range to the whole causal prefix of its row, as an ordinary causal mask would —
        the tests show that this breaks equivalence, i.e. that the range guard is what
        keeps examples apart. ``perturb[i]`` is added to the residual stream entering
        layer ``i``.
        """
        cfg = self.config
        p = self._params
        rows, cap = cells.shape
        layers: list[dict[str, np.ndarray]] = []
        in_row = cells.inputs != PAD_CELL
        h = np.zeros((rows, cap, cfg.width))
        h[in_row] = p["embedding"][cells.inputs[in_row]]
        cos, sin = _rope_tables(cells.positions, cfg.head_dim)
        scale = cfg.head_dim**-0.5
        active = np.arange(cap)[None, :] < cells.valid_lengths[:, None]
        for i in range(cfg.layers):
            pre = f"layers.{i}."
            if perturb and i in perturb:
                h = h + perturb[i]
            rec: dict[str, np.ndarray] = {"h_in": h}
            a, rec["r_attn"] = _rms_forward(h, p[pre + "attn_norm"])
            q = _rope(_split_heads(a @ p[pre + "wq"], cfg.heads), cos, sin)
            k = _rope(_split_heads(a @ p[pre + "wk"], cfg.heads), cos, sin)
            v = _split_heads(a @ p[pre + "wv"], cfg.heads)
            widen = causal_prefix is True or (
                isinstance(causal_prefix, frozenset) and i in causal_prefix
            )
            starts = cells.segment_starts
            if widen:
                starts = np.where(active, 0, cells.segment_starts).astype(np.int32)
            out, lse = _range_attention(
                q, k, v, starts, cells.valid_lengths, scale=scale, device=device
            )
            o = _merge_heads(out)
            h = h + o @ p[pre + "wo"]
            rec.update(a=a, q=q, k=k, v=v, out=out, lse=lse, o=o, starts=starts, h_mid=h)
            b, rec["r_ffn"] = _rms_forward(h, p[pre + "ffn_norm"])
            gate = b @ p[pre + "w_gate"]
            up = b @ p[pre + "w_up"]
            sig = 1.0 / (1.0 + np.exp(-gate))
            act = gate * sig
            m = act * up
            h = h + m @ p[pre + "w_down"]
            rec.update(b=b, gate=gate, up=up, sig=sig, act=act, m=m)
            layers.append(rec)
        if perturb and cfg.layers in perturb:
            h = h + perturb[cfg.layers]
        z, r_final = _rms_forward(h, p["final_norm"])
        z_eligible = z[cells.eligible]
        return Trace(
            cells=cells,
            layers=layers,
            h_final=h,
            r_final=r_final,
            z_eligible=z_eligible,
            logits=z_eligible @ p["embedding"].T,
            cos=cos,
            sin=sin,
        )

    # -- backward ---------------------------------------------------------------------

    def _backward(self, trace: Trace, d_logits: np.ndarray, *, device: str = "cpu") -> Backward:
        """Hand-written reverse pass; ``d_logits`` is [N, V] over the eligible cells."""
        cfg = self.config
        p = self._params
        cells = trace.cells
        rows, cap = cells.shape
        cos, sin = trace.cos, trace.sin
        scale = cfg.head_dim**-0.5
        grads: dict[str, np.ndarray] = {}
        d_embedding = d_logits.T @ trace.z_eligible
        dz = np.zeros((rows, cap, cfg.width))
        dz[cells.eligible] = d_logits @ p["embedding"]
        dh, grads["final_norm"] = _rms_backward(trace.h_final, trace.r_final, p["final_norm"], dz)
        residual = [dh]
        attention: list[dict[str, np.ndarray]] = []
        for i in reversed(range(cfg.layers)):
            pre = f"layers.{i}."
            rec = trace.layers[i]
            # feed-forward: h_out = h_mid + m @ w_down
            dm = dh @ p[pre + "w_down"].T
            grads[pre + "w_down"] = _flat(rec["m"]).T @ _flat(dh)
            d_up = dm * rec["act"]
            d_act = dm * rec["up"]
            sig = rec["sig"]
            d_gate = d_act * sig * (1.0 + rec["gate"] * (1.0 - sig))
            grads[pre + "w_gate"] = _flat(rec["b"]).T @ _flat(d_gate)
            grads[pre + "w_up"] = _flat(rec["b"]).T @ _flat(d_up)
            db = d_gate @ p[pre + "w_gate"].T + d_up @ p[pre + "w_up"].T
            dx, grads[pre + "ffn_norm"] = _rms_backward(
                rec["h_mid"], rec["r_ffn"], p[pre + "ffn_norm"], db
            )
            dh = dh + dx
            # attention: h_mid = h_in + o @ wo
            grads[pre + "wo"] = _flat(rec["o"]).T @ _flat(dh)
            d_out = _split_heads(dh @ p[pre + "wo"].T, cfg.heads)
            dq, dk, dv = _range_attention_backward(
                rec["q"],
                rec["k"],
                rec["v"],
                rec["out"],
                rec["lse"],
                d_out,
                rec["starts"],
                cells.valid_lengths,
                scale=scale,
                device=device,
            )
            attention.append({"dq": dq, "dk": dk, "dv": dv})
            dq_lin = _merge_heads(_rope_backward(dq, cos, sin))
            dk_lin = _merge_heads(_rope_backward(dk, cos, sin))
            dv_lin = _merge_heads(dv)
            a = _flat(rec["a"])
            grads[pre + "wq"] = a.T @ _flat(dq_lin)
            grads[pre + "wk"] = a.T @ _flat(dk_lin)
            grads[pre + "wv"] = a.T @ _flat(dv_lin)
            da = dq_lin @ p[pre + "wq"].T + dk_lin @ p[pre + "wk"].T + dv_lin @ p[pre + "wv"].T
            dx, grads[pre + "attn_norm"] = _rms_backward(
                rec["h_in"], rec["r_attn"], p[pre + "attn_norm"], da
            )
            dh = dh + dx
            residual.append(dh)
        in_row = cells.inputs != PAD_CELL
        np.add.at(d_embedding, cells.inputs[in_row], dh[in_row])
        grads["embedding"] = d_embedding
        residual.reverse()
        attention.reverse()
        ordered = {name: grads[name] for name in cfg.parameter_shapes()}
        return Backward(grads=ordered, residual=residual, attention=attention)

    def _sum_loss_and_grad(self, layouts: list[Cells], *, device: str = "cpu") -> LossAndGrad:
        return sum_parts([self._loss_and_grad(cells, device=device) for cells in layouts])

    # -- running cells (internal API: evaluate, loss_and_logits, loss_and_backward) ----

    def evaluate(
        self, cells: Cells, *, device: str = "cpu", **forward: Any
    ) -> tuple[np.ndarray, LossAndGrad]:
        """Logits (NaN off the loss mask) and loss with gradients, from one forward pass."""
        loss, count, back, trace = self.loss_and_backward(cells, device=device, **forward)
        return self._scatter(cells, trace), LossAndGrad(loss, count, back.grads)

    def loss_and_logits(
        self, cells: Cells, *, device: str = "cpu"
    ) -> tuple[LossAndGrad, np.ndarray]:
        """Loss with gradients, and the logits of the eligible cells only ([N, V] in
        row-major cell order: no [rows, capacity, V] array for a large vocabulary)."""
        loss, count, back, trace = self.loss_and_backward(cells, device=device)
        return LossAndGrad(loss, count, back.grads), trace.logits

    def _loss_and_grad(self, cells: Cells, *, device: str = "cpu", **forward: Any) -> LossAndGrad:
        loss, count, back, _ = self.loss_and_backward(cells, device=device, **forward)
        return LossAndGrad(loss, count, back.grads)

    def loss_and_backward(
        self, cells: Cells, *, device: str = "cpu", **forward: Any
    ) -> tuple[float, int, Backward, Trace]:
        """Raw loss sum over eligible cells, with the full backward record."""
        trace = self._forward(cells, device=device, **forward)
        targets = cells.targets[cells.eligible]
        loss, d_logits = _nll_sum_and_grad(trace.logits, targets)
        back = self._backward(trace, d_logits, device=device)
        return loss, int(targets.size), back, trace
