"""The model body through `torch.compile` (inductor), at a few bucketed token counts.

`--compile default|max-autotune` compiles the decoder stack of the causal LM
(embeddings, layers, final norm; the LM head stays eager: compiling it does
not make a 129k-wide matmul faster) once per bucket size at start-up.

How the paged attention fits in a compiled graph: the attention function
(attention.py) runs data-dependent Python per step (one SDPA call per
prefill chunk, a padded call for the decodes), which inductor cannot trace.
As vLLM does, the model is switched to an attention implementation that
calls one opaque custom op, `structd::paged_attention(q, k, v, layer)`; the op
reads the step's `PagedAttentionContext` from this module (set around each
forward, never a graph input) and runs the eager attention function on it.
The graph around it (projections, RoPE, norms, MLP) is compiled; the op is
tagged cudagraph-unsafe, so on CUDA inductor captures CUDA graphs of the
pieces between attention calls (graph partitions), as vLLM's piecewise
capture does.

Buckets: each compiled graph has static shapes, so a step's tokens are
padded up to the next bucket. Padded tokens (id 0, position 0) are sliced off
before the attention op, so they never write a KV slot nor reach a real
token's attention, and every other op of the body works token by token, so
real tokens' hidden states do not depend on them. A step larger than the
largest bucket runs the same body eagerly.

Disk cache: inductor's FX graph and AOTAutograd caches live under
`--compile-cache-dir` (TORCHINDUCTOR_CACHE_DIR), so a restart reuses the
generated kernels and only re-traces (seconds instead of a compile).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from inference_svc.model.attention import CONTEXT_KWARG, paged_attention_forward
from inference_svc.config import COMPILE_MODES

log = logging.getLogger(__name__)

# The attention implementation whose layers call the custom op (attention.py's is "structd_paged").
OP_ATTN_IMPLEMENTATION = "structd_paged_op"

Progress = Callable[[str], None]


def default_compile_cache_dir() -> Path:
    """~/.cache/structd/inductor (or $XDG_CACHE_HOME/structd/inductor)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "structd" / "inductor"


def inductor_mode(mode: str, device: torch.device) -> str | None:
    """torch.compile's mode for a --compile value: CUDA graphs on CUDA only (a CPU has none to capture)."""
    if mode not in COMPILE_MODES or mode == "off":
        raise ValueError(f"no inductor mode for --compile {mode}")
    if device.type == "cuda":
        return "reduce-overhead" if mode == "default" else "max-autotune"
    return None if mode == "default" else "max-autotune-no-cudagraphs"


def captures_cuda_graphs(inductor_mode_name: str | None) -> bool:
    """Whether torch.compile's mode captures CUDA graphs (inductor_mode gives these on CUDA only)."""
    return inductor_mode_name in ("reduce-overhead", "max-autotune")


def check_graph_partition(inductor_mode_name: str | None) -> None:
    """Refuses CUDA graphs without inductor's graph partitioning: only partitioning keeps the opaque attention
    op out of the captured graphs; captured, it would replay one step's KV slots on every later step."""
    import torch._inductor.config as inductor_config

    if captures_cuda_graphs(inductor_mode_name) and not getattr(inductor_config, "graph_partition", False):
        raise RuntimeError(
            "--compile with CUDA graphs needs inductor's graph partitioning (torch._inductor.config."
            "graph_partition), which is off or missing in this torch: the paged attention op would be captured "
            "with one step's KV slots; use --compile off, or a torch with graph partitioning on")


def adopt_cudagraph_state() -> None:
    """Gives the calling thread its own CUDA graph trees state (one tree manager per device) if it has none.

    cudagraph_trees sets that state up for the thread that imports it (and threads autograd starts); torch
    2.13 sets it up for any other thread on first use, but older releases (2.11, a GPU image's) assert
    there instead, so a server whose device thread was not the importer (a second server in one process, or
    torch imported elsewhere first) failed its warm-up. Setting it up here is what torch 2.13 does itself."""
    from collections import defaultdict

    from torch._inductor import cudagraph_trees

    local = cudagraph_trees.local
    if hasattr(local, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers"):
        return
    local.tree_manager_containers = {}
    local.tree_manager_locks = defaultdict(threading.Lock)
    torch._C._stash_obj_in_tls("tree_manager_containers", local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", local.tree_manager_locks)


# The step being run by the compiled body: (context, real token count). Module state rather than a graph
# input, so the compiled graph neither traces nor guards on it; only the engine's forward thread sets it.
_step = threading.local()
# Set during warm-up: the op returns zeros and touches no KV cache.
_WARMUP = object()


@torch.library.custom_op("structd::paged_attention", mutates_args=(), tags=(torch._C.Tag.cudagraph_unsafe,))
def _paged_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
                        scaling: float) -> torch.Tensor:
    """[1, tokens, heads, head_dim] attention output for the padded step; rows past the real tokens are zero."""
    ctx, num_tokens = getattr(_step, "current", (None, 0))
    padded = query.shape[2]
    if ctx is _WARMUP:
        return query.new_zeros(1, padded, query.shape[1], query.shape[3])
    if ctx is None:
        raise RuntimeError("structd::paged_attention called outside a compiled step (no step context set)")
    out, _ = paged_attention_forward(
        SimpleNamespace(layer_idx=layer_idx), query[:, :, :num_tokens], key[:, :, :num_tokens],
        value[:, :, :num_tokens], None, scaling=scaling, **{CONTEXT_KWARG: ctx},
    )
    if num_tokens == padded:
        return out.contiguous()
    full = query.new_zeros(1, padded, query.shape[1], query.shape[3])
    full[:, :num_tokens] = out
    return full


@_paged_attention_op.register_fake
def _(query, key, value, layer_idx, scaling):
    return query.new_empty(1, query.shape[2], query.shape[1], query.shape[3])


def _op_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-interface signature, answered by the custom op (traced by dynamo)."""
    if attention_mask is not None:
        raise ValueError("paged attention takes no attention_mask: sequence boundaries come from the step context")
    return torch.ops.structd.paged_attention(query, key, value, module.layer_idx, float(scaling)), None


def register_op_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(OP_ATTN_IMPLEMENTATION, _op_attention)
    return OP_ATTN_IMPLEMENTATION


def configure_cache(cache_dir: Path) -> None:
    """Points inductor's on-disk caches at cache_dir (read by inductor when it first compiles)."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        writable = os.access(cache_dir, os.W_OK)
    except OSError:  # the operator's filesystem, e.g. the image's read-only cache under a read-only root
        writable = False
    if writable:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    else:
        log.warning("compile cache %s is not writable: inductor caches under its default (the temp dir); "
                    "--compile-cache-dir picks another", cache_dir)
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    inductor_config.autotune_local_cache = True
    torch._functorch.config.enable_autograd_cache = True


@dataclass(frozen=True)
class CompileSettings:
    mode: str  # one of COMPILE_MODES except "off"
    buckets: tuple[int, ...]
    cache_dir: Path


class CompiledBody:
    """The decoder stack of a causal LM, compiled per bucket; installed in place of its forward.

    The causal LM's own forward (the LM head, logits_to_keep) still runs
    eagerly and calls the body as before, with the step context in its
    kwargs; the body pads, sets the context for the op, runs the compiled
    graph and slices the padding off the hidden states.
    """

    def __init__(self, model, settings: CompileSettings):
        self.settings = settings
        self.buckets = tuple(sorted(set(settings.buckets)))
        self.device = next(model.parameters()).device
        body = model.get_decoder()
        self._eager = body.forward
        configure_cache(settings.cache_dir)
        # One static graph per bucket, cached on the decoder's code object, which every model of the same
        # class shares: each installed body adds its buckets to dynamo's limit (past it, fullgraph fails).
        torch._dynamo.config.recompile_limit += len(self.buckets)
        torch._dynamo.config.accumulated_recompile_limit += len(self.buckets)
        mode = inductor_mode(settings.mode, self.device)
        check_graph_partition(mode)
        # CUDA graph trees keep per-thread state: graphs recorded on one thread are recorded again (and a second
        # pool kept) when another replays them; forwards must run where warm_up ran.
        self._graphs = captures_cuda_graphs(mode)
        self._warmed_on: threading.Thread | None = None
        self._compiled = torch.compile(self._eager, mode=mode, dynamic=False, fullgraph=True)
        model.set_attn_implementation(register_op_attention())
        body.forward = self.forward

    @classmethod
    def install(cls, model, settings: CompileSettings, progress: Progress | None = None) -> "CompiledBody":
        """Compiles the body for every bucket now (a progress line per bucket), so no request waits for it."""
        compiled = cls(model, settings)
        compiled.warm_up(progress)
        return compiled

    def bucket_for(self, num_tokens: int) -> int | None:
        for size in self.buckets:
            if size >= num_tokens:
                return size
        return None

    def warm_up(self, progress: Progress | None = None) -> None:
        say = progress or log.info
        started = time.perf_counter()
        say(f"compiling the model body ({self.settings.mode}) for {len(self.buckets)} token buckets "
            f"{list(self.buckets)}, cache {self.settings.cache_dir}")
        self._warmed_on = threading.current_thread()
        if self._graphs:
            adopt_cudagraph_state()
        # Under CUDA graphs a bucket's first run is cudagraph trees' warm-up and its second records the graph:
        # two runs here, so no request pays for a recording.
        runs = 2 if self._graphs else 1
        for i, size in enumerate(self.buckets, 1):
            t0 = time.perf_counter()
            # Inference tensors, as the runner's are: dynamo guards on the dispatch keys too.
            with torch.inference_mode():
                ids = torch.zeros(1, size, dtype=torch.long, device=self.device)
                for _ in range(runs):
                    if self._graphs:
                        torch.compiler.cudagraph_mark_step_begin()
                    self._run(self._compiled, _WARMUP, size, **self._plain_call(ids, ids.clone()))
            say(f"  bucket {size:>4} tokens compiled ({i}/{len(self.buckets)}, {time.perf_counter() - t0:.1f} s)")
        say(f"model body compiled in {time.perf_counter() - started:.1f} s")

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        ctx = kwargs.pop(CONTEXT_KWARG, None)
        if ctx is None:
            raise RuntimeError("the compiled body needs a step context: call it through PagedModelRunner")
        num_tokens = input_ids.shape[1]
        size = self.bucket_for(num_tokens)
        # The graphs were traced for the runner's plain call; anything else (a cache, embeddings given, ...)
        # would make dynamo guard-fail and recompile on the request path, so it runs eagerly.
        plain = all(v is None or (k == "use_cache" and not v) for k, v in kwargs.items())
        if size is None or not plain:
            return self._run(self._eager, ctx, num_tokens, input_ids=input_ids, position_ids=position_ids,
                             **kwargs)
        pad = size - num_tokens
        if pad:
            # Token 0 at position 0: any valid id and position; the op drops these rows before attention.
            input_ids = torch.nn.functional.pad(input_ids, (0, pad))
            position_ids = torch.nn.functional.pad(position_ids, (0, pad))
        if self._graphs and threading.current_thread() is not self._warmed_on:
            raise RuntimeError(
                f"compiled body warmed up on thread {getattr(self._warmed_on, 'name', None)!r} but run on "
                f"{threading.current_thread().name!r}: CUDA graphs must replay on the thread that recorded them")
        if self.device.type == "cuda":
            # Each step is a new iteration of the captured graphs (their earlier outputs may be overwritten).
            torch.compiler.cudagraph_mark_step_begin()
        out = self._run(self._compiled, ctx, num_tokens, **self._plain_call(input_ids, position_ids))
        if pad:
            # A view: the LM head reads it before the next step (under CUDA graphs, the next replay
            # overwrites the buffer it lives in).
            out.last_hidden_state = out.last_hidden_state[:, :num_tokens]
        return out

    @staticmethod
    def _plain_call(input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict:
        """The one set of arguments the graphs are traced and called with (dynamo guards on them)."""
        return dict(input_ids=input_ids, position_ids=position_ids, attention_mask=None, use_cache=False)

    @staticmethod
    def _run(fn, ctx, num_tokens: int, **kwargs):
        _step.current = (ctx, num_tokens)
        try:
            return fn(**kwargs)
        finally:
            _step.current = (None, 0)

