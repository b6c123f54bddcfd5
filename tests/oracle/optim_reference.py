#!/usr/bin/env python3
"""torch.optim trajectories for tests/test_optim.cpp: optim_reference.py OUT.pt

Writes a TorchScript module whose buffers hold, for every optimizer setting below, 40 steps of
torch.optim on two parameters (a [8, 16] matrix with weight decay and a [16] vector without), fed
the same random gradients: the initial weights, the gradients of each step, the learning rate of
each step (a warmup then a decay, so that bias corrections and decays are exercised together),
and the weights after each step. Gradient scales vary over steps and elements so that Adam's
first update is not lr * sign(g) for every element.
"""
import sys

import torch

STEPS = 40
SETTINGS = {  # name: (class, kwargs)
    "adamw": (torch.optim.AdamW, dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)),
    "adam_l2": (torch.optim.Adam, dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)),
    "sgd_momentum": (torch.optim.SGD, dict(momentum=0.9, weight_decay=0.01)),
    "sgd_nesterov": (torch.optim.SGD, dict(momentum=0.8, nesterov=True, weight_decay=0.02)),
    "sgd_plain": (torch.optim.SGD, dict(momentum=0.0, weight_decay=0.0)),
}


class Reference(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1234)
        w0 = torch.randn(8, 16, generator=g) * 0.5
        b0 = torch.randn(16, generator=g) * 0.5
        scale = torch.logspace(-3, 0, STEPS).unsqueeze(1)
        gw = torch.randn(STEPS, 8 * 16, generator=g) * scale * torch.rand(8 * 16, generator=g)
        gb = torch.randn(STEPS, 16, generator=g) * scale
        lrs = torch.tensor([0.05 * min(1.0, (s + 1) / 5) * (1 - 0.5 * s / STEPS) for s in range(STEPS)])
        self.register_buffer("w0", w0)
        self.register_buffer("b0", b0)
        self.register_buffer("grad_w", gw)
        self.register_buffer("grad_b", gb)
        self.register_buffer("lr", lrs)
        for name, (cls, kw) in SETTINGS.items():
            w = w0.clone().requires_grad_(True)
            b = b0.clone().requires_grad_(True)
            wd = kw.pop("weight_decay")
            opt = cls([{"params": [w], "weight_decay": wd}, {"params": [b], "weight_decay": 0.0}], lr=0.1, **kw)
            kw["weight_decay"] = wd
            tw, tb = [], []
            for s in range(STEPS):
                for group in opt.param_groups:
                    group["lr"] = float(lrs[s])
                w.grad = gw[s].reshape(8, 16).clone()
                b.grad = gb[s].clone()
                opt.step()
                tw.append(w.detach().reshape(-1).clone())
                tb.append(b.detach().clone())
            self.register_buffer(f"{name}_w", torch.stack(tw))
            self.register_buffer(f"{name}_b", torch.stack(tb))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


torch.jit.script(Reference()).save(sys.argv[1])
print(f"wrote {sys.argv[1]}: {len(SETTINGS)} settings x {STEPS} steps of torch {torch.__version__}")
