"""FP8 matmuls for the frozen base weights of a LoRA-trained transformer (`model.fp8`: true, or auto on GPUs with them).

Every frozen `nn.Linear` whose sizes the FP8 kernels accept becomes an `FP8Linear`: its weight is stored twice in
float8 e4m3 with one float32 scale per row — W (out × in) scaled per output row for the forward `y = x·Wᵀ`, and Wᵀ
scaled per input column for the input gradient `dx = dy·W` — and activations (e4m3) and output gradients (e5m2,
the wider range gradients need) are scaled per row on the fly. No weight gradient exists (the base is frozen);
LoRA adapters, norms, attention and all step math keep their precision. Rollout, reference and training passes
all go through the same kernels, so the PPO ratio at the first update is 1 up to kernel determinism.

Numerics (tests/test_fp8.py): relative error of one layer against float64 ≈ 3–4e-2 (e4m3 keeps 3 mantissa
bits); H100/H200 run these matmuls at about twice the bf16 rate (docs/performance.md has the measured effect).
"""

from __future__ import annotations

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def quantize_rows(x: torch.Tensor, dtype: torch.dtype = E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, C) -> (q (R, C) in `dtype`, scale (R, 1) float32) with x ≈ q·scale and |q| ≤ the format's max."""
    amax = x.detach().abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / torch.finfo(dtype).max
    return (x.float() / scale).to(dtype), scale


def _scaled_mm(a_q, a_scale, b_q_colmajor, b_scale_row, out_dtype):
    return torch._scaled_mm(a_q, b_q_colmajor, scale_a=a_scale, scale_b=b_scale_row, out_dtype=out_dtype)


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


# The matmul is a registered op (not a torch.autograd.Function): torch.compile's AOTAutograd cache refuses graphs
# holding an autograd.Function, so every FP8 graph recompiled from scratch in each process, compile cache or not.
# `x` is an input only to route its gradient; the forward reads its quantised copy (x_q, x_scale), which stays in
# the traced graph so that inductor fuses the quantisation with the ops before it.
@torch.library.custom_op("polyrl::fp8_matmul", mutates_args=())
def fp8_matmul(x: torch.Tensor, x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
               wt_q: torch.Tensor, wt_scale: torch.Tensor) -> torch.Tensor:
    """y = (x_q·x_scale) (w_q·w_scale)ᵀ in float8 with float32 accumulation; dy/dx as `_fp8_matmul_backward`."""
    return _scaled_mm(x_q, x_scale, w_q.t(), w_scale.t(), _out_dtype(x))


@fp8_matmul.register_fake
def _(x, x_q, x_scale, w_q, w_scale, wt_q, wt_scale):
    return x.new_empty((x.shape[0], w_q.shape[0]), dtype=_out_dtype(x))


def _fp8_matmul_setup(ctx, inputs, output):
    x, _, _, _, _, wt_q, wt_scale = inputs
    ctx.save_for_backward(wt_q, wt_scale)
    ctx.out_dtype = _out_dtype(x)


def _fp8_matmul_backward(ctx, grad_out):
    """dx = q(dy)·W with dy quantised per row in e5m2 (the gradient's range) and W per input column."""
    wt_q, wt_scale = ctx.saved_tensors
    g_q, g_scale = quantize_rows(grad_out.contiguous(), E5M2)
    grad_x = _scaled_mm(g_q, g_scale, wt_q.t(), wt_scale.t(), ctx.out_dtype)
    return grad_x, None, None, None, None, None, None


fp8_matmul.register_autograd(_fp8_matmul_backward, setup_context=_fp8_matmul_setup)


class FP8Linear(torch.nn.Module):
    """A frozen linear layer computed with float8 operands and float32 accumulation, bf16 output."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()
        w_q, w_scale = quantize_rows(w)  # per output row: the forward's column scales
        wt_q, wt_scale = quantize_rows(w.t().contiguous())  # per input column: the input gradient's
        self.register_buffer("w_q", w_q.contiguous(), persistent=False)
        self.register_buffer("w_scale", w_scale, persistent=False)
        self.register_buffer("wt_q", wt_q.contiguous(), persistent=False)
        self.register_buffer("wt_scale", wt_scale, persistent=False)
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        rows = x2.shape[0]
        pad = (-rows) % 16  # the FP8 kernels want every dimension a multiple of 16
        if pad:
            x2 = torch.nn.functional.pad(x2, (0, 0, 0, pad))
        x2 = x2.contiguous()
        x_q, x_scale = quantize_rows(x2.detach())
        y = fp8_matmul(x2, x_q, x_scale, self.w_q, self.w_scale, self.wt_q, self.wt_scale)[:rows]
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8=e4m3/e5m2 rowwise"


def fp8_supported(device: torch.device) -> bool:
    """Whether `device` has float8 tensor cores (`torch._scaled_mm` at speed): CUDA compute capability >= 8.9."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def resolve_fp8(setting: bool | str, device: torch.device, lora: bool, sharded: bool, dtype: str) -> bool:
    """`model.fp8`: true / false as given; `auto` turns it on where it runs and pays — a LoRA run (the base is frozen)
    of a network already in 16-bit (`model.dtype` bfloat16 / float16: a float32 run asks for precision), on an actor
    that keeps whole layers (not sharded), on a device with float8 tensor cores."""
    if setting != "auto":
        return bool(setting)
    return lora and dtype in ("bfloat16", "float16") and not sharded and fp8_supported(device)


def apply_fp8(module: torch.nn.Module, min_features: int = 256) -> int:
    """Swap every frozen `nn.Linear` (sizes multiples of 16, both ≥ `min_features`) for an `FP8Linear`.

    Trainable layers (LoRA A/B, a full fine-tune) are left alone. Returns how many layers were swapped.
    """
    swapped = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if (type(child) is torch.nn.Linear and not child.weight.requires_grad
                    and child.in_features % 16 == 0 and child.out_features % 16 == 0
                    and min(child.in_features, child.out_features) >= min_features):
                setattr(parent, name, FP8Linear(child))
                swapped += 1
    return swapped
