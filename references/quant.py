"""Weight-only quantizers (plain PyTorch): INT8 per output channel, INT4 group-wise with zero points.

A weight is ``w`` of shape (N, K), the ``nn.Linear`` layout: N output features, K input features.

INT8 (``bits=8``), symmetric per output channel::

    scale[n] = max_k |w[n, k]| / 127            float32, shape (N,)
    q[n, k]  = clamp(round(w[n, k] / scale[n]), -127, 127)      int8, shape (N, K)
    w ≈ q * scale[n]

INT4 (``bits=4``), asymmetric per group of ``group_size`` consecutive k (32, 64 or 128)::

    lo = min(w_group, 0), hi = max(w_group, 0)
    scale = bf16((hi − lo) / 15)                bfloat16, shape (N, K // group_size)
    zero  = clamp(round(−lo / scale), 0, 15)    uint8,    shape (N, K // group_size)
    q     = clamp(round(w / scale) + zero, 0, 15)
    w ≈ (q − zero) * scale

  Scales are stored in bfloat16 (fp32 range, half the bytes of fp32: for (8192, 28672) at g=128 they
  are 3.7 MB next to 117 MB of codes); codes are computed from the stored (rounded) scale, so the
  weight a kernel reconstructs is exactly ``dequantize()``, and (q − z) · s is exact in float32.

  Scale and zero point of one (row, group) share a 32-bit word (``pack_scale_zero``): byte 0 the zero
  point, byte 1 zero, bytes 2-3 the bf16 scale, so the word masked to its high half is the scale as a
  float32 and masked to its low byte the zero point. The words are group-major, (K // g, N) int32, and
  ``scales`` and ``zeros`` are (N, K // g) strided views into them. Why: a kernel's per-group load of a
  tile's scales and zero points is then one 4-byte load per row, which Triton's software pipeliner
  stages with cp.async (it takes loads of 4 bytes and more a thread); a 2-byte scale and a 1-byte zero
  point were plain loads waited on inside the loop (docs/findings.md).

INT4 packing: two codes per byte, split by half-groups. In group ``j`` (columns ``j*g .. j*g + g - 1``,
h = g/2) byte ``i`` of row ``n``'s group holds::

    low nibble  = q[n, j*g + i]          (first half of the group)
    high nibble = q[n, j*g + h + i]      (second half of the group),   0 <= i < h

``pack_int4`` gives these bytes row-major, (N, K // 2): byte i of group j of row n at [n, j*h + i].
A QuantizedWeight stores them in *panels* of R = PANEL_ROWS rows (``to_panels``): ``data`` is uint8 of
shape (ceil(N / R), K // g, R, h), byte i of group j of row n at [n // R, j, n % R, i] (rows past N are
zero padding). Scales and zero points are (N, K // g) views of group-major (K // g, N) 32-bit words.

Why half-groups: a kernel that loads a (rows × h) block of bytes of one group gets two (rows × h) code
blocks whose activations are two *contiguous* slices of x (x[j*g : j*g+h] and x[j*g+h : (j+1)*g]);
nothing needs interleaving, x loads stay 16-byte vectors, and each half feeds a tl.dot of depth h >= 16
directly. Why panels: a kernel tile of R rows reads one contiguous R·h-byte block per group (4 KiB at
g = 128) instead of R pieces of h bytes a row apart, and its R scales (zero points) are one contiguous
load (faster at M = 1 in the same tile and config; docs/findings.md).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

INT4_GROUP_SIZES = (32, 64, 128)


def group_for(K: int, group_size: int) -> int | None:
    """The INT4 group of a K-wide weight asked for ``group_size``: the largest supported size no larger that
    divides K (a narrow linear takes a smaller group), or None when none does."""
    return next((g for g in sorted(INT4_GROUP_SIZES, reverse=True) if g <= group_size and K % g == 0), None)
INT8_QMAX = 127
INT4_QMAX = 15
PANEL_ROWS = 64  # int4 rows per panel (module docstring)


@dataclass
class QuantizedWeight:
    """A quantized (N, K) weight. ``dequantize()`` is the exact weight the kernel multiplies by."""
    bits: int                            # 8 or 4
    N: int                               # output features
    K: int                               # input features
    group_size: int                      # int4: 32 | 64 | 128; int8: K (one group per output channel)
    data: torch.Tensor                   # int8 (N, K) | uint8 (ceil(N/R), K // g, R, g // 2): int4 panels
    scales: torch.Tensor                 # float32 (N,) | bfloat16 (N, K // g), group-major storage
    zeros: torch.Tensor | None = None    # int4 only: uint8 (N, K // g), values 0..15, group-major storage

    # -- structure ----------------------------------------------------------------------------
    @property
    def n_groups(self) -> int:
        return self.K // self.group_size

    @property
    def device(self) -> torch.device:
        return self.data.device

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scales, self.zeros) if t is not None]

    def nbytes(self) -> int:
        words = sz_words(self)
        if words is not None:
            return self.data.numel() + 4 * words.numel()
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def to(self, device) -> "QuantizedWeight":
        words = sz_words(self)
        if words is not None:  # keep scales and zero points views of one set of words
            scales, zeros = scale_zero_views(words.to(device))
            return replace(self, data=self.data.to(device), scales=scales, zeros=zeros)
        return replace(self, data=self.data.to(device), scales=self.scales.to(device),
                       zeros=None if self.zeros is None else self.zeros.to(device))

    def validate(self) -> None:
        """Raise ValueError/TypeError (naming ``qw``) unless the fields are one consistent weight."""
        if self.bits not in (4, 8):
            raise ValueError(f"qw: bits must be 8 or 4, got {self.bits!r}")
        for name in ("N", "K", "group_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "N" else 1):
                raise ValueError(f"qw: {name} must be a positive int, got {v!r}")
        if self.K % self.group_size:
            raise ValueError(f"qw: K={self.K} is not a multiple of group_size={self.group_size}")
        for name in ("data", "scales"):
            if not isinstance(getattr(self, name), torch.Tensor):
                raise TypeError(f"qw.{name}: expected a torch.Tensor, got {type(getattr(self, name)).__name__}")
        if self.bits == 8:
            if self.group_size != self.K:
                raise ValueError(f"qw: int8 is per output channel: group_size must equal K={self.K}, "
                                 f"got {self.group_size}")
            _expect(self.data, "qw.data", (self.N, self.K), torch.int8)
            _expect(self.scales, "qw.scales", (self.N,), torch.float32)
            if self.zeros is not None:
                raise ValueError("qw.zeros: int8 is symmetric and has no zero points (expected None)")
        else:
            if self.group_size not in INT4_GROUP_SIZES:
                raise ValueError(f"qw: int4 group_size must be one of {INT4_GROUP_SIZES}, got {self.group_size}")
            _expect(self.data, "qw.data", panel_shape(self.N, self.K, self.group_size), torch.uint8)
            if not isinstance(self.zeros, torch.Tensor):
                raise TypeError("qw.zeros: int4 needs a uint8 tensor of zero points, got "
                                f"{type(self.zeros).__name__}")
            words = sz_words(self) is not None  # packed words: neither view is dense, both are fine
            _expect(self.scales, "qw.scales", (self.N, self.n_groups), torch.bfloat16, either_major=True, words=words)
            _expect(self.zeros, "qw.zeros", (self.N, self.n_groups), torch.uint8, either_major=True, words=words)
        for t, name in ((self.scales, "scales"), (self.zeros, "zeros")):
            if t is not None and t.device != self.data.device:
                raise ValueError(f"qw.{name}: on {t.device}, but qw.data is on {self.data.device}")

    # -- values -------------------------------------------------------------------------------
    def codes(self) -> torch.Tensor:
        """The integer codes, (N, K): int8 in [-127, 127] or uint8 in [0, 15] (unpacked)."""
        return self.data if self.bits == 8 else unpack_int4(from_panels(self.data, self.N), self.group_size)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized weight (N, K) in ``dtype``.

        float64 is exact for both formats. float32 is exact for int4 ((q − z) has 5 bits, a bf16 scale
        8) but rounds int8's q · scale once (7 + 24 bits). References use float64.
        """
        if self.bits == 8:
            return self.data.to(dtype) * self.scales.to(dtype)[:, None]
        q = self.codes().to(dtype).view(self.N, self.n_groups, self.group_size)
        z = self.zeros.to(dtype)[:, :, None]
        s = self.scales.to(dtype)[:, :, None]
        return ((q - z) * s).reshape(self.N, self.K)


def _expect(t: torch.Tensor, name: str, shape: tuple, dtype: torch.dtype, either_major: bool = False,
            words: bool = False) -> None:
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {str(dtype).replace('torch.', '')}, got "
                        f"{str(t.dtype).replace('torch.', '')}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if words:  # a view into pack_scale_zero's words (checked by sz_words)
        return
    if either_major:  # (N, G): row-major, or a transposed view of (G, N) storage
        if not (t.is_contiguous() or t.t().is_contiguous()):
            raise ValueError(f"{name}: expected a contiguous tensor, a transposed view of one, or a view "
                             "into pack_scale_zero's words")
    elif not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor")


def panel_shape(N: int, K: int, group_size: int, rows: int = PANEL_ROWS) -> tuple:
    """Shape of int4 ``data`` in panels: (ceil(N / rows), K // group_size, rows, group_size // 2)."""
    return (-(-N // rows), K // group_size, rows, group_size // 2)


def to_panels(packed: torch.Tensor, group_size: int, rows: int = PANEL_ROWS) -> torch.Tensor:
    """Row-major packed bytes (N, K // 2) -> panels (ceil(N / rows), K // g, rows, g // 2), zero-padded."""
    N, half = packed.shape
    h = group_size // 2
    if half % h:
        raise ValueError(f"packed: {half} bytes per row is not a whole number of groups of {group_size}")
    P = -(-N // rows)
    if P * rows != N:
        packed = torch.cat((packed, packed.new_zeros(P * rows - N, half)))
    return packed.view(P, rows, half // h, h).permute(0, 2, 1, 3).contiguous()


def from_panels(panels: torch.Tensor, N: int) -> torch.Tensor:
    """Inverse of :func:`to_panels`: (P, G, rows, h) -> row-major (N, G·h)."""
    P, G, rows, h = panels.shape
    return panels.permute(0, 2, 1, 3).reshape(P * rows, G * h)[:N]


def pack_scale_zero(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """(N, G) bf16 scales and uint8 zero points -> (G, N) int32 words: zero | bf16 bits << 16."""
    if scales.dtype != torch.bfloat16 or zeros.dtype != torch.uint8 or scales.shape != zeros.shape:
        raise TypeError("pack_scale_zero: expected bf16 scales and uint8 zero points of one (N, G) shape")
    bits = scales.t().contiguous().view(torch.int16).to(torch.int32)
    return ((bits << 16) | zeros.t().to(torch.int32)).contiguous()


def scale_zero_views(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(G, N) int32 words -> ((N, G) bf16 scales, (N, G) uint8 zero points), views into the words."""
    G, N = words.shape
    scales = words.view(torch.bfloat16).view(G, N, 2)[:, :, 1].t()
    zeros = words.view(torch.uint8).view(G, N, 4)[:, :, 0].t()
    return scales, zeros


def sz_words(qw: "QuantizedWeight") -> torch.Tensor | None:
    """The (G, N) int32 words that ``qw``'s scales and zero points are views into, or None when they
    are tensors of their own."""
    s, z = qw.scales, qw.zeros
    if qw.bits != 4 or not isinstance(s, torch.Tensor) or not isinstance(z, torch.Tensor):
        return None
    if s.dtype != torch.bfloat16 or z.dtype != torch.uint8 or s.dim() != 2 or s.shape != z.shape:
        return None
    N, G = z.shape
    if (z.stride() != (4, 4 * N) or s.stride() != (2, 2 * N) or s.data_ptr() != z.data_ptr() + 2
            or z.storage_offset() % 4 or s.untyped_storage().data_ptr() != z.untyped_storage().data_ptr()):
        return None
    return torch.empty(0, dtype=torch.int32, device=z.device).set_(
        z.untyped_storage(), z.storage_offset() // 4, (G, N), (N, 1))


# ---------------------------------------------------------------------------------------------------
# INT4 packing
# ---------------------------------------------------------------------------------------------------
def pack_int4(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N, K) codes in [0, 15] -> (N, K // 2) uint8 in the half-group layout (module docstring)."""
    N, K = q.shape
    if K % group_size or group_size % 2:
        raise ValueError(f"q: K={K} is not a multiple of group_size={group_size}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > INT4_QMAX):
        raise ValueError("q: int4 codes must lie in [0, 15]")
    g = q.to(torch.uint8).view(N, K // group_size, 2, group_size // 2)
    return (g[:, :, 0, :] | (g[:, :, 1, :] << 4)).reshape(N, K // 2).contiguous()


def unpack_int4(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: (N, K // 2) uint8 -> (N, K) uint8 codes."""
    N, half = packed.shape
    h = group_size // 2
    if half % h:
        raise ValueError(f"packed: {half} bytes per row is not a whole number of groups of {group_size}")
    p = packed.view(N, half // h, 1, h)
    return torch.cat((p & 0xF, p >> 4), dim=2).reshape(N, 2 * half)


# ---------------------------------------------------------------------------------------------------
# Quantizers
# ---------------------------------------------------------------------------------------------------
def _check_weight(w) -> None:
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"w: expected a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise ValueError(f"w: expected a 2-D (N, K) weight, got shape {tuple(w.shape)}")
    if not w.is_floating_point():
        raise TypeError(f"w: expected a floating-point weight, got {w.dtype}")
    if w.shape[1] == 0:
        raise ValueError("w: K = 0")
    if not torch.isfinite(w).all():
        raise ValueError("w: contains NaN or inf")


def quantize_int8(w: torch.Tensor) -> QuantizedWeight:
    """Symmetric per-output-channel INT8: scale = absmax / 127 (float32), codes in [-127, 127]."""
    _check_weight(w)
    N, K = w.shape
    w32 = w.detach().to(torch.float32)
    absmax = w32.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / INT8_QMAX, torch.ones_like(absmax))
    q = torch.clamp(torch.round(w32 / scale[:, None]), -INT8_QMAX, INT8_QMAX).to(torch.int8)
    return QuantizedWeight(8, N, K, K, q.contiguous(), scale.contiguous(), None)


def quantize_int4(w: torch.Tensor, group_size: int = 128) -> QuantizedWeight:
    """Asymmetric group-wise INT4 with bf16 scales and uint8 zero points, packed (module docstring)."""
    _check_weight(w)
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size: expected one of {INT4_GROUP_SIZES}, got {group_size!r}")
    N, K = w.shape
    if K % group_size:
        raise ValueError(f"w: K={K} is not a multiple of group_size={group_size}")
    wg = w.detach().to(torch.float32).view(N, K // group_size, group_size)
    lo = wg.amin(dim=2).clamp(max=0.0)
    hi = wg.amax(dim=2).clamp(min=0.0)
    rng = hi - lo
    scale = torch.where(rng > 0, rng / INT4_QMAX, torch.ones_like(rng)).to(torch.bfloat16)
    s = scale.to(torch.float32)
    zero = torch.clamp(torch.round(-lo / s), 0, INT4_QMAX)
    q = torch.clamp(torch.round(wg / s[:, :, None]) + zero[:, :, None], 0, INT4_QMAX).to(torch.uint8)
    data = to_panels(pack_int4(q.view(N, K), group_size), group_size)
    # (N, G) views of group-major words: a tile's scales and zero points for one group are one load
    scales, zeros = scale_zero_views(pack_scale_zero(scale, zero.to(torch.uint8)))
    return QuantizedWeight(4, N, K, group_size, data, scales, zeros)


def quantize(w: torch.Tensor, bits: int, group_size: int = 128) -> QuantizedWeight:
    if bits == 8:
        return quantize_int8(w)
    if bits == 4:
        return quantize_int4(w, group_size)
    raise ValueError(f"bits: expected 8 or 4, got {bits!r}")


def round_trip(w: torch.Tensor, bits: int, group_size: int = 128) -> torch.Tensor:
    """Quantize then dequantize: the float32 weight the quantized model actually uses."""
    return quantize(w, bits, group_size).dequantize(torch.float32)


def quantization_error(w: torch.Tensor, qw: QuantizedWeight) -> float:
    """‖w − dequantize(qw)‖ / ‖w‖ (Frobenius, float64): how much the weight moved."""
    w64 = w.detach().to(torch.float64).cpu()
    d64 = qw.dequantize(torch.float64).cpu()
    den = torch.linalg.vector_norm(w64).item()
    num = torch.linalg.vector_norm(w64 - d64).item()
    return num / den if den else num
