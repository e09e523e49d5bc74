"""The LM head as one kernel: every column, or chosen ones, with bitwise the same values.

The embedded model's head (129,280 x 256, fp32) is most of a CPU step, and how
the matmul is computed decides its cost. `torch.nn.functional.linear` goes to
MKL, whose kernels for a few rows are slow on the CPUs measured; oneDNN over
a weight reordered once into its blocked layout (what vLLM's CPU engine does,
`create_onednn_mm`) is faster from a few rows on and close to vLLM's own
kernel (docs/benchmarks.md, "The LM head's kernel", has the figures). So on
the CPU, in fp32, the head is `PackedKernel`; elsewhere (CUDA, other dtypes)
`PlainKernel`, F.linear.

The sparse head (sparse_head.py) computes the same head at a few columns
only, and the engine relies on those values being bitwise the full head's
there (the draws and logprobs do not change). Each kernel has a column form
that is, on the machines measured: oneDNN over the plain gathered rows
(a row's result does not depend on the batch, but the one-row and
one-column kernels round differently, so those are computed as two); MKL
over a multiple of 64 columns. The oneDNN head's rows are also independent
of each other (MKL's are not: its kernels change with the row count), so a
step can compute the full head for the rows that need every logit and
columns only for the others (the partial head, sparse_head.py). Because
these are properties of the kernels a CPU picks, not promises,
`LmHead.create` checks them on the real weight at start-up and steps down:
packed -> plain -> plain without a column form (the engine then never uses
the sparse head); it checks the bfloat16 greedy screen (greedy_head.py) the
same way before offering it.
"""

from __future__ import annotations

import logging

import torch

from inference_svc.model.head.greedy_head import GreedyScreen

log = logging.getLogger(__name__)

# Plain kernel: columns computed in multiples of this. With MKL a matmul over 1-3, 7, 9, 15, 17, 31, 33, ...
# columns rounds some logits 1 ulp away from the full head's; over multiples of 64 it matched bitwise for
# every width and row count tried (tests/test_lm_head.py pins it).
COLUMN_QUANTUM = 64

# The start-up check: row counts (1 and a few: kernels are picked by shape) and column widths (narrow,
# odd, one quantum, wide).
CHECK_ROWS = (1, 3, 16)
CHECK_WIDTHS = (1, 7, 64, 1000)
# ... and whether rows are independent: subsets of a 24-row batch.
CHECK_BATCH = 24
CHECK_SUBSETS = (1, 2, 5, 13)


class PlainKernel:
    """F.linear (MKL on the CPU, cuBLAS on CUDA); columns padded to COLUMN_QUANTUM."""

    name = "plain"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight
        self.bias = bias

    def full(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.weight, self.bias)

    def columns(self, hidden: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        n = cols.numel()
        pad = -n % COLUMN_QUANTUM
        # Padded with id 0 (dropped after).
        at = torch.cat([cols, cols.new_zeros(pad)]) if pad else cols
        bias = self.bias.index_select(0, at) if self.bias is not None else None
        return torch.nn.functional.linear(hidden, self.weight.index_select(0, at), bias)[:, :n]


class PackedKernel:
    """oneDNN's linear over the weight reordered into its blocked layout once (a second copy of the head)."""

    name = "onednn_packed"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight
        self.bias = bias
        # The batch size is a hint for the layout only: the values are the same for any (checked at 1, 8, 32, 64).
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)

    def full(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(hidden, self._packed, self.bias, "none", [], "")

    def columns(self, hidden: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        rows, n = hidden.shape[0], cols.numel()
        # oneDNN's kernels for one row or one column over the plain rows round differently; from two rows and
        # two columns on they are the full head's (every width from 2 to 69, 127-129, 1000, 4097 checked).
        if rows == 1:
            hidden = torch.cat([hidden, hidden])
        at = torch.cat([cols, cols.new_zeros(1)]) if n == 1 else cols
        bias = self.bias.index_select(0, at) if self.bias is not None else None
        return torch.ops.mkldnn._linear_pointwise(hidden, self.weight.index_select(0, at), bias,
                                                  "none", [], "")[:rows, :n]

    @staticmethod
    def available(weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.float32
                and torch.backends.mkldnn.is_available())


class LmHead:
    """`full(hidden)`: float32 logits [rows, V]; `columns(hidden, cols)`: the same values at `cols` (sorted
    int64) alone, when `exact_columns`; `rows_independent`: a row's logits are the same whichever rows are
    computed with it (so some rows of a step may get the full head and the others columns only)."""

    def __init__(self, kernel, *, exact_columns: bool, rows_independent: bool = False,
                 screen: GreedyScreen | None = None):
        self.kernel = kernel
        self.exact_columns = exact_columns
        self.rows_independent = rows_independent
        # The bfloat16 screen of greedy rows (greedy_head.py): only with exact columns to finish them.
        self.screen = screen

    @property
    def name(self) -> str:
        return self.kernel.name

    @classmethod
    def create(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, *, packed: bool = True,
               screen: bool = True) -> "LmHead":
        """The fastest kernel whose column form is checked bitwise on this machine (see the module doc);
        screen: with a greedy screen where this machine has one (greedy_head.py)."""
        kernels = []
        if packed and PackedKernel.available(weight):
            try:
                kernels.append(PackedKernel(weight, bias))
            except RuntimeError as e:  # this torch build's oneDNN cannot take the weight: MKL it is
                log.warning("LM head: oneDNN cannot pack the head weight (%s); using F.linear", e)
        kernels.append(PlainKernel(weight, bias))
        for kernel in kernels:
            if _columns_match(kernel, weight):
                independent = _rows_match(kernel, weight)
                # The engine screens only with independent rows (a screen's fallback rows get the full head
                # beside the others' columns): no bfloat16 copy of the head that would never be used.
                greedy = GreedyScreen.create(weight, kernel.full) if screen and independent and bias is None else None
                return cls(kernel, exact_columns=True, rows_independent=independent, screen=greedy)
            log.warning("LM head: the %s kernel's column form is not bitwise its full head on this machine",
                        kernel.name)
        log.warning("LM head: no kernel computes exact columns here; the sparse head is off")
        return cls(kernels[-1], exact_columns=False)

    @torch.inference_mode()
    def full(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.kernel.full(hidden).float()

    @torch.inference_mode()
    def columns(self, hidden: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        if not self.exact_columns:
            raise RuntimeError("this LM head has no exact column form on this machine (see the start-up log)")
        return self.kernel.columns(hidden, cols).float()


@torch.inference_mode()
def _rows_match(kernel, weight: torch.Tensor) -> bool:
    """Whether a row's full head is the same computed alone, in a few rows, or in a step's worth."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(CHECK_BATCH, weight.shape[1], generator=g).to(dtype=weight.dtype, device=weight.device)
    full = kernel.full(hidden)
    for rows in CHECK_SUBSETS:
        pick = torch.randperm(CHECK_BATCH, generator=g)[:rows].sort().values.to(weight.device)
        if not torch.equal(kernel.full(hidden.index_select(0, pick)), full.index_select(0, pick)):
            return False
    return True


@torch.inference_mode()
def _columns_match(kernel, weight: torch.Tensor) -> bool:
    vocab, width = weight.shape
    g = torch.Generator().manual_seed(0)
    for rows in CHECK_ROWS:
        hidden = torch.randn(rows, width, generator=g).to(dtype=weight.dtype, device=weight.device)
        full = kernel.full(hidden)
        for n in CHECK_WIDTHS:
            cols = torch.randperm(vocab, generator=g)[:min(n, vocab)].sort().values.to(weight.device)
            if not torch.equal(kernel.columns(hidden, cols), full.index_select(1, cols)):
                return False
    return True
