"""The small two-block model the single-process adapter-file tests adapt, save and load."""

import copy

import torch
import torch.nn as nn

from parallel_lora import LoRAConfig, apply_lora

TARGETS = ("q_proj", "up_proj", "down_proj")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(12, 12)
        self.up_proj = nn.Linear(12, 20, bias=False)
        self.down_proj = nn.Linear(20, 12)
        self.head = nn.Linear(12, 12)  # not adapted

    def forward(self, x):
        return self.head(self.down_proj(torch.relu(self.up_proj(self.q_proj(x)))))


def base_model():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def adapted(base, r=4, alpha=8, seed=1):
    torch.manual_seed(seed)
    model = apply_lora(copy.deepcopy(base), LoRAConfig(r=r, alpha=alpha, target_modules=TARGETS), verbose=False)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p)
    return model


def adapter_state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" in k}

