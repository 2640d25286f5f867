"""Ulysses sequence parallel, applied from outside a plain network by its plan (distributed/plan.py).

Every sp rank of a group holds the same samples. After the modules named in the plan's `split` (e.g. SD3's patch
embedder for the image tokens, its context embedder for the text tokens), and before those named in `split_inputs`
for the arguments named there (e.g. Wan's first block for the video tokens, whose patch embedder makes them inside
the network's forward), each stream (B, S, D) is padded to a multiple of sp and each rank keeps its contiguous 1/sp
of the tokens; everything outside attention acts per token and runs on that share. Per-token side inputs of a
stream are split with it, padded alike (Wan: the rotary table (1, S, 1, d) from `rope`'s output tuple, the per-token
timesteps (B, S) of Wan2.2-TI2V, so its time embeddings are computed for the local tokens only); a tensor of one
dimension (B,) has no tokens and passes whole (Wan's per-sample timestep). A stream split twice in one forward must
have the same length each time (checked). Inside each attention module of the plan, the scaled-dot-product
attention call (B, H, S/sp, D) is swapped (a TorchFunctionMode, so any attention processor that calls
`F.scaled_dot_product_attention` works unchanged) for: all-to-all to (B, H/sp, S, D), attention over the whole
sequence, all-to-all back. After the `gather` modules (SD3: `proj_out`) the image tokens are gathered back, so the
network's output is whole and equal on every sp rank.

Padded tokens are masked as keys. A joint attention's sequence on rank r is its streams' shares in plan `order`
([image_r, text_r] for SD3), so after the all-to-all the full key sequence is [image_0, text_0, image_1, text_1, …]:
the key mask is built in that interleaved order (a mask in the contiguous [image, text] order would mask the wrong
keys). Attention is permutation-invariant over keys, so the order itself changes nothing else.

Gradients: the loss is computed from the gathered output on every sp rank alike, so the gather's backward keeps
this rank's slice of the (equal) incoming gradient, and each rank's parameter gradients are the contributions of
its own tokens: their sum over the sp ranks (FSDP2's reduce-scatter over a mesh that includes sp, with a divide
factor of 1) is the 1-process gradient.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class SequenceShards:
    """One network's sp group and, for the forward in flight, each stream's (real length, padded length)."""

    def __init__(self, group, size: int | None = None, rank: int | None = None):
        self.group = group  # None with an explicit size and rank: the bookkeeping alone (tests)
        self.size = dist.get_world_size(group) if size is None else size
        self.rank = dist.get_rank(group) if rank is None else rank
        self.lengths: dict[str, tuple[int, int]] = {}
        self._masks: dict = {}

    def split(self, stream: str, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the tokens of x (B, S, ...), after zero-padding S to a multiple of sp."""
        real = x.shape[1]
        padded = -(-real // self.size) * self.size
        if self.lengths.get(stream, (real,))[0] != real:
            raise ValueError(f"sequence parallel: stream {stream!r} split with {real} tokens here but "
                             f"{self.lengths[stream][0]} earlier in this forward (the plan splits inputs of unequal "
                             "lengths into one stream)")
        self.lengths[stream] = (real, padded)
        if padded != real:
            x = F.pad(x, (0,) * (2 * (x.dim() - 2)) + (0, padded - real))
        share = padded // self.size
        return x.narrow(1, self.rank * share, share)

    def gather(self, stream: str, x: torch.Tensor) -> torch.Tensor:
        """The whole stream (B, S, ...) from every rank's share, padding removed."""
        real, _ = self.lengths[stream]
        return _GatherTokens.apply(x, self.group).narrow(1, 0, real)

    def key_mask(self, streams: list[str], device) -> torch.Tensor | None:
        """Which keys of the gathered sequence are real tokens (None: all of them), in the all-to-all's order:
        rank 0's share of each stream in `streams` order, then rank 1's, … Built once per layout (no device sync
        per attention call)."""
        lengths = tuple(self.lengths[s] for s in streams)
        if all(real == padded for real, padded in lengths):
            return None
        key = (lengths, str(device))
        if key not in self._masks:
            parts = []
            for r in range(self.size):
                for real, padded in lengths:
                    share = padded // self.size
                    parts.append(torch.arange(r * share, (r + 1) * share) < real)
            self._masks[key] = torch.cat(parts).to(device)
        return self._masks[key]

    def local_length(self, stream: str) -> int:
        return self.lengths[stream][1] // self.size


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 1 in the forward; the backward keeps this rank's slice (every rank's incoming gradient
    is the same, since every rank computes the same loss from the gathered tensor)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.share = group, x.shape[1]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):
        rank = dist.get_rank(ctx.group)
        return grad.narrow(1, rank * ctx.share, ctx.share).contiguous(), None


def _all_to_all(x: torch.Tensor, group, scatter_heads: bool) -> torch.Tensor:
    """(B, H, S_local, D) -> (B, H/sp, sp·S_local, D) (scatter_heads), or the inverse."""
    sp = dist.get_world_size(group)
    b, h, s, d = x.shape
    if scatter_heads:  # send head chunk j to rank j; receive every rank's tokens of my heads
        send = x.reshape(b, sp, h // sp, s, d).transpose(0, 1).contiguous()
    else:  # send token chunk j (rank j's positions) back to rank j; receive my positions of every head chunk
        send = x.reshape(b, h, sp, s // sp, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    if scatter_heads:  # recv[j] = rank j's tokens of my heads: (sp, B, H/sp, S_local, D)
        return recv.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)
    return recv.transpose(0, 1).reshape(b, sp * h, s // sp, d)  # recv[j] = my tokens of head chunk j


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_heads):
        ctx.group, ctx.scatter_heads = group, scatter_heads
        return _all_to_all(x, group, scatter_heads)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad.contiguous(), ctx.group, not ctx.scatter_heads), None, None


def ulysses_attention(q, k, v, shards: SequenceShards, streams: list[str], sdpa=F.scaled_dot_product_attention,
                      **kwargs) -> torch.Tensor:
    """Attention over the whole sequence from each rank's share of tokens, inputs and output (B, H, S_local, D)."""
    if kwargs.get("attn_mask") is not None or kwargs.get("is_causal"):
        raise NotImplementedError("sequence parallel attention with the processor's own mask or causal attention")
    kwargs.pop("attn_mask", None)
    if q.shape[1] % shards.size:
        raise ValueError(f"{q.shape[1]} heads on this rank cannot be split over sp={shards.size} ranks")
    q, k, v = (_AllToAll.apply(t, shards.group, True) for t in (q, k, v))
    valid = shards.key_mask(streams, q.device)
    mask = None if valid is None else valid.view(1, 1, 1, -1)
    out = sdpa(q, k, v, attn_mask=mask, **kwargs)
    return _AllToAll.apply(out, shards.group, False)


class _UlyssesMode(TorchFunctionMode):
    """Routes `F.scaled_dot_product_attention` calls to `ulysses_attention` (every other call passes through)."""

    def __init__(self, shards: SequenceShards, streams: list[str]):
        super().__init__()
        self.shards, self.streams = shards, streams

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            # by position or by keyword (diffusers' native backend passes query=, key=, value=)
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
            kwargs = {**dict(zip(names, args, strict=False)), **kwargs}
            q, k, v = kwargs.pop("query"), kwargs.pop("key"), kwargs.pop("value")
            # the mode is off while its handler runs: the attention below is the real one
            return ulysses_attention(q, k, v, self.shards, self.streams, func, **kwargs)
        return func(*args, **kwargs)


def _wrap_forward(module: torch.nn.Module, shards: SequenceShards, streams: list[str]) -> None:
    plain = module.forward

    def forward(*args, **kwargs):
        with _UlyssesMode(shards, streams):
            return plain(*args, **kwargs)

    module.forward = forward


def _split_tokens(shards: SequenceShards, stream: str, x):
    """x split along its tokens (dim 1); a tuple or list element by element; a tensor of one dimension (one value
    per sample, no tokens) and anything else whole."""
    if isinstance(x, (tuple, list)):
        return type(x)(_split_tokens(shards, stream, item) for item in x)
    if isinstance(x, torch.Tensor) and x.dim() >= 2:
        return shards.split(stream, x)
    return x


def _split_arguments_hook(module: torch.nn.Module, arguments: dict[str, str], shards: SequenceShards):
    """A forward pre-hook (with kwargs) splitting the named arguments of `module.forward`, given by keyword or by
    position."""
    names = list(inspect.signature(module.forward).parameters)
    missing = sorted(set(arguments) - set(names))
    if missing:
        raise ValueError(f"{type(module).__name__}.forward has no argument {missing} (sequence plan `split_inputs`)")
    where = {name: names.index(name) for name in arguments}

    def hook(module, args, kwargs):
        args = list(args)
        for name, stream in arguments.items():
            if name in kwargs:
                kwargs[name] = _split_tokens(shards, stream, kwargs[name])
            elif where[name] < len(args):
                args[where[name]] = _split_tokens(shards, stream, args[where[name]])
        return tuple(args), kwargs

    return hook


def apply_sequence_parallel(network: torch.nn.Module, plan: dict, group) -> SequenceShards:
    """Install the plan's token split / gather hooks and the all-to-all attention on `network` (in place)."""
    seq = plan["sequence"]
    shards = SequenceShards(group)
    # each forward records its streams' lengths afresh (a stream split twice in one forward must agree)
    network.register_forward_pre_hook(lambda module, args: shards.lengths.clear())
    for name, arguments in seq.get("split_inputs", {}).items():
        module = network.get_submodule(name)
        module.register_forward_pre_hook(_split_arguments_hook(module, arguments, shards), with_kwargs=True)
    for name, stream in seq.get("split", {}).items():
        network.get_submodule(name).register_forward_hook(
            lambda module, args, out, stream=stream: _split_tokens(shards, stream, out))
    for name, stream in seq["gather"].items():
        network.get_submodule(name).register_forward_hook(
            lambda module, args, out, stream=stream: shards.gather(stream, out))
    found = 0
    for block in getattr(network, plan["blocks"]):
        for name, streams in seq["attention"].items():
            attention = getattr(block, name, None)
            if attention is not None:
                _wrap_forward(attention, shards, list(streams))
                found += 1
    if not found:
        raise ValueError(f"{type(network).__name__}: no attention module {sorted(seq['attention'])} in its blocks")
    return shards
